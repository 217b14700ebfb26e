"""A lossy or jittery link, as a message over TCP sees it: the extra time before it is whole.

The in-process network (:class:`hopnet.transports.inproc.InprocNetwork`) adds this to a
message's latency and transfer time. The model, per message of ``nbytes``:

- it travels as ``ceil(nbytes / MSS)`` segments (one at least: a header);
- **jitter**: each segment is delayed by an extra uniform in ``[-jitter, +jitter]`` (never
  below no delay), and the message is whole when its last segment is: so a message of many
  segments arrives late by nearly the whole jitter, one of one segment by half of it on average;
- **loss**: each transmission of a segment is lost with probability ``loss``. A lost segment
  followed by others of the message is fast-retransmitted: it costs a round trip. A lost last
  segment is found by a tail-loss probe: 2 round trips + :data:`PROBE_MIN_S`, or + :data:`RTO_MIN_S`
  when it was alone, or the segments before it were all acknowledged by then (Linux waits for a
  delayed acknowledgement then; :data:`TAIL_ALONE_SHARE` of the time). A lost retransmission waits
  for the retransmission timeout (Linux: the round trip + :data:`RTO_MIN_S`, doubling for each
  further loss of the same segment). Losses in one message overlap: the message waits for its
  costliest one. A loss that waits for a timer is also found when the next message on the link
  arrives (its acknowledgement shows the hole): then the segment arrives a round trip after that
  message's first segment, if that is sooner (unless this retransmission is lost too: then a
  timeout more). While a link waits for a timeout, a message sent behind it that loses a segment
  waits for a timeout too, doubled (after a timeout Linux sends one segment a round trip and
  retransmits no more by acknowledgements until what was outstanding is through): at 5% loss
  the stalls chain. So on a busy link a loss costs about a round trip,
  and on a quiet one a timer.

The round trip is twice the link's latency, or ``rtt_s`` when given. Messages on a link stay in order (one TCP stream):
the network holds a message behind a retransmitted one before it.

Limits: no congestion window (a loss does not slow the messages after it beyond the head-of-line
wait), lost acknowledgements cost nothing (they are cumulative), reordering by jitter triggers no
spurious retransmission, and the group protocols' coordinator links (:mod:`hopnet.coordinator.sim`)
keep latency and bandwidth only.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

MSS = 1448
"""Payload bytes per TCP segment on an Ethernet link (1500 MTU, timestamps on)."""
RTO_MIN_S = 0.2
"""Linux's minimum retransmission timeout, added to the smoothed round trip."""
PROBE_MIN_S = 0.004
"""What a tail-loss probe waits beyond two round trips (Linux: 2 jiffies)."""
TAIL_ALONE_SHARE = 0.5
"""How often a lost last segment of several is the only one unacknowledged when its probe is due,
so that Linux adds :data:`RTO_MIN_S` to the probe's wait (for a delayed acknowledgement): about
half the time in a ping-pong of 4.8 kB messages over the forwarder at 1% loss (20 waits over
100 ms in 4,000 messages)."""


@dataclass(frozen=True)
class LinkFaults:
    """Per-segment loss probability and the jitter (seconds, +-) of one directed link."""

    loss: float = 0.0
    jitter_s: float = 0.0
    rtt_s: float | None = None
    """The round trip TCP's recovery waits (None: twice the link's latency). A measured transfer
    time holds the endpoints' processing too, which the kernel's round trip does not."""

    def __post_init__(self) -> None:
        if not (0.0 <= self.loss < 1.0) or not math.isfinite(self.jitter_s) or self.jitter_s < 0:
            raise ValueError(f"link faults: loss must be in [0, 1) and jitter >= 0 (got {self.loss}, {self.jitter_s})")

    def round_trip(self, latency_s: float) -> float:
        return 2 * latency_s if self.rtt_s is None else self.rtt_s

    def __bool__(self) -> bool:
        return self.loss > 0 or self.jitter_s > 0

    def extra_delay(self, rng: random.Random, nbytes: int, latency_s: float) -> tuple[float, bool]:
        """Seconds this message of ``nbytes`` arrives after it would on a clean link of ``latency_s``,
        and whether its last segment was lost (the next message on the link may reveal it sooner)."""
        segments = max(1, -(-nbytes // MSS))
        extra = 0.0
        if self.jitter_s > 0:
            # the latest of `segments` uniform draws in [-jitter, +jitter], by inverse transform
            latest = self.jitter_s * (2 * rng.random() ** (1.0 / segments) - 1)
            extra = max(latest, -latency_s)
        if self.loss <= 0:
            return extra, False
        delay, tail_lost = self._loss_delay(rng, segments, self.round_trip(latency_s))
        return extra + delay, tail_lost

    def _loss_delay(self, rng: random.Random, segments: int, rtt_s: float) -> tuple[float, bool]:
        """The loss's delay, and whether the last retransmission the message waits for was sent with
        nothing after it (so later data on the link would reveal its loss sooner than the timer)."""
        loss, rto_s = self.loss, rtt_s + RTO_MIN_S
        worst, waiting = 0.0, False
        lost_before_tail = _binomial(rng, segments - 1, loss)
        if lost_before_tail:  # fast retransmit, a round trip; lost again: found by the timer
            again = rng.random() < 1 - (1 - loss) ** lost_before_tail
            worst, waiting = (rtt_s + rto_s + self._backoff(rng, 2 * rto_s), True) if again else (rtt_s, False)
        if rng.random() < loss:  # the last segment: a tail-loss probe, later when it was left alone
            alone = segments == 1 or rng.random() < TAIL_ALONE_SHARE
            probe = 2 * rtt_s + (RTO_MIN_S if alone else PROBE_MIN_S)
            tail = probe + self._backoff(rng, rto_s)
            if tail > worst:
                worst, waiting = tail, True
        return worst, waiting

    def lost_any(self, rng: random.Random, nbytes: int) -> bool:
        """Whether some segment of a message of ``nbytes`` is lost."""
        return self.loss > 0 and rng.random() < 1 - (1 - self.loss) ** max(1, -(-nbytes // MSS))

    def resent_delay(self, rng: random.Random, latency_s: float) -> float:
        """What a retransmission sent now adds when it is lost too: a timeout each time, doubling."""
        return self._backoff(rng, self.round_trip(latency_s) + RTO_MIN_S)

    def _backoff(self, rng: random.Random, timeout_s: float) -> float:
        """The timeouts of further losses of one retransmitted segment (each timeout doubles)."""
        waited = 0.0
        while rng.random() < self.loss and timeout_s < 120:
            waited += timeout_s
            timeout_s *= 2
        return waited


def _binomial(rng: random.Random, n: int, p: float) -> int:
    if n <= 0 or p <= 0:
        return 0
    if n <= 64:
        return sum(rng.random() < p for _ in range(n))
    return max(0, min(n, round(rng.gauss(n * p, math.sqrt(n * p * (1 - p))))))


__all__ = ["MSS", "PROBE_MIN_S", "RTO_MIN_S", "TAIL_ALONE_SHARE", "LinkFaults"]

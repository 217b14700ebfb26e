"""Links that lose packets or take long: what the run measured of each directed link.

Two sources, per link ``src→dst``:

- the kernel's counters on ``src``'s connections to ``dst`` (its ``links`` record, written by
  :mod:`hopnet.transports.tcp_diag`): the smoothed round trip and its variation, and the bytes
  (or segments) it retransmitted;
- the update arrivals (Hop, notify-ack: :func:`hopnet.report.diagnosis.update_arrivals`): the
  spread of each update's transfer time, when the kernel gave no round trip.

A link's **latency** is half its round trip (else its median transfer time), its **jitter** 1.5x
the kernel's round-trip variation (a uniform ±j on each direction varies a round trip by 2j/3 on
average; else twice the transfers' median absolute deviation), and the **retransmitted** share its
retransmitted bytes over those sent: on a link whose acknowledgements are not lost, about its loss.
A link the kernel counted is named when it retransmitted :data:`LOSSY_SHARE` or more, or when its
latency is at least :data:`HIGH_LATENCY_S` and :data:`HIGH_LATENCY_FACTOR` times the fastest link's
(a link known from update arrivals alone is the diagnosis's slow link, if slow).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from hopnet.report.rundir import Record, RunData

LOSSY_SHARE = 0.01
"""A link that retransmitted this share of its bytes or more is lossy."""
HIGH_LATENCY_S = 0.005
"""A link is high-latency from this one-way latency..."""
HIGH_LATENCY_FACTOR = 4.0
"""...and this many times the fastest measured link's."""
JITTER_PER_RTTVAR = 1.5
MIN_ARRIVALS = 5


@dataclass(frozen=True)
class LinkHealth:
    src: int
    dst: int
    latency_s: float | None
    jitter_s: float | None
    retransmitted: float | None
    """Share of the bytes (or segments) ``src`` sent to ``dst`` that it sent again."""
    share: float | None = None
    """Share of ``dst``'s step time spent waiting on ``src`` (None where the logs do not say)."""
    counted: bool = False
    """Whether the kernel's counters (a ``links`` record) measured it."""
    rtt_s: float | None = None
    """The kernel's smoothed round trip, when it measured one."""

    @property
    def lossy(self) -> bool:
        return (self.retransmitted or 0.0) >= LOSSY_SHARE

    def words(self) -> str:
        """``link 0→3: 52 ms ± 18 ms latency, 4.8% retransmitted; rank 3 waits 31% of its time on it``."""
        parts = []
        if self.latency_s is not None:
            jitter = f" ± {_ms(self.jitter_s)}" if self.jitter_s else ""
            parts.append(f"{_ms(self.latency_s)}{jitter} latency")
        if self.retransmitted is not None:
            parts.append(f"{100 * self.retransmitted:.2g}% retransmitted")
        text = f"link {self.src}→{self.dst}: " + ", ".join(parts)
        if self.share:
            text += f"; rank {self.dst} waits {100 * self.share:.0f}% of its time on it"
        return text


def _kernel_counters(records: list[Record]) -> dict[int, dict[str, float]]:
    found: dict[int, dict[str, float]] = {}
    for rec in records:
        peers = rec.get("peers") if rec.get("event") == "links" else None
        if isinstance(peers, dict):
            found = {int(p): c for p, c in peers.items() if isinstance(c, dict)}
    return found


def _retransmitted(counters: dict[str, float]) -> float | None:
    sent, again = counters.get("bytes_sent"), counters.get("bytes_retransmitted")
    if isinstance(sent, (int, float)) and isinstance(again, (int, float)) and sent > 0:
        return float(again) / float(sent)
    segments, retransmits = counters.get("segments"), counters.get("retransmits")
    if isinstance(segments, (int, float)) and isinstance(retransmits, (int, float)) and segments > 0:
        return float(retransmits) / float(segments)
    return None


def link_health(run: RunData, arrivals: list[tuple[int, int, int, float, float]],
                waits: dict[int, dict[int, float]]) -> dict[tuple[int, int], LinkHealth]:
    """What the run measured of each directed link (see the module's docstring)."""
    transfers: dict[tuple[int, int], list[float]] = {}
    for src, dst, k, sent, arrived in arrivals:
        if k > 0:
            transfers.setdefault((src, dst), []).append(arrived - sent)
    links: dict[tuple[int, int], LinkHealth] = {}
    kernel = {(src, dst): c for src, records in run.events.items() for dst, c in _kernel_counters(records).items()}
    for link in sorted(set(kernel) | {k for k, v in transfers.items() if len(v) >= MIN_ARRIVALS}):
        counters, samples = kernel.get(link, {}), transfers.get(link, [])
        latency = jitter = None
        rtt_ms, rttvar_ms = counters.get("rtt_ms"), counters.get("rttvar_ms")
        if isinstance(rtt_ms, (int, float)) and rtt_ms > 0:
            latency = rtt_ms / 2000
            jitter = JITTER_PER_RTTVAR * float(rttvar_ms) / 1000 if isinstance(rttvar_ms, (int, float)) else None
        elif len(samples) >= MIN_ARRIVALS:
            latency = statistics.median(samples)
            jitter = 2 * statistics.median(abs(x - latency) for x in samples)
        share = waits.get(link[1], {}).get(link[0])
        links[link] = LinkHealth(link[0], link[1], latency, jitter, _retransmitted(counters), share, bool(counters),
                                 2 * latency if isinstance(rtt_ms, (int, float)) and rtt_ms > 0 and latency else None)
    return links


def bytes_per_step(run: RunData, iterations: int) -> int:
    """What one link carried per iteration, the median over the links the kernel counted (about an
    update's size under Hop): what the simulator charges a message, 0 when unknown."""
    sent = [c["bytes_sent"] for records in run.events.values() for c in _kernel_counters(records).values()
            if isinstance(c.get("bytes_sent"), (int, float)) and c["bytes_sent"] > 0]
    return int(statistics.median(sent) / iterations) if sent and iterations > 0 else 0


def unhealthy(links: dict[tuple[int, int], LinkHealth]) -> list[LinkHealth]:
    """The lossy and the high-latency links, the worst first."""
    fastest = min((h.latency_s for h in links.values() if h.latency_s is not None), default=0.0)
    named = [h for h in links.values() if h.counted and h.lossy or (
        h.counted and h.latency_s is not None and h.latency_s >= HIGH_LATENCY_S and h.latency_s >= HIGH_LATENCY_FACTOR * fastest)]
    return sorted(named, key=lambda h: (-(h.share or 0.0), -(h.retransmitted or 0.0), -(h.latency_s or 0.0)))


def _ms(seconds: float | None) -> str:
    ms = 1000 * (seconds or 0.0)
    return f"{ms:.2g} ms" if ms < 10 else f"{ms:.0f} ms" if ms < 1000 else f"{ms / 1000:.3g} s"


__all__ = ["HIGH_LATENCY_FACTOR", "HIGH_LATENCY_S", "LOSSY_SHARE", "LinkHealth", "bytes_per_step", "link_health", "unhealthy"]

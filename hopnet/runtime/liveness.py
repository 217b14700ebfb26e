"""Which neighbours are still alive: a sans-IO heartbeat state machine.

A worker counts any valid message from a neighbour as a sign of life, and sends each
neighbour a tiny ``beat`` when nothing else went to it for ``beat_interval_s``. A
neighbour heard from by nothing for ``timeout_s`` is dead: its process died or hangs,
or its host became unreachable. The state machine only keeps times; the caller (the
Node) feeds it the clock and does the sending, so it is tested with a fake clock.

::

    live = Liveness(peers, timeout_s=5.0, now=clock.now())
    live.look(now)                    # the watcher runs (a long pause of its own resets silences)
    live.heard(peer, now)             # a message arrived from ``peer``
    live.sent(peer, now)              # something was sent to ``peer``
    for peer in live.beat_due(now):   # nothing sent to them lately: send a beat
        ...
    for peer, silent_s in live.silent_peers(now):  # declared dead (each one once)
        ...
    sleep(live.next_check(now) - now)
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from hopnet.errors import ConfigError

BEATS_PER_TIMEOUT = 5
"""Beats a peer may miss before it is declared dead: the beat interval is the
silence limit divided by this (and at most :data:`MAX_BEAT_INTERVAL_S`)."""

MAX_BEAT_INTERVAL_S = 1.0


def beat_interval_for(timeout_s: float) -> float:
    """How often to beat so that a live peer is never silent for ``timeout_s``."""
    return min(MAX_BEAT_INTERVAL_S, timeout_s / BEATS_PER_TIMEOUT)


class Liveness:
    """Last-heard and last-sent times per peer; decides who gets a beat and who is dead."""

    def __init__(self, peers: Iterable[int], *, timeout_s: float, now: float,
                 beat_interval_s: float | None = None, judge_unheard: bool = True) -> None:
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ConfigError(f"the peer timeout must be a positive number of seconds (got {timeout_s!r})")
        self.timeout_s = float(timeout_s)
        self.beat_interval_s = beat_interval_for(timeout_s) if beat_interval_s is None else beat_interval_s
        if not 0 < self.beat_interval_s < self.timeout_s:
            raise ConfigError(f"the beat interval ({self.beat_interval_s}s) must be positive and "
                              f"shorter than the peer timeout ({self.timeout_s}s)")
        self._last_heard: dict[int, float] = {p: now for p in peers}
        self._last_sent: dict[int, float] = {p: now for p in self._last_heard}
        self._last_look = now
        self._unheard: set[int] = set() if judge_unheard else set(self._last_heard)
        """Peers not judged until first heard from (``judge_unheard=False``: a replacement, whose peers
        hear of its new address only from its own ``rejoin``; the ones that knew it judge them)."""

    @property
    def watched(self) -> frozenset[int]:
        """Peers still watched (neither forgotten nor declared dead)."""
        return frozenset(self._last_heard)

    def watch(self, peer: int, now: float) -> None:
        """Start watching ``peer`` (a worker that just joined), as heard from and sent to ``now``."""
        self._last_heard.setdefault(peer, now)
        self._last_sent.setdefault(peer, now)

    def next_silence(self, now: float) -> float:
        """The earliest time a watched peer's silence reaches the limit (``inf``: none watched)."""
        times = [last + self.timeout_s for p, last in self._last_heard.items() if p not in self._unheard]
        return max(now, min(times)) if times else math.inf

    def look(self, now: float) -> float:
        """The watcher looks at ``now``; returns how long it was away, if that was too long to judge
        anyone by (else 0). A watcher away for half the silence limit or more was not running
        itself (its process stopped, or starved of CPU): the silence it would see is its own, so
        every peer starts a fresh silence limit from ``now``. Without this a worker SIGSTOPped
        and continued would declare all its live neighbours dead the moment it woke."""
        away, self._last_look = now - self._last_look, now
        if away < self.timeout_s / 2:
            return 0.0
        for peer in self._last_heard:
            self._last_heard[peer] = max(self._last_heard[peer], now)
        return away

    def heard(self, peer: int, now: float) -> None:
        """A valid message from ``peer`` arrived: it is alive as of ``now``."""
        self._unheard.discard(peer)
        if peer in self._last_heard and now > self._last_heard[peer]:
            self._last_heard[peer] = now

    def sent(self, peer: int, now: float) -> None:
        """Something left for ``peer``: no beat is owed to it before ``now + beat_interval_s``."""
        if peer in self._last_sent and now > self._last_sent[peer]:
            self._last_sent[peer] = now

    def silence(self, peer: int, now: float) -> float | None:
        """Seconds since ``peer`` was last heard from (None once it is no longer watched)."""
        last = self._last_heard.get(peer)
        return None if last is None else max(0.0, now - last)

    def beat_due(self, now: float) -> list[int]:
        """Peers nothing was sent to for ``beat_interval_s``; they are marked as sent to now."""
        # Compared as ``now >= last + limit``, the very sum next_check() returns, so a check
        # made at the time next_check() named always finds what fell due (no float slack).
        due = [p for p, last in self._last_sent.items() if now >= last + self.beat_interval_s]
        for peer in due:
            self._last_sent[peer] = now
        return due

    def silent_peers(self, now: float) -> list[tuple[int, float]]:
        """Peers silent for ``timeout_s`` or longer, with their silence; each is reported once
        and then no longer watched."""
        dead = [(p, now - last) for p, last in self._last_heard.items()
                if now >= last + self.timeout_s and p not in self._unheard]
        for peer, _ in dead:
            self.forget(peer)
        return dead

    def forget(self, peer: int) -> None:
        """Stop watching ``peer`` (it said goodbye, or was declared dead)."""
        self._last_heard.pop(peer, None)
        self._last_sent.pop(peer, None)
        self._unheard.discard(peer)

    def next_check(self, now: float) -> float:
        """The earliest time a beat falls due or a peer's silence reaches the limit."""
        times = [last + self.beat_interval_s for last in self._last_sent.values()]
        times += [last + self.timeout_s for p, last in self._last_heard.items() if p not in self._unheard]
        return max(now, min(times)) if times else math.inf

"""What the launcher says while it waits, so a run on a pipe is never silent for long.

The live status line (:mod:`hopnet.report.live`) covers training on a terminal; start-up
and shutdown have nothing to show there, and on a pipe nothing at all. :class:`StartupTalk`
and :class:`ShutdownTalk` decide, from what the launcher sees at each poll, which line to
print and when: one line when a phase starts or ends, and a reminder of what it still waits
for every :data:`REMIND_S` seconds while it lasts. They do no I/O and read no clock: the
launcher passes ``now`` (``time.monotonic()``), so the tests give them any timeline.
"""

from __future__ import annotations

from collections.abc import Sequence

REMIND_S = 5.0
"""How often a launcher that still waits says again what it waits for."""
SHUTDOWN_QUIET_S = 1.0
"""How long the other workers may take to exit after the first finished before the launcher says it waits."""


def ranks_text(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class StartupTalk:
    """From ``starting N workers`` to ``N/N ready``: the workers register at the rendezvous
    once their script reached ``hopnet.init``; every rank registered is every rank ready."""

    def __init__(self, world_size: int, started: float, remind_s: float = REMIND_S) -> None:
        self.world_size = world_size
        self.started = started
        self.remind_s = remind_s
        self._next = started + remind_s
        self.done = False

    def poll(self, now: float, registered: Sequence[int], ready_at: float | None = None) -> str | None:
        """The line to say at ``now``, with ``registered`` the ranks the rendezvous has so far
        and ``ready_at`` when the last of them registered, if known (else ``now``)."""
        if self.done:
            return None
        count = len(set(registered))
        if count >= self.world_size:
            self.done = True
            return f"{self.world_size}/{self.world_size} ready after {(ready_at or now) - self.started:.1f}s"
        if now < self._next:
            return None
        self._next = now + self.remind_s
        missing = sorted(set(range(self.world_size)) - set(registered))
        return (f"waiting for the workers to reach hopnet.init: {count}/{self.world_size} ready after "
                f"{now - self.started:.0f}s (waiting for {ranks_text(missing)})")


class ShutdownTalk:
    """Once the first worker finished, what the launcher still waits for before it can end."""

    def __init__(self, quiet_s: float = SHUTDOWN_QUIET_S, remind_s: float = REMIND_S) -> None:
        self.quiet_s = quiet_s
        self.remind_s = remind_s
        self.first_end: float | None = None
        self._next: float | None = None

    def finished(self, now: float) -> None:
        """A worker exited on its own: the run is ending."""
        if self.first_end is None:
            self.first_end = now
            self._next = now + self.quiet_s

    def due(self, now: float) -> bool:
        """Whether a line may be said at ``now`` (the run is ending, and the last line is old enough)."""
        return self.first_end is not None and self._next is not None and now >= self._next

    def poll(self, now: float, pending: Sequence[int]) -> str | None:
        """The line to say at ``now`` while ``pending`` ranks have not exited."""
        if self.first_end is None or self._next is None or now < self._next:
            return None
        self._next = now + self.remind_s
        if not pending:
            return None
        return f"waiting for {ranks_text(pending)} to exit ({now - self.first_end:.0f}s after the first finished)"


class WaitTalk:
    """A wait that may last: said when it starts, then every ``remind_s`` while it lasts.
    :meth:`poll` takes the seconds waited so far."""

    def __init__(self, what: str, remind_s: float = REMIND_S) -> None:
        self.what = what
        self.remind_s = remind_s
        self._next: float | None = None

    def poll(self, waited_s: float) -> str | None:
        if self._next is None:
            self._next = waited_s + self.remind_s
            return f"waiting for {self.what}"
        if waited_s < self._next:
            return None
        self._next = waited_s + self.remind_s
        return f"still waiting ({waited_s:.0f}s) for {self.what}"


__all__ = ["REMIND_S", "SHUTDOWN_QUIET_S", "ShutdownTalk", "StartupTalk", "WaitTalk", "ranks_text"]

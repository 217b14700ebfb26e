"""Which dead workers a launcher replaces: ``hopnet launch --max-restarts K``.

A worker that ends non-zero (a crash, SIGKILL, the OOM killer, or the launcher's own kill
of a worker declared dead, :mod:`hopnet.launch.death_watch`) is started again with the same
command and environment plus ``HOPNET_RESTART=N`` (the rank's ``N``-th replacement), while
this launcher has used fewer than ``K`` restarts and the run is not ending. The budget is per
launcher, so per machine. Past it, the worker is lost and ``--max-failures`` decides, as
without restarts. A worker that exits 0 is never restarted.

Nothing here does I/O: :class:`RestartBudget` decides and keeps the records that go to
``launch.json`` under ``restarts``; the launcher spawns.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Restart:
    """One replacement: the ``number``-th of ``rank``, the ``used``-th of the launcher's ``limit``."""

    rank: int
    number: int
    """``N`` of ``HOPNET_RESTART``: 1 for the rank's first replacement."""
    used: int
    limit: int
    reason: str
    """How the dead worker ended, as the launcher says it (``killed by SIGKILL``, ``exit code 3``)."""

    def line(self) -> str:
        """What the launcher says when it restarts the worker."""
        return f"rank {self.rank} died ({self.reason}); restarting it (restart {self.used} of {self.limit})"


@dataclass(frozen=True)
class RestartRecord:
    """A restart as ``launch.json`` keeps it."""

    rank: int
    restart: int
    reason: str
    old_pid: int
    new_pid: int
    time: str
    """ISO wall-clock time of the new process's start."""
    mono: float
    """``time.monotonic()`` at the new process's start (the clock of the event logs)."""

    def to_json(self) -> dict[str, object]:
        return asdict(self)


class RestartBudget:
    """Up to ``limit`` restarts for one launcher's workers."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"restart limit must be >= 0 (got {limit})")
        self.limit = limit
        self.used = 0
        self.per_rank: dict[int, int] = {}
        self.records: list[RestartRecord] = []
        self.following: dict[int, Restart] = {}
        """Members of a replica coming back, not yet ended: the restart each takes when it does."""
        self.decided: dict[int, Restart] = {}
        """The member whose death decided its replica's restart, when a sibling's exit was seen first."""

    def decide(self, rank: int, returncode: int, reason: str, *, ending: bool) -> Restart | None:
        """The restart for ``rank``, which ended with ``returncode``, or ``None`` when it stays dead:
        it exited 0, the run is ``ending`` (a signal, a fatal failure), or the budget is spent.
        A restart returned here is counted."""
        if returncode == 0 or ending or self.used >= self.limit:
            return None
        self.used += 1
        number = self.per_rank.get(rank, 0) + 1
        self.per_rank[rank] = number
        return Restart(rank=rank, number=number, used=self.used, limit=self.limit, reason=reason)

    def decide_replica(self, members: tuple[int, ...], rank: int, returncode: int, reason: str, *,
                       ending: bool, seen: int | None = None) -> Restart | None:
        """A replica group comes back as a unit: ``rank``, the first of ``members`` to end, decides for
        all of them, with one unit of the budget; the others follow with :meth:`follow`. Every member
        gets the same restart number (their replica's process group meets under it). ``seen``: the
        member whose exit the launcher is handling, when it is not ``rank`` (a sibling's failure came
        first); ``rank`` then takes its own restart from :meth:`follow` as it ends."""
        restart = self.decide(rank, returncode, reason, ending=ending)
        if restart is None:
            return None
        for member in members:
            self.per_rank[member] = restart.number
        self.following.update({m: restart for m in members if m != rank})
        if seen is not None and seen != rank:
            self.decided[rank] = restart
        return restart

    def follow(self, rank: int) -> Restart | None:
        """The restart a member of a replica coming back takes as it ends (stopped with its replica; or,
        the member whose death decided it, its own)."""
        if rank in self.decided:
            return self.decided.pop(rank)
        restart = self.following.pop(rank, None)
        if restart is None:
            return None
        return Restart(rank=rank, number=restart.number, used=restart.used, limit=restart.limit,
                       reason=f"with its replica ({restart.reason} in rank {restart.rank})")

    def done(self, restart: Restart, *, old_pid: int, new_pid: int, time: str, mono: float) -> RestartRecord:
        """The replacement of ``restart`` started: keep its record."""
        record = RestartRecord(rank=restart.rank, restart=restart.number, reason=restart.reason,
                               old_pid=old_pid, new_pid=new_pid, time=time, mono=mono)
        self.records.append(record)
        return record

    def summary(self) -> str | None:
        """One line for the launcher's end: ``1 restart: rank 2 (killed by SIGKILL)``; ``None`` without any."""
        if not self.records:
            return None
        noun = "restart" if len(self.records) == 1 else "restarts"
        return f"{len(self.records)} {noun}: " + ", ".join(f"rank {r.rank} ({r.reason})" for r in self.records)

    def to_json(self) -> list[dict[str, object]]:
        return [r.to_json() for r in self.records]


__all__ = ["Restart", "RestartBudget", "RestartRecord"]

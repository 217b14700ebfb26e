"""The mutable state of one launch: each worker's state, and how the run is ending.

The phases of :mod:`hopnet.launch.launcher` read and write a :class:`RunState`; nothing
here does I/O, so the bookkeeping (who failed, who was stopped, in which order workers
ended, what the launch returns) is tested without processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from hopnet.launch.blame import describe_exit


class WorkerState(Enum):
    """Where one worker process is, as the launcher saw it."""

    RUNNING = "running"
    """Started; its exit has not been seen yet."""
    SUCCEEDED = "succeeded"
    """Exited 0 on its own."""
    FAILED = "failed"
    """Exited non-zero on its own: a lost worker (``--max-failures`` counts these)."""
    STOPPED = "stopped"
    """Still running when the launcher stopped the rest (SIGTERM, then SIGKILL)."""


@dataclass
class WorkerRecord:
    state: WorkerState = WorkerState.RUNNING
    returncode: int | None = None


@dataclass
class RunState:
    """What happened so far in one launch, and what it will return."""

    workers: dict[int, WorkerRecord] = field(default_factory=dict)
    exit_order: list[int] = field(default_factory=list)
    """Ranks in the order they ended on their own (the blame reads who went first)."""
    first_failure: int | None = None
    """The worker whose failure went past ``--max-failures`` (this machine's)."""
    coordinator_exit: int | None = None
    """The coordinator's exit status when it died while workers ran."""
    signal: int | None = None
    """The first signal the launcher received, once the monitor saw it."""
    silent: dict[int, str] = field(default_factory=dict)
    """Ranks the launcher killed because they went silent (:mod:`hopnet.launch.death_watch`),
    with why it held them for dead."""
    with_replica: dict[int, int] = field(default_factory=dict)
    """Ranks the launcher killed because another process of their replica group ended (rank -> that
    process): the replica fails as a unit (:mod:`hopnet.launch.replicas`); none of them is a cause."""
    returncode: int = 0
    failed_rank: int | None = None
    reason: str | None = None
    summary: str | None = None
    exit_overdue: bool = False
    """Workers that finished their loop did not exit within ``--exit-timeout``: they are stopped,
    and the run still counts as finished."""
    config_error: bool = False
    """The run ended on a configuration error before it trained (exit 2; no run directory kept)."""

    # -- workers
    def started(self, rank: int) -> None:
        self.workers[rank] = WorkerRecord()

    def ended(self, rank: int, code: int) -> None:
        """A worker exited. Unless the launcher was stopping it, it ended on its own:
        it takes its place in :attr:`exit_order`, and it failed unless ``code`` is 0."""
        record = self.workers.setdefault(rank, WorkerRecord())
        record.returncode = code
        if record.state is WorkerState.RUNNING:
            record.state = WorkerState.SUCCEEDED if code == 0 else WorkerState.FAILED
            self.exit_order.append(rank)

    def stopping(self, ranks: list[int]) -> None:
        """The launcher is about to stop ``ranks``, still running."""
        for rank in ranks:
            record = self.workers.get(rank)
            if record is not None and record.state is WorkerState.RUNNING:
                record.state = WorkerState.STOPPED

    def reaped(self, codes: dict[int, int | None]) -> None:
        """The exit statuses found at the end, for workers whose exit was not seen before."""
        for rank, code in codes.items():
            record = self.workers.setdefault(rank, WorkerRecord())
            if record.returncode is None:
                record.returncode = code

    def in_state(self, state: WorkerState) -> list[int]:
        return sorted(r for r, w in self.workers.items() if w.state is state)

    @property
    def pending(self) -> list[int]:
        """Workers whose exit has not been seen."""
        return sorted(r for r, w in self.workers.items() if w.returncode is None)

    @property
    def lost(self) -> dict[int, int]:
        """Failed workers and their exit codes, by rank."""
        return {r: w.returncode for r, w in sorted(self.workers.items())
                if w.state is WorkerState.FAILED and w.returncode is not None}

    @property
    def stopped(self) -> set[int]:
        return set(self.in_state(WorkerState.STOPPED))

    @property
    def returncodes(self) -> dict[int, int | None]:
        return {r: w.returncode for r, w in sorted(self.workers.items())}

    def describe_end(self, rank: int, code: int) -> str:
        """How a lost worker ended, for the launcher's lines: its exit, or why it was killed."""
        if rank in self.silent:
            return f"went silent: {self.silent[rank]}; killed"
        if rank in self.with_replica:
            return f"stopped with its replica when rank {self.with_replica[rank]} ended"
        return describe_exit(code)

    # -- the outcome
    @property
    def ending(self) -> bool:
        """Something already decided that the run ends (a failure, a signal, a dead coordinator)."""
        return self.first_failure is not None or self.failed_rank is not None or self.signal is not None \
            or self.summary is not None or self.exit_overdue

    def fail(self, rank: int | None, reason: str, summary: str, returncode: int = 1) -> None:
        self.failed_rank, self.reason, self.summary, self.returncode = rank, reason, summary, returncode


__all__ = ["RunState", "WorkerRecord", "WorkerState"]

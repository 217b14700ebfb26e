"""Per-rank numbers from event records: progress, rate, where the time went, skips, drops.

Everything here is computed from the records alone (docs/reference/events.md): ``iteration``
records give progress (``iter``, ``mono``), the time split (``compute_s``,
``wait_updates_s``, ``wait_tokens_s``, ``mix_s``) and the trainer's metrics (``loss``);
``skip``, ``stop``, ``error``, ``peer_left`` and ``peer_dead`` records the rest. Which of the
waits and counts matter is the protocol's declaration (:class:`hopnet.output_spec.OutputSpec`). A rank
replaced while the run went on (``--max-restarts``) logs each of its processes in turn in one
log, each replacement from a ``start`` record with ``"restart": N``: its numbers cover them all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hopnet.output_spec import GENERIC_OUTPUT, SKIPS, WAIT_PARTS, Count, OutputSpec, Wait, present
from hopnet.report.rundir import Record, RunData
from hopnet.report.views import View, run_views, view_marks

TIME_PARTS = ("compute_s", "wait_updates_s", "wait_tokens_s", "mix_s")
PART_LABELS = {"compute_s": "compute", "wait_updates_s": "wait for updates",
               "wait_tokens_s": "wait for tokens", "mix_s": "mixing"}
NOTABLE_EVENTS = ("peer_left", "peer_dead", "error", "rejoined")
ENDINGS = {"left": "left", "run_ended": "run ended before its view", "membership_stopped": "stopped by the membership"}
"""An elastic run's records that end a member early without failing it, and the status they give."""


@dataclass
class RankStats:
    """One worker's run, summed up. Times are seconds; ``mono`` stamps are on the shared clock."""

    rank: int
    iterations: int = 0
    """Iterations finished, skipped ones included: the last finished ``iter`` + 1."""
    steps: int = 0
    """Iterations computed (one ``iteration`` record each)."""
    total: int | None = None
    began: float | None = None
    """When the worker began computing iteration 0 (``mono``): the end of its first step less
    that step's four parts (without timings: when it entered iteration 0)."""
    last: float | None = None
    """When it finished its last iteration (``mono``)."""
    time_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIME_PARTS, 0.0))
    skips: int = 0
    skipped_iterations: int = 0
    dropped: int = 0
    """Messages dropped by validation (the ``stop`` record's ``dropped`` counts)."""
    late_updates_dropped: int = 0
    last_loss: float | None = None
    stopped: bool = False
    error: Record | None = None
    """The last process's error record (a replacement starts without one)."""
    stop: Record | None = None
    """The last ``stop`` record: the protocol's own counts (``OutputSpec.counts``)."""
    restarts: int = 0
    """Replacement processes of this rank (``start`` records with ``"restart"``, ``--max-restarts``)."""
    joined_iter: int | None = None
    """The iteration a joiner of an elastic run began in (its ``joined`` record); its rate counts from there."""
    ended: str | None = None
    """How an elastic run's member ended other than at the run's end: ``left`` (its ``left`` record),
    or why it never trained or stopped (``run_ended``, ``membership_stopped``)."""
    replica_size: int = 1
    """Processes in this rank's replica group (``--replica-size``: a rank of the log is then a replica)."""
    replica_s: float = 0.0
    """Seconds spent in the replica group's own collectives (``replica_s`` of the iteration records)."""
    progress: list[tuple[float, int]] = field(default_factory=list)
    """(``mono``, ``iter``) at the end of each computed iteration."""
    losses: list[tuple[float, float]] = field(default_factory=list)
    skip_points: list[tuple[float, int, int]] = field(default_factory=list)
    """(``mono``, from ``iter``, ``to``) of each skip."""

    @property
    def elapsed_s(self) -> float:
        if self.began is None or self.last is None:
            return 0.0
        return max(0.0, self.last - self.began)

    @property
    def rate(self) -> float:
        """Iterations per second, from beginning iteration 0 (a joiner: the one it joined in) to finishing
        the last one."""
        elapsed = self.elapsed_s
        return (self.iterations - (self.joined_iter or 0)) / elapsed if elapsed > 0 else 0.0

    @property
    def busy_s(self) -> float:
        return sum(self.time_s.values())

    @property
    def replica_share(self) -> float:
        """Fraction of the step time spent inside the replica group (its own collectives)."""
        busy = self.busy_s
        return min(1.0, self.replica_s / busy) if busy > 0 else 0.0

    def share(self, part: str) -> float:
        """Fraction of the step time spent in ``part`` (one of :data:`TIME_PARTS`)."""
        busy = self.busy_s
        return self.time_s[part] / busy if busy > 0 else 0.0

    @property
    def counts(self) -> dict[str, Any]:
        """The values :class:`hopnet.output_spec.Count` fields name: the ``stop`` record's, and ``skips``."""
        return {**(self.stop or {}), SKIPS: self.skips}

    @property
    def status(self) -> str:
        if self.error is not None:
            status = f"failed ({self.error.get('error', 'error')})"
        elif self.ended is not None:
            status = self.ended
        else:
            status = "finished" if self.stopped else "no stop record"
        if self.restarts:
            status += f", restarted {self.restarts}x"
        return status


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def rank_stats(rank: int, records: list[Record]) -> RankStats:
    """Sum up one rank's event records."""
    stats = RankStats(rank)
    start_mono: float | None = None
    entered_mono: float | None = None
    for rec in records:
        event = rec.get("event")
        mono = _number(rec.get("mono"))
        if event == "iteration":
            iteration = int(rec.get("iter", -1))
            stats.steps += 1
            stats.iterations = max(stats.iterations, iteration + 1)
            for part in TIME_PARTS:
                value = _number(rec.get(part))
                if value is not None:
                    stats.time_s[part] += value
            if mono is not None:
                if stats.began is None and all(_number(rec.get(p)) is not None for p in TIME_PARTS):
                    stats.began = mono - sum(float(rec[p]) for p in TIME_PARTS)
                stats.last = mono if stats.last is None else max(stats.last, mono)
                stats.progress.append((mono, iteration))
            stats.replica_s += _number(rec.get("replica_s")) or 0.0
            loss = _number(rec.get("loss"))
            if loss is not None:
                stats.last_loss = loss
                if mono is not None:
                    stats.losses.append((mono, loss))
        elif event == "enter":
            if rec.get("iter") == 0 and mono is not None and entered_mono is None:
                entered_mono = mono
        elif event == "start":
            start_mono = mono if start_mono is None else start_mono
            size = rec.get("replica_size")
            stats.replica_size = size if isinstance(size, int) and not isinstance(size, bool) else 1
            restart = rec.get("restart")
            if isinstance(restart, int) and not isinstance(restart, bool) and restart >= 1:
                # a replacement: what the dead process logged last is not how the rank ends
                stats.restarts += 1
                stats.error, stats.stopped = None, False
        elif event == "plan":
            total = rec.get("total")
            if isinstance(total, int):
                stats.total = total
        elif event == "skip":
            stats.skips += 1
            frm, to = int(rec.get("iter", 0)), int(rec.get("to", 0))
            stats.skipped_iterations += max(0, to - frm - 1)
            if mono is not None:
                stats.skip_points.append((mono, frm, to))
        elif event == "stop":
            stats.stopped = True
            stats.stop = rec
            dropped = rec.get("dropped") or {}
            if isinstance(dropped, dict):
                stats.dropped = sum(int(v) for v in dropped.values() if isinstance(v, int))
            stats.late_updates_dropped = int(rec.get("late_updates_dropped") or 0)
        elif event == "error":
            stats.error = stats.error or rec
        elif event == "joined":
            if isinstance(rec.get("iter"), int) and stats.joined_iter is None:
                stats.joined_iter = rec["iter"]
        elif event in ENDINGS:
            stats.ended = ENDINGS[event]
    if stats.began is None:
        stats.began = entered_mono if entered_mono is not None else start_mono
    return stats


@dataclass
class RunStats:
    """Every rank's :class:`RankStats` and the run-wide numbers built from them."""

    t0: float
    ranks: dict[int, RankStats]
    notable: list[Record]
    """``peer_left``, ``peer_dead``, ``error`` and ``rejoined`` records of every rank, in time order."""
    output: OutputSpec = GENERIC_OUTPUT
    """What matters for the protocol that ran (all of Hop's quantities when the run's options are unknown)."""
    coordinator: Record | None = None
    """The coordinator's ``stop`` record (``coordinator.jsonl``), for runs that had one."""
    views: list[View] = field(default_factory=list)
    """An elastic run's views (:mod:`hopnet.report.views`); view 0 only for a run without changes."""

    @property
    def replica_size(self) -> int:
        """Processes per replica group (1 when every rank was a process of its own)."""
        return max((s.replica_size for s in self.ranks.values()), default=1)

    def view_marks(self) -> list[tuple[float, str]]:
        """Each view change as (seconds since :attr:`t0`, ``"view N"``), for the plots' time axes."""
        return view_marks(self.views, self.t0)

    def shown_waits(self) -> tuple[Wait, ...]:
        """The protocol's waits, and any other wait a rank spent time in (shown rather than lost)."""
        declared = self.output.waits
        parts = {wait.part for wait in declared}
        extra = tuple(Wait(part, f"wait ({part})", part.removesuffix("_s").replace("_", " ")) for part in WAIT_PARTS
                      if part not in parts and any(s.time_s[part] > 0 for s in self.ranks.values()))
        return declared + extra

    def shown_counts(self, *, summary: bool = False) -> tuple[Count, ...]:
        """The protocol's per-rank counts that some rank's records hold (``summary``: the table's only)."""
        counts = self.output.summary_counts() if summary else self.output.counts
        return present(counts, (s.counts for s in self.ranks.values()))

    def shown_coordinator_counts(self) -> tuple[Count, ...]:
        return present(self.output.coordinator_counts, [self.coordinator or {}])

    @property
    def total(self) -> int | None:
        totals = [s.total for s in self.ranks.values() if s.total is not None]
        return max(totals) if totals else None

    @property
    def wall_s(self) -> float:
        ends = [s.last for s in self.ranks.values() if s.last is not None]
        return max(ends) - self.t0 if ends else 0.0

    @property
    def skips(self) -> int:
        return sum(s.skips for s in self.ranks.values())


def time_parts(stats: RunStats) -> list[tuple[str, str]]:
    """The parts a step's time is split into, with their labels: compute, the protocol's waits, mixing."""
    return [("compute_s", PART_LABELS["compute_s"]), *((w.part, w.label) for w in stats.shown_waits()),
            ("mix_s", PART_LABELS["mix_s"])]


def run_stats(run: RunData) -> RunStats:
    ranks = {rank: rank_stats(rank, records) for rank, records in sorted(run.events.items())}
    notable = sorted((rec for records in run.events.values() for rec in records
                      if rec.get("event") in NOTABLE_EVENTS),
                     key=lambda rec: (_number(rec.get("mono")) or 0.0, rec.get("rank", 0)))
    output = run.config.spec.output if run.config is not None else GENERIC_OUTPUT
    return RunStats(t0=run.t0, ranks=ranks, notable=notable, output=output, coordinator=run.coordinator,
                    views=run_views(run))

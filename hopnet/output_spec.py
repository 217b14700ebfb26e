"""What a protocol's output shows: the launcher's summary table, `hopnet report` and
`hopnet simulate` read a protocol's :class:`OutputSpec` (``ProtocolSpec.output``), so each
shows only the quantities that apply to the protocol that ran and none of them names one.

Plain data read from the event records every protocol already writes (docs/reference/events.md):
the step's waits from ``iteration`` records, per-rank counts from the ``stop`` record (the
protocol's ``summary()``), run-wide counts from the coordinator's ``stop`` record.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

WAIT_PARTS = ("wait_updates_s", "wait_tokens_s")
"""The ``iteration`` record's wait fields a protocol reports its waits in (``Node.waited``)."""

Across = Literal["sum", "per_rank", "max", "mean", "tally"]
PER_RANK_SHOWN = 8
"""``per_rank`` lists this many ranks' values after the sum (the largest first)."""
GapScope = Literal["neighbours", "all", "none"]

SKIPS = "skips"
"""A per-rank count not in the ``stop`` record: the rank's ``skip`` records, counted."""


@dataclass(frozen=True)
class Wait:
    """One of the step's waits: the ``iteration`` record's ``part`` and what it waited for."""

    part: str
    label: str
    """For the report, its plots and trace: ``"wait for tokens"``."""
    column: str
    """For the summary table's narrow column: ``"wait tokens"``."""


@dataclass(frozen=True)
class Count:
    """A number a rank's ``stop`` record (or the coordinator's) carries under ``field``."""

    field: str
    label: str
    across: Across = "sum"
    """How ranks combine into one run-wide value: ``sum``, ``per_rank`` (the sum, then the largest
    ranks' shares: who started the rounds), ``max`` (with the rank that had it), ``mean``, or
    ``tally`` (a value such as a role: how many ranks had each)."""
    in_summary: bool = True
    """Also a column of the launcher's summary table (the report's rank table shows every count)."""


@dataclass(frozen=True)
class OutputSpec:
    """What matters for a protocol, and so what its outputs show."""

    waits: tuple[Wait, ...]
    counts: tuple[Count, ...] = ()
    """Per rank, from its ``stop`` record; a count a rank's record lacks (or holds ``null``) is not shown."""
    coordinator_counts: tuple[Count, ...] = ()
    """Run-wide, from the coordinator's ``stop`` record (``coordinator.jsonl``; the simulator's coordinator)."""
    gaps: GapScope = "none"
    """``neighbours``: the iteration gap of every pair of graph neighbours, against the protocol's
    ``gap_bound``; ``all``: the largest gap between any two workers (no bound applies);
    ``none``: the workers move in step, so no gap is shown."""

    def wait_parts(self) -> tuple[str, ...]:
        return tuple(wait.part for wait in self.waits)

    def summary_counts(self) -> tuple[Count, ...]:
        return tuple(count for count in self.counts if count.in_summary)


UPDATES_WAIT = Wait("wait_updates_s", "wait for updates", "wait updates")
TOKENS_WAIT = Wait("wait_tokens_s", "wait for tokens", "wait tokens")

GENERIC_OUTPUT = OutputSpec(waits=(UPDATES_WAIT, TOKENS_WAIT), counts=(Count(SKIPS, "skips"),), gaps="neighbours")
"""What is shown of a run whose protocol is not known (a run directory without its options)."""


def present(counts: Iterable[Count], values: Iterable[Mapping[str, Any]]) -> tuple[Count, ...]:
    """The counts that at least one of ``values`` (a rank's, or the coordinator's) holds."""
    rows = list(values)
    return tuple(count for count in counts if any(row.get(count.field) is not None for row in rows))


def format_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)


def combine(count: Count, values: Mapping[int, Any]) -> str:
    """The run-wide value of ``count`` from each rank's value (ranks without one left out), in words."""
    known = {rank: value for rank, value in values.items() if value is not None}
    if not known:
        return "-"
    if count.across == "tally":
        tally: dict[str, int] = {}
        for value in known.values():
            tally[str(value)] = tally.get(str(value), 0) + 1
        return ", ".join(f"{number} {value}" for value, number in sorted(tally.items()))
    numbers = {rank: value for rank, value in known.items()
               if isinstance(value, (int, float)) and not isinstance(value, bool)}
    if not numbers:
        return "-"
    if count.across == "max":
        rank = max(numbers, key=lambda r: numbers[r])
        alike = len(set(numbers.values())) == 1
        return format_value(numbers[rank]) + ("" if alike else f" (rank {rank})")
    if count.across == "mean":
        return format_value(sum(numbers.values()) / len(numbers))
    total = format_value(sum(numbers.values()))
    if count.across == "per_rank" and len(numbers) > 1:
        largest = sorted(numbers, key=lambda r: (-numbers[r], r))
        shown = ", ".join(f"rank {r} {format_value(numbers[r])}" for r in largest[:PER_RANK_SHOWN])
        return f"{total} ({shown}{', ...' if len(largest) > PER_RANK_SHOWN else ''})"
    return total


__all__ = ["GENERIC_OUTPUT", "SKIPS", "TOKENS_WAIT", "UPDATES_WAIT", "WAIT_PARTS", "Count", "OutputSpec", "Wait",
           "combine", "format_value", "present"]

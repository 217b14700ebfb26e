"""The table `hopnet launch` prints when a run ends: per rank, iterations, rate, the share
of time spent in each of the protocol's waits, its own counts, and drops.

The waits and counts are those the protocol declares (``ProtocolSpec.output``; Hop's: wait
for updates, wait for tokens, skips), so a protocol's table shows nothing foreign to it.
Plain aligned text on a pipe, a rich table on a terminal; the numbers come from the
run's event logs (:mod:`hopnet.report.stats`).
"""

from __future__ import annotations

from typing import IO, Any

from hopnet.output_spec import format_value
from hopnet.report.stats import RunStats

TITLE = "per-rank summary (from the event logs; hopnet report RUN_DIR draws more)"
"""(A run of replica groups has a row per replica: the log of its first process.)"""


def summary_headers(stats: RunStats) -> tuple[str, ...]:
    grouped = stats.replica_size > 1  # a row per replica group, and its time inside the group
    return ("replica" if grouped else "rank", "iterations", "it/s", *(("in replica",) if grouped else ()),
            *(w.column for w in stats.shown_waits()), *(c.label for c in stats.shown_counts(summary=True)),
            "dropped", "status")


def summary_rows(stats: RunStats) -> list[tuple[str, ...]]:
    waits, counts = stats.shown_waits(), stats.shown_counts(summary=True)
    grouped = stats.replica_size > 1
    return [(str(rank), str(s.iterations), f"{s.rate:.2f}",
             *((f"{100 * s.replica_share:.1f}%",) if grouped else ()),
             *(f"{100 * s.share(w.part):.1f}%" for w in waits),
             *(format_value(s.counts.get(c.field)) for c in counts), str(s.dropped), s.status)
            for rank, s in stats.ranks.items()]


def coordinator_line(stats: RunStats) -> str | None:
    """The coordinator's counts in one line (``coordinator: 120 groups formed, ...``); None without any."""
    counts = stats.shown_coordinator_counts()
    if stats.coordinator is None or not counts:
        return None
    return "coordinator: " + ", ".join(f"{format_value(stats.coordinator.get(c.field))} {c.label}" for c in counts)


def summary_text(stats: RunStats) -> str:
    """The table as aligned plain text (numbers right-aligned, status left-aligned)."""
    headers = summary_headers(stats)
    rows = [headers, *summary_rows(stats)]
    widths = [max(len(row[c]) for row in rows) for c in range(len(headers))]
    lines = []
    for row in rows:
        cells = [cell.rjust(width) for cell, width in zip(row[:-1], widths)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    coordinator = coordinator_line(stats)
    if coordinator is not None:
        lines.append(coordinator)
    return "\n".join(lines)


def summary_table(stats: RunStats) -> Any:
    """The table as a :class:`rich.table.Table`."""
    from rich.table import Table

    coordinator = coordinator_line(stats)
    table = Table(title=TITLE, title_justify="left", title_style="bold", caption=coordinator,
                  caption_justify="left")
    for header in summary_headers(stats):
        table.add_column(header, justify="left" if header == "status" else "right")
    for row in summary_rows(stats):
        style = "red" if row[-1].startswith("failed") else None
        table.add_row(*row, style=style)
    return table


def print_summary(stats: RunStats, stream: IO[str], *, rich: bool) -> None:
    """Print the table to ``stream``: a rich table when ``rich`` (a terminal), else plain text."""
    if not stats.ranks:
        return
    if rich:
        from rich.console import Console

        Console(file=stream, highlight=False).print(summary_table(stats))
    else:
        stream.write(f"hopnet launch: {TITLE}\n{summary_text(stats)}\n")
        stream.flush()

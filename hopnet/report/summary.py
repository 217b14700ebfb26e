"""The table `hopnet launch` prints when a run ends: per rank, iterations, rate, the share
of time spent waiting for updates and for tokens, skips and drops.

Plain aligned text on a pipe, a rich table on a terminal; the numbers come from the
run's event logs (:mod:`hopnet.report.stats`).
"""

from __future__ import annotations

from typing import IO, Any

from hopnet.report.stats import RunStats

HEADERS = ("rank", "iterations", "it/s", "wait updates", "wait tokens", "skips", "dropped", "status")
TITLE = "per-rank summary (from the event logs; hopnet report RUN_DIR draws more)"


def summary_rows(stats: RunStats) -> list[tuple[str, ...]]:
    return [(str(rank), str(s.iterations), f"{s.rate:.2f}", f"{100 * s.share('wait_updates_s'):.1f}%",
             f"{100 * s.share('wait_tokens_s'):.1f}%", str(s.skips), str(s.dropped), s.status)
            for rank, s in stats.ranks.items()]


def summary_text(stats: RunStats) -> str:
    """The table as aligned plain text (numbers right-aligned, status left-aligned)."""
    rows = [HEADERS, *summary_rows(stats)]
    widths = [max(len(row[c]) for row in rows) for c in range(len(HEADERS))]
    lines = []
    for row in rows:
        cells = [cell.rjust(width) for cell, width in zip(row[:-1], widths)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return "\n".join(lines)


def summary_table(stats: RunStats) -> Any:
    """The table as a :class:`rich.table.Table`."""
    from rich.table import Table

    table = Table(title=TITLE, title_justify="left", title_style="bold")
    for header in HEADERS:
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

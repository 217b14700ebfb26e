"""The report's figures, drawn with matplotlib's Agg renderer into PNG bytes.

Figures are built on :class:`matplotlib.figure.Figure` directly (no pyplot), so drawing
needs no display and touches no global backend state.
"""

from __future__ import annotations

import io
import math

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from hopnet.report.gaps import EdgeGap
from hopnet.report.stats import RunStats, time_parts

PART_COLORS = {"compute_s": "#4c72b0", "wait_updates_s": "#dd8452",
               "wait_tokens_s": "#c44e52", "mix_s": "#55a868"}
LEGEND_LIMIT = 16  # more ranks than this and a legend hides the plot


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def _rank_color(rank: int, n: int) -> tuple[float, float, float, float]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20" if n <= 20 else "viridis"]
    if n <= 20:
        return cmap(rank % cmap.N)
    return cmap(rank / max(1, n - 1))


def _figure(width: float = 8.0, height: float = 4.0) -> tuple[Figure, Axes]:
    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.add_subplot()


VIEW_COLOR = "#555555"


def mark_views(ax: Axes, marks: list[tuple[float, str]]) -> None:
    """A dashed vertical line at each view change of an elastic run, labelled ``view N`` at the top."""
    for x, label in marks:
        ax.axvline(x, color=VIEW_COLOR, linestyle="--", linewidth=0.9, zorder=1, label="_nolegend_", gid=label)
        ax.text(x, 0.99, f" {label}", transform=ax.get_xaxis_transform(), rotation=90, va="top", ha="left",
                fontsize="x-small", color=VIEW_COLOR)


def loss_plot(stats: RunStats) -> bytes | None:
    """Loss against wall time, one line per worker; ``None`` when no worker reported a loss."""
    fig = loss_figure(stats)
    return None if fig is None else _png(fig)


def loss_figure(stats: RunStats) -> Figure | None:
    """:func:`loss_plot`'s figure, view changes marked."""
    if not any(s.losses for s in stats.ranks.values()):
        return None
    fig, ax = _figure()
    n = len(stats.ranks)
    for rank, s in stats.ranks.items():
        if s.losses:
            ax.plot([m - stats.t0 for m, _ in s.losses], [v for _, v in s.losses],
                    color=_rank_color(rank, n), linewidth=1.2, label=f"rank {rank}")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("loss")
    if all(v > 0 for s in stats.ranks.values() for _, v in s.losses):
        values = [v for s in stats.ranks.values() for _, v in s.losses]
        if max(values) / min(values) > 20:
            ax.set_yscale("log")
    ax.set_title("Loss per worker")
    mark_views(ax, stats.view_marks())
    if n <= LEGEND_LIMIT:
        ax.legend(fontsize="small", ncols=2 if n > 8 else 1)
    ax.grid(alpha=0.3)
    return fig


def iteration_plot(stats: RunStats) -> bytes:
    """Iteration against wall time per worker: a straggler's line is flatter; skips are marked."""
    return _png(iteration_figure(stats))


def iteration_figure(stats: RunStats) -> Figure:
    """:func:`iteration_plot`'s figure, view changes marked."""
    fig, ax = _figure()
    n = len(stats.ranks)
    skip_label = "skip"
    for rank, s in stats.ranks.items():
        color = _rank_color(rank, n)
        if s.progress:
            ax.step([m - stats.t0 for m, _ in s.progress], [k for _, k in s.progress], where="post",
                    color=color, linewidth=1.2, label=f"rank {rank}")
        if s.skip_points:
            ax.scatter([m - stats.t0 for m, _, _ in s.skip_points], [to for _, _, to in s.skip_points],
                       marker="^", s=36, color=color, edgecolors="black", linewidths=0.6, zorder=3,
                       label=skip_label)
            skip_label = "_nolegend_"
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("iteration finished")
    ax.set_title("Progress per worker (▲ = skip ahead)")
    mark_views(ax, stats.view_marks())
    if n <= LEGEND_LIMIT:
        ax.legend(fontsize="small", ncols=2 if n > 8 else 1)
    ax.grid(alpha=0.3)
    return fig


def time_split_plot(stats: RunStats) -> bytes:
    """Each worker's time as stacked bars: compute, the protocol's waits (Hop's: for updates, for
    tokens), mixing."""
    ranks = list(stats.ranks)
    fig, ax = _figure(max(6.0, min(16.0, 0.45 * len(ranks) + 3)), 4.0)
    bottom = [0.0] * len(ranks)
    for part, label in time_parts(stats):
        values = [stats.ranks[r].time_s[part] for r in ranks]
        ax.bar([str(r) for r in ranks], values, bottom=bottom, color=PART_COLORS[part], label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xlabel("rank")
    ax.set_ylabel("seconds")
    ax.set_title("Where each worker's time went")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3, axis="y")
    return _png(fig)


def gap_plot(gaps: list[EdgeGap]) -> bytes | None:
    """The largest observed Iter(i) - Iter(j) per pair of neighbours, beside Table 1's bound."""
    if not gaps:
        return None
    labels = [f"{g.ahead}→{g.behind}" for g in gaps]
    x = list(range(len(gaps)))
    finite = [g.bound for g in gaps if g.bound is not None and not math.isinf(g.bound)]
    top = max([float(g.observed) for g in gaps] + finite + [1.0])
    fig, ax = _figure(max(6.0, min(18.0, 0.3 * len(gaps) + 3)), 4.0)
    width = 0.4
    ax.bar([i - width / 2 for i in x], [g.observed for g in gaps], width, color="#4c72b0",
           label="largest observed gap")
    bounds = [(i, g.bound) for i, g in zip(x, gaps) if g.bound is not None]
    if bounds:
        ax.bar([i + width / 2 for i, b in bounds], [top * 1.08 if math.isinf(b) else b for _, b in bounds], width,
               color="none", edgecolor="#c44e52", hatch="//", label="Table 1 bound")
        for i, b in bounds:
            if math.isinf(b):
                ax.text(i + width / 2, top * 1.1, "∞", ha="center", va="bottom", color="#c44e52")
    ax.set_ylim(0, top * 1.25)
    ax.set_xticks(x, labels if len(gaps) <= 64 else [""] * len(gaps), rotation=90 if len(gaps) > 16 else 0,
                  fontsize="small")
    ax.set_xlabel("neighbours i→j (Iter(i) − Iter(j))")
    ax.set_ylabel("iterations")
    ax.set_title("Largest iteration gap per pair of neighbours vs. Hop's bound")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3, axis="y")
    return _png(fig)


STRAGGLER_COLOR = "#c44e52"


def straggler_plot(stats: RunStats, highlight: set[int]) -> bytes:
    """Each worker's step time as shares (compute, waits, mixing), one bar per rank, the most
    computing rank on top: a straggler is a long compute bar among bars that are mostly waiting."""
    ranks = sorted(stats.ranks, key=lambda r: (-stats.ranks[r].share("compute_s"), r))
    fig, ax = _figure(8.0, max(2.5, min(14.0, 0.3 * len(ranks) + 1.5)))
    labels = [f"rank {r}" + (" (straggler)" if r in highlight else "") for r in ranks]
    left = [0.0] * len(ranks)
    for part, label in time_parts(stats):
        values = [100 * stats.ranks[r].share(part) for r in ranks]
        ax.barh(labels, values, left=left, color=PART_COLORS[part], label=label,
                edgecolor=["black" if r in highlight else "none" for r in ranks], linewidth=1.2)
        left = [a + v for a, v in zip(left, values)]
    ax.invert_yaxis()
    for tick, rank in zip(ax.get_yticklabels(), ranks):
        if rank in highlight:
            tick.set_color(STRAGGLER_COLOR)
            tick.set_fontweight("bold")
    if len(ranks) > 40:
        ax.set_yticks(range(len(ranks)), [""] * len(ranks))
    ax.set_xlim(0, 100)
    ax.set_xlabel("% of the worker's step time")
    ax.set_title("Compute against waiting, per worker (most computing first)")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3, axis="x")
    return _png(fig)


def lag_plot(stats: RunStats, highlight: set[int], samples: int = 400) -> bytes:
    """How many iterations each worker was behind the furthest one, against wall time: the
    ranks' progress lines pulled apart (a straggler's lag is the highest; skips drop it)."""
    return _png(lag_figure(stats, highlight, samples))


def lag_figure(stats: RunStats, highlight: set[int], samples: int = 400) -> Figure:
    """:func:`lag_plot`'s figure, view changes marked."""
    import bisect

    fig, ax = _figure()
    n = len(stats.ranks)
    series = {r: ([m for m, _ in s.progress], [k for _, k in s.progress]) for r, s in stats.ranks.items()}
    starts = [times[0] for times, _ in series.values() if times]
    ends = [times[-1] for times, _ in series.values() if times]
    if starts:
        lo, hi = min(starts), max(ends)
        grid = [lo + (hi - lo) * i / max(1, samples - 1) for i in range(samples)]

        def finished(rank: int, t: float) -> int | None:
            """None where an elastic run's member was not in it: before a joiner's first iteration, after a
            leaver's last."""
            times, iters = series[rank]
            s = stats.ranks[rank]
            if (s.joined_iter is not None and t < times[0]) or (s.ended is not None and t > times[-1]):
                return None
            at = bisect.bisect_right(times, t)
            return iters[at - 1] if at else -1

        done = {r: [finished(r, t) for t in grid] for r in series if series[r][0]}
        lead = [max((k for d in done.values() if (k := d[i]) is not None), default=-1) for i in range(samples)]
        for rank in done:
            straggler = rank in highlight
            lags = [math.nan if k is None else top - k for top, k in zip(lead, done[rank])]
            ax.step([t - stats.t0 for t in grid], lags, where="post",
                    color="black" if straggler else _rank_color(rank, n),
                    linewidth=2.4 if straggler else 1.0, zorder=3 if straggler else 2,
                    label=f"rank {rank}" + (" (straggler)" if straggler else ""))
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("iterations behind the furthest worker")
    ax.set_title("Lag behind the furthest worker")
    mark_views(ax, stats.view_marks())
    if n <= LEGEND_LIMIT:
        ax.legend(fontsize="small", ncols=2 if n > 8 else 1)
    ax.grid(alpha=0.3)
    return fig

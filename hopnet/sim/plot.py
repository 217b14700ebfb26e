"""``hopnet simulate --plot FILE.png``: throughput against virtual time, with each view change marked.

Drawn with matplotlib's Agg renderer on a :class:`~matplotlib.figure.Figure` (no pyplot, no display).
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np

from hopnet.sim.spec import SimResult

BINS = 50


def throughput_series(finish_times: Sequence[Sequence[float]], began_s: Sequence[float], end_s: float,
                      bins: int = BINS) -> tuple[list[float], list[float]]:
    """Iterations per virtual second of all workers together, in ``bins`` equal windows of
    ``[0, end_s]``: the windows' edges and their rates. Each worker's progress rises evenly from
    one finished iteration to the next (from ``began_s``, when it first was a member), so a window
    shorter than a step is not read as a burst and a gap."""
    if end_s <= 0 or bins < 1:
        return [], []
    edges = np.linspace(0.0, end_s, bins + 1)
    done = np.zeros(bins + 1)
    for times, began in zip(finish_times, began_s):
        if times:
            done += np.interp(edges, [began, *times], np.arange(len(times) + 1), left=0.0)
    return edges.tolist(), (np.diff(done) / (end_s / bins)).tolist()


def began_per_rank(result: SimResult) -> list[float]:
    """When each rank first was a member: 0, or the virtual time of the first view that had it."""
    began = [0.0] * result.n
    for view in reversed(result.views or []):
        for rank in view["members"]:
            began[rank] = view["began_s"]
    return began


def throughput_plot(result: SimResult) -> bytes:
    """The PNG: the throughput in windows, each view's own (a level line over its span), the changes
    as dashed lines labelled with who joined (+) and left (-)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 4.0), layout="constrained")
    ax = fig.add_subplot()
    edges, rates = throughput_series(result.finish_times, began_per_rank(result), result.virtual_time)
    if rates:
        ax.stairs(rates, edges, color="#4c72b0", linewidth=1.2,
                  label="all workers (windows)")
    views = result.views or []
    for view in views:
        if view["ended_s"] is not None and view["ended_s"] > view["began_s"]:
            ax.hlines(view["throughput"], view["began_s"], view["ended_s"], colors="#dd8452", linewidth=2.0,
                      label="per view" if view["view"] == 0 else "_nolegend_")
        if view["view"] > 0:
            ax.axvline(view["began_s"], color="#555555", linestyle="--", linewidth=0.9)
            change = " ".join([f"+{len(view['joined'])}"] * bool(view["joined"])
                              + [f"-{len(view['left'])}"] * bool(view["left"]))
            ax.annotate(f"view {view['view']} ({change}), iter {view['iteration']}", (view["began_s"], 0.03),
                        xycoords=("data", "axes fraction"), rotation=90, va="bottom", ha="right", fontsize="x-small")
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("iterations / s (all workers)")
    ax.set_title("Throughput" + (" through the view changes" if len(views) > 1 else ""))
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small", loc="best")
    ax.grid(alpha=0.3)
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


__all__ = ["began_per_rank", "throughput_plot", "throughput_series"]

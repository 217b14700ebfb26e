"""What a report says, independent of how it is laid out (HTML or Markdown).

:func:`build_content` turns a run into tables, figures and notes; :mod:`~hopnet.report.html`
and :mod:`~hopnet.report.markdown` lay the same content out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hopnet.analysis import max_gap_from_run
from hopnet.config import ProtocolConfig, describe_options
from hopnet.output_spec import combine, format_value
from hopnet.report import plots
from hopnet.report.gaps import EdgeGap, bound_rule, edge_gaps, format_bound
from hopnet.report.rundir import RunData
from hopnet.report.stats import RunStats, run_stats, time_parts
from hopnet.report.timeline import launch_phases
from hopnet.report.views import View, is_elastic


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]


@dataclass
class Figure:
    name: str
    title: str
    caption: str
    png: bytes


@dataclass
class Section:
    title: str
    paragraphs: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)


@dataclass
class ReportContent:
    title: str
    overview: Table
    sections: list[Section]


def format_options(config: ProtocolConfig | None) -> str:
    """The options that differ from the defaults, as flags."""
    if config is None:
        return "unknown (no launch.json)"
    return " ".join([config.protocol, *describe_options(config)])


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _overview(run: RunData, stats: RunStats) -> Table:
    rows: list[list[str]] = [["run directory", str(run.path)]]
    if run.graph is not None:
        rows.append(["graph", f"{run.graph.name or 'graph.json'} ({run.graph.n} workers)"])
    else:
        rows.append(["workers", str(len(stats.ranks))])
    rows.append(["options", format_options(run.config)])
    if len(stats.views) > 1:
        rows.append(["views", f"{len(stats.views)} (" + " → ".join(str(len(v.members)) for v in stats.views)
                     + " workers); see Views"])
    if run.launch.get("start_time"):
        rows.append(["started", str(run.launch["start_time"])])
    total = stats.total
    rows.append(["iterations", f"{total} planned" if total is not None else "not announced by the trainer"])
    phases = launch_phases(run)
    rows.append(["wall time", f"{phases.line()}, as the launcher said" if phases is not None
                 else f"{stats.wall_s:.2f} s (first start to last iteration)"])
    result = run.launch.get("result")
    if isinstance(result, dict):
        outcome = "exit 0" if result.get("returncode") == 0 else f"exit {result.get('returncode')}"
        if result.get("failed_rank") is not None:
            outcome += f", worker {result['failed_rank']} {result.get('reason') or 'failed'}"
        elif result.get("reason"):
            outcome += f", {result['reason']}"
        rows.append(["launch result", outcome])
    restarts = launch_restarts(run)
    if restarts:
        rows.append(["restarts", f"{len(restarts)}: " + ", ".join(
            f"rank {r.get('rank')} ({r.get('reason') or 'died'})" for r in restarts)])
    for count in stats.shown_counts(summary=True):  # the protocol's own, over all ranks
        rows.append([count.label, combine(count, {rank: s.counts.get(count.field) for rank, s in stats.ranks.items()})])
    coordinator = stats.coordinator or {}
    for count in stats.shown_coordinator_counts():
        rows.append([f"coordinator: {count.label}", format_value(coordinator.get(count.field))])
    return Table(["", ""], rows)


def launch_restarts(run: RunData) -> list[dict[str, Any]]:
    """``launch.json``'s ``restarts`` (the workers ``--max-restarts`` replaced), in time order."""
    restarts = run.launch.get("restarts")
    if not isinstance(restarts, list):
        return []
    return sorted((r for r in restarts if isinstance(r, dict)),
                  key=lambda r: r["mono"] if isinstance(r.get("mono"), (int, float)) else 0.0)


def _donor(rejoined: dict[str, Any]) -> Any:
    """The rank a replacement took its model from: ``from`` in its ``rejoined`` record (or ``peer``)."""
    return rejoined.get("from", rejoined.get("peer"))


def restart_table(run: RunData, t0: float) -> Table:
    """One row per replacement: when, why, the pids, and where it rejoined (its ``rejoined`` record)."""
    rejoined = {(rec.get("rank"), rec.get("restart")): rec for records in run.events.values() for rec in records
                if rec.get("event") == "rejoined"}
    rows = []
    for r in launch_restarts(run):
        mono = r.get("mono")
        at = f"{mono - t0:.2f} s" if isinstance(mono, (int, float)) else "?"
        joined = rejoined.get((r.get("rank"), r.get("restart")))
        where = (f"iteration {joined.get('iter')}, model of rank {_donor(joined)}" if joined is not None
                 else "no rejoined record")
        rows.append([str(r.get("rank")), str(r.get("restart")), at, str(r.get("reason")),
                     f"{r.get('old_pid')} → {r.get('new_pid')}", where])
    return Table(["rank", "restart", "at", "how it died", "pid", "rejoined"], rows)


def rank_table(stats: RunStats) -> Table:
    """Per rank: progress, the step's time split, the protocol's own counts (its declaration), drops, loss."""
    parts, counts = time_parts(stats), stats.shown_counts()
    headers = ["rank", "status", "iterations", "steps", "it/s", *(label for _, label in parts),
               *(c.label for c in counts), "dropped", "last loss"]
    rows = []
    for rank, s in stats.ranks.items():
        rows.append([str(rank), s.status, str(s.iterations), str(s.steps), f"{s.rate:.2f}",
                     *(_pct(s.share(p)) for p, _ in parts), *(format_value(s.counts.get(c.field)) for c in counts),
                     str(s.dropped), "-" if s.last_loss is None else f"{s.last_loss:.4g}"])
    return Table(headers, rows)


def gap_table(gaps: list[EdgeGap]) -> Table:
    rows = [[str(g.ahead), str(g.behind), str(g.observed), format_bound(g.bound),
             {True: "yes", False: "NO", None: "?"}[g.within]] for g in gaps]
    return Table(["i", "j", "largest Iter(i) − Iter(j)", "Table 1 bound", "within"], rows)


def _gap_note(run: RunData, gaps: list[EdgeGap]) -> str:
    if not gaps:
        return "No gaps: the logs have no enter records or the run directory has no graph.json."
    if run.config is None:
        return f"{len(gaps)} ordered pairs of neighbours; the bounds need the run's options (launch.json)."
    outside = [g for g in gaps if g.within is False]
    rule = bound_rule(run.config)
    if rule is None:
        return (f"--protocol {run.config.protocol} proves no bound on the iteration gap; the largest of the "
                f"{len(gaps)} ordered pairs of neighbours was {max(g.observed for g in gaps)}.")
    if outside:
        return (f"Bound for this setting: {rule}. {len(outside)} of {len(gaps)} pairs EXCEED it: "
                + ", ".join(f"{g.ahead}→{g.behind} ({g.observed} > {format_bound(g.bound)})" for g in outside[:10]))
    return (f"Bound for this setting: {rule} (len = shortest path length). "
            f"All {len(gaps)} ordered pairs of neighbours stayed within it; the largest gap was "
            f"{max(g.observed for g in gaps)}.")


def first_view_run(run: RunData, views: list[View]) -> RunData:
    """``run`` as far as its first view went: view 0's ranks, their records before view 1 began
    (the iteration gaps are measured on one graph; later views place the members on new ones)."""
    if len(views) < 2:
        return run
    change = views[1]
    members = set(views[0].members)

    def before(rec: dict[str, Any]) -> bool:
        if change.first_iter is not None:
            return not isinstance(rec.get("iter"), int) or rec["iter"] < change.first_iter
        return change.mono is None or not isinstance(rec.get("mono"), (int, float)) or rec["mono"] < change.mono

    events = {rank: [rec for rec in records if before(rec)] for rank, records in run.events.items() if rank in members}
    return dataclasses.replace(run, events=events)


def _first_view_note(views: list[View]) -> str:
    if len(views) < 2:
        return ""
    first = views[1].first_iter
    return (" Measured in view 0 only" + (f" (iterations before {first})" if first is not None else "")
            + ": each later view places its members on a new graph.")


def gap_section(run: RunData, stats: RunStats) -> Section | None:
    """The iteration gaps, as far as they matter for the protocol (``OutputSpec.gaps``): between graph
    neighbours against its proven bound (Hop), the largest between any two workers, or none. An elastic
    run's are those of its first view."""
    scope = stats.output.gaps
    note = _first_view_note(stats.views)
    run = first_view_run(run, stats.views)
    if scope == "neighbours":
        gaps = edge_gaps(run)
        section = Section("Iteration gaps", paragraphs=[_gap_note(run, gaps) + note])
        figure = plots.gap_plot(gaps)
        if figure is not None:
            section.figures.append(Figure("gaps", "Largest gap per pair of neighbours", "Observed (bars) "
                                          "beside Hop's Table 1 bound (hatched).", figure))
        if gaps:
            section.tables.append(gap_table(gaps))
        return section
    if scope == "all":
        return Section("Iteration gaps", paragraphs=[_largest_gap_note(run) + note])
    return None


def _largest_gap_note(run: RunData) -> str:
    n = run.world_size
    events = {rank: records for rank, records in run.events.items() if 0 <= rank < n}
    if n < 2 or not any(rec.get("event") == "enter" and "mono" in rec for recs in events.values() for rec in recs):
        return "No gaps: the logs have no enter records."
    observed = max_gap_from_run(events, n)
    gap, i, j = max((int(observed[a][b]), a, b) for a in range(n) for b in range(n) if a != b)
    rule = bound_rule(run.config) if run.config is not None else None
    protocol = run.config.protocol if run.config is not None else "this protocol"
    bound = f"; bound for this setting: {rule}" if rule is not None else f"; --protocol {protocol} proves no bound on it"
    return (f"The largest Iter(i) − Iter(j) between any two workers was {gap}" + (f" (i = {i}, j = {j})" if gap else "")
            + bound + ".")


def _ranks_or_dash(ranks: tuple[int, ...]) -> str:
    return ", ".join(str(r) for r in ranks) or "-"


def views_section(stats: RunStats) -> Section:
    """An elastic run's views: who joined, left, died or was refused, from which iteration and when."""
    rows = []
    for view in stats.views:
        at = "start" if view.number == 0 else "?" if view.mono is None else f"{view.mono - stats.t0:.2f} s"
        changes = [_ranks_or_dash(ranks) for ranks in (view.joined, view.left, view.died, view.refused)]
        rows.append([str(view.number), "?" if view.first_iter is None else str(view.first_iter), at,
                     f"{len(view.members)}: {_ranks_or_dash(view.members)}", *changes])
    lines = [f"View {v.number} at {v.mono - stats.t0:.2f} s: {v.change()}." for v in stats.views[1:]
             if v.mono is not None]
    return Section("Views", tables=[Table(["view", "from iteration", "at", "members", "joined", "left", "died",
                                           "refused"], rows)], paragraphs=[
        "The run's membership (hopnet launch --max-nproc, hopnet join): each view's members, who joined, left "
        "(SIGTERM: a clean leave, exit 0), died or was refused, the view's first iteration and when its first "
        "member committed it (from the run's start). The plots mark each change with a dashed line.", *lines])


def _at_view_change(rec: dict[str, Any], views: list[View]) -> bool:
    """A ``peer_left`` record of a segment's end: the peer finished the view's last iteration."""
    last = rec.get("last_iter")
    return rec.get("event") == "peer_left" and isinstance(last, int) and any(
        v.number > 0 and v.first_iter == last + 1 for v in views)


def _describe(rec: dict[str, Any], t0: float) -> str:
    at = rec.get("mono")
    when = f"{at - t0:.2f} s" if isinstance(at, (int, float)) else "?"
    kind = rec.get("event")
    rank = rec.get("rank")
    if kind == "peer_left":
        return f"{when}: rank {rank} saw peer {rec.get('peer')} leave after iteration {rec.get('last_iter')}"
    if kind == "rejoined":
        return (f"{when}: rank {rank} (restart {rec.get('restart')}) rejoined in iteration {rec.get('iter')} "
                f"with rank {_donor(rec)}'s model")
    if kind == "peer_dead":
        return (f"{when}: rank {rank} found peer {rec.get('peer')} dead (silent {rec.get('silent_s')} s, "
                f"iteration {rec.get('iter')})")
    peer = f", peer {rec.get('peer')} {rec.get('peer_state') or ''}".rstrip() if rec.get("peer") is not None else ""
    return (f"{when}: rank {rank} failed in iteration {rec.get('iter')}: {rec.get('error')}: "
            f"{rec.get('message')}{peer} (exit code {rec.get('exit_code')})")


def build_content(run: RunData) -> ReportContent:
    stats = run_stats(run)
    progress = Section("Progress", tables=[rank_table(stats)], paragraphs=[
        "iterations: finished iterations, skipped ones included; steps: iterations computed; "
        "it/s: iterations from starting iteration 0 to finishing the last one. The shares split "
        "each step: compute is the trainer's time between steps (optimizer step included), the waits "
        "are the protocol's, mixing is the rest of the step (averaging, sending). The columns after them "
        "are the protocol's own counts, from each worker's stop record."])
    caption = ("A straggler's line is flatter; its neighbours' lines follow it within the gap bound."
               if stats.output.gaps == "neighbours" else "A straggler's line is flatter.")
    progress.figures.append(Figure("iterations", "Iteration against wall time", caption,
                                   plots.iteration_plot(stats)))
    loss = plots.loss_plot(stats)
    if loss is not None:
        progress.figures.append(Figure("loss", "Loss against wall time", "As each worker reported it "
                                       "(worker.report(loss=...)).", loss))
    else:
        progress.paragraphs.append("No worker reported a loss (worker.report(loss=...)), so there is no loss plot.")
    split = Section("Where the time went", figures=[Figure(
        "time_split", "Time per worker", "Stacked: " + ", ".join(label for _, label in time_parts(stats)) + ".",
        plots.time_split_plot(stats))])
    sections = [views_section(stats)] if is_elastic(run) else []
    sections += [progress, split]
    gaps = gap_section(run, stats)
    if gaps is not None:
        sections.append(gaps)
    if launch_restarts(run):
        sections.append(Section("Restarts", tables=[restart_table(run, stats.t0)], paragraphs=[
            "Workers that died and were started again (hopnet launch --max-restarts), from launch.json; "
            "at: when the replacement started; rejoined: the iteration it joined the run in and the "
            "neighbour whose model it took (its rejoined record)."]))
    last_iteration = max((s.iterations for s in stats.ranks.values()), default=0) - 1
    notable = [rec for rec in stats.notable
               if rec.get("event") != "peer_left" or not isinstance(rec.get("last_iter"), int)
               or rec["last_iter"] < last_iteration]  # leaving after the last iteration is the normal end
    notable = [rec for rec in notable if not _at_view_change(rec, stats.views)]
    if notable:
        sections.append(Section("Departures, dead peers, errors and rejoins",
                                paragraphs=[_describe(rec, stats.t0) for rec in notable]))
    title = f"hopnet run {run.path.name}"
    return ReportContent(title=title, overview=_overview(run, stats), sections=sections)

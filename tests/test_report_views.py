"""An elastic run's views in `hopnet report`, the trace, the launcher's lines, its live status line and
its summary table, checked against a synthetic elastic run directory: ranks 0-2 on ring:3, rank 3
joins in view 1 (from iteration 4), rank 1 leaves in view 2 (after iteration 6, exit 0)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from hopnet import Graph, ProtocolConfig
from hopnet.launch.elastic import left_the_run
from hopnet.report.build import write_report
from hopnet.report.diagnosis import diagnose
from hopnet.report.live import LaunchProgress, ProgressState
from hopnet.report.plots import iteration_figure, lag_figure, loss_figure
from hopnet.report.rundir import load_run_dir
from hopnet.report.stats import run_stats
from hopnet.report.summary import summary_text
from hopnet.report.trace import chrome_trace
from hopnet.report.view_watch import ViewWatch
from hopnet.report.views import View, fold_views, run_views
from hopnet.runtime.node import Node

T0 = 50.0
ITERATIONS = 10
JOIN_AT, LEAVE_AT = 4, 7  # view 1's and view 2's first iterations
VIEW1_MONO, VIEW2_MONO = T0 + 4.5, T0 + 7.5
STEP = {"compute_s": 0.5, "wait_updates_s": 0.25, "wait_tokens_s": 0.0, "mix_s": 0.25}


def _rec(event: str, rank: int, mono: float, **fields: Any) -> dict[str, Any]:
    return {"event": event, "rank": rank, "t": round(mono - T0, 6), "mono": mono, **fields}


def _committed(rank: int, view: int) -> dict[str, Any]:
    if view == 1:
        return _rec("view_committed", rank, VIEW1_MONO + 0.01 * rank, view=1, members=[0, 1, 2, 3], joined=[3],
                    left=[], died=[], refused=[], iter=JOIN_AT - 1)
    return _rec("view_committed", rank, VIEW2_MONO + 0.01 * rank, view=2, members=[0, 2, 3], joined=[], left=[1],
                died=[], refused=[], iter=LEAVE_AT - 1)


def _segment_end(rank: int, last: int, neighbours: list[int]) -> list[dict[str, Any]]:
    """A segment's end: its neighbours' byes (``peer_left`` after the view's last iteration), the stop record."""
    at = T0 + last + 1.1
    return [*(_rec("peer_left", rank, at, peer=p, last_iter=last, final_iter=last) for p in neighbours),
            _rec("stop", rank, at + 0.01, iter=last, dropped={})]


def _iterations(rank: int, first: int, end: int) -> list[dict[str, Any]]:
    out = []
    for k in range(first, end):
        out.append(_rec("enter", rank, T0 + k, iter=k))
        out.append(_rec("iteration", rank, T0 + k + 1, iter=k, loss=1.0 / (k + 1), **STEP))
    return out


def elastic_records(rank: int) -> list[dict[str, Any]]:
    config = json.loads(ProtocolConfig(max_ig=2).to_json())
    records: list[dict[str, Any]] = []
    if rank < 3:
        records += [_rec("start", rank, T0, config=config), _rec("plan", rank, T0, total=ITERATIONS)]
        records += _iterations(rank, 0, JOIN_AT) + [_committed(rank, 1)] + _segment_end(rank, JOIN_AT - 1, [])
    else:  # the joiner: its first segment admits it, its state comes with view 1
        records += [_rec("start", rank, T0 + 3.0, config=config), _committed(rank, 1),
                    _rec("stop", rank, T0 + 4.6, iter=0, dropped={})]
    records += [_rec("start", rank, VIEW1_MONO + 0.1, view=1, config=config),
                _rec("joined" if rank == 3 else "view_entered", rank, VIEW1_MONO + 0.2, view=1,
                     members=[0, 1, 2, 3], iter=JOIN_AT, position=rank)]
    records += _iterations(rank, JOIN_AT, LEAVE_AT) + [_committed(rank, 2)]
    records += _segment_end(rank, LEAVE_AT - 1, [p for p in (0, 2) if p != rank])
    if rank == 1:
        return records + [_rec("left", rank, VIEW2_MONO + 0.2, view=2, iter=LEAVE_AT - 1,
                               line=f"rank 1 left after iteration {LEAVE_AT - 1}: view 2 goes on without it")]
    records += [_rec("start", rank, VIEW2_MONO + 0.1, view=2, config=config),
                _rec("view_entered", rank, VIEW2_MONO + 0.2, view=2, members=[0, 2, 3], iter=LEAVE_AT,
                     position=[0, 2, 3].index(rank))]
    return records + _iterations(rank, LEAVE_AT, ITERATIONS) + _segment_end(rank, ITERATIONS - 1, [])


def write_elastic_run(run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    Graph.ring(3).to_json(run_dir / "graph.json")
    launch = {"config": json.loads(ProtocolConfig(max_ig=2).to_json()), "world_size": 3, "nproc": 3,
              "elastic": {"graph": "ring", "min": 1, "max": 4},
              "result": {"returncode": 0, "worker_returncodes": {"0": 0, "1": 0, "2": 0}}}
    (run_dir / "launch.json").write_text(json.dumps(launch))
    for rank in range(4):
        (run_dir / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in elastic_records(rank)))
    return run_dir


# ------------------------------------------------------------------ the views
def test_views_are_folded_from_the_logs(tmp_path: Path) -> None:
    views = run_views(load_run_dir(write_elastic_run(tmp_path / "run")))
    assert [v.number for v in views] == [0, 1, 2]
    assert [v.members for v in views] == [(0, 1, 2), (0, 1, 2, 3), (0, 2, 3)]
    assert (views[1].joined, views[2].left) == ((3,), (1,))
    assert [v.first_iter for v in views] == [0, JOIN_AT, LEAVE_AT]
    assert views[1].mono == VIEW1_MONO and views[2].mono == VIEW2_MONO  # the first member's commit
    assert [v.line() for v in views[1:]] == ["view 1: rank 3 joined (4 workers)", "view 2: rank 1 left (3 workers)"]


def test_a_view_line_names_every_change() -> None:
    view = View(5, (0, 2, 4, 5), joined=(4, 5), left=(1,), died=(3,), refused=(6,))
    assert view.line() == "view 5: ranks 4, 5 joined, rank 1 left, rank 3 died, rank 6 refused (4 workers)"
    assert fold_views([], [0, 1])[0].line() == "view 0: started (2 workers)"


def test_report_has_a_views_part_and_calls_no_leave_a_failure(tmp_path: Path) -> None:
    run_dir = write_elastic_run(tmp_path / "run")
    page = write_report(run_dir, tmp_path / "report.md", fmt="md")[0].read_text()
    views = page[page.index("## Views"):page.index("## Progress")]
    assert "| 1 | 4 | 4.50 s | 4: 0, 1, 2, 3 | 3 | - | - | - |" in views
    assert "| 2 | 7 | 7.50 s | 3: 0, 2, 3 | - | 1 | - | - |" in views
    assert "View 2 at 7.50 s: rank 1 left." in views
    assert "| views | 3 (3 → 4 → 3 workers); see Views |" in page
    assert "Departures" not in page  # the byes at a view change are no departures
    assert "fail" not in page[page.index("## Diagnosis"):page.index("## Views")]
    diagnosis = diagnose(load_run_dir(run_dir))
    assert diagnosis.failure is None and any("3 views" in note for note in diagnosis.notes)
    gaps = page[page.index("## Iteration gaps"):]  # on view 0's graph
    assert f"Measured in view 0 only (iterations before {JOIN_AT})" in gaps and "EXCEED" not in gaps
    html = write_report(run_dir, tmp_path / "report.html")[0].read_text()
    assert "Views" in html and "rank 1 left" in html


def test_leaver_status_joiner_row_and_rate(tmp_path: Path) -> None:
    stats = run_stats(load_run_dir(write_elastic_run(tmp_path / "run")))
    assert stats.ranks[1].status == "left" and stats.ranks[0].status == "finished"
    joiner = stats.ranks[3]
    assert (joiner.joined_iter, joiner.steps, joiner.iterations) == (JOIN_AT, ITERATIONS - JOIN_AT, ITERATIONS)
    assert joiner.rate == 1.0  # one iteration a second from the one it joined in, not from iteration 0
    rows = {line.split()[0]: line for line in summary_text(stats).splitlines()[1:]}
    assert rows["1"].endswith("left") and rows["3"].endswith("finished")


def _view_lines(ax: Any) -> dict[str, float]:
    return {line.get_gid(): line.get_xdata()[0] for line in ax.get_lines() if line.get_gid()}


def test_time_plots_mark_each_view_change(tmp_path: Path) -> None:
    stats = run_stats(load_run_dir(write_elastic_run(tmp_path / "run")))
    expected = {"view 1": VIEW1_MONO - T0, "view 2": VIEW2_MONO - T0}
    loss = loss_figure(stats)
    assert loss is not None
    for figure in (iteration_figure(stats), loss, lag_figure(stats, set())):
        ax = figure.axes[0]
        assert _view_lines(ax) == expected
        assert {text.get_text().strip() for text in ax.texts} >= {"view 1", "view 2"}


def test_trace_has_an_instant_per_view_change(tmp_path: Path) -> None:
    events = chrome_trace(load_run_dir(write_elastic_run(tmp_path / "run")))["traceEvents"]
    views = [e for e in events if e.get("cat") == "view"]
    assert [(e["name"], e["ph"], e["s"], e["ts"]) for e in views] == [("view 1", "i", "g", 4_500_000),
                                                                    ("view 2", "i", "g", 7_500_000)]
    assert views[1]["args"]["change"] == "rank 1 left"


# ------------------------------------------------------------------ the launcher's side
def test_view_watch_says_each_view_once_as_logs_grow(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    watch = ViewWatch(run_dir)
    assert watch.poll() == []
    logs = {rank: elastic_records(rank) for rank in range(4)}
    view1 = {rank: [r for r in recs if r["mono"] < VIEW2_MONO] for rank, recs in logs.items() if rank < 3}
    for rank, recs in view1.items():
        (run_dir / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert [v.line() for v in watch.poll()] == ["view 1: rank 3 joined (4 workers)"]
    assert watch.poll() == []
    write_elastic_run(run_dir)  # the rest, the joiner's log included
    assert [v.line() for v in watch.poll()] == ["view 2: rank 1 left (3 workers)"]
    assert watch.poll() == []


def test_status_line_counts_the_latest_views_members() -> None:
    state = ProgressState(3)
    for rank in range(4):
        state.add(rank, elastic_records(rank))
    text = state.status_text()
    assert f"iter {ITERATIONS}–{ITERATIONS}" in text and "view 2, 3 workers" in text  # rank 1 left at 7


def test_launch_progress_follows_the_joiners_logs_after_a_view_change(tmp_path: Path) -> None:
    progress = LaunchProgress(write_elastic_run(tmp_path / "run"), [0, 1, 2], io.StringIO(), io.StringIO(), live=False)
    progress.poll()  # the launch's own ranks: view 1 committed
    progress.poll()  # now rank 3's log too
    assert sorted(progress.state.ranks) == [0, 1, 2, 3] and progress.state.members == [0, 2, 3]


def test_left_the_run_reads_the_leavers_log(tmp_path: Path) -> None:
    run_dir = write_elastic_run(tmp_path / "run")
    assert left_the_run(run_dir, 1)
    assert not left_the_run(run_dir, 0) and not left_the_run(run_dir, 9)


def test_an_elastic_worker_logs_waited_on_peers_by_rank() -> None:
    written: list[dict[str, Any]] = []
    node = SimpleNamespace(_logging=True, members=(0, 2, 5), rank=2, _t0=0.0, timer=lambda: 1.0,
                           clock=SimpleNamespace(now=lambda: 1.0), events=SimpleNamespace(write=written.append))
    Node.record(node, "iteration", iter=5, wait_updates_from={"0": 0.25, "1": 0.5},  # type: ignore[arg-type]
                wait_tokens_from={"1": 0.125})
    assert written[0]["rank"] == 5  # positions 0, 1, 2 of the view are ranks 0, 2, 5
    assert (written[0]["wait_updates_from"], written[0]["wait_tokens_from"]) == ({"0": 0.25, "2": 0.5}, {"2": 0.125})

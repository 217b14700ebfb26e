"""`hopnet report`, its statistics, the Chrome trace and the live progress state, checked
against synthetic event logs whose timings and gaps are known exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hopnet import Graph, ProtocolConfig
from hopnet.report.build import write_report
from hopnet.report.gaps import edge_gaps
from hopnet.report.live import ProgressState
from hopnet.report.rundir import LogTail, load_run_dir
from hopnet.report.stats import run_stats
from hopnet.report.summary import summary_text
from hopnet.report.trace import chrome_trace
from hopnet.runtime.events import JsonlEventLog, read_events

from support.paths import ROOT

T0 = 100.0
# rank: (time of entering iteration 0, seconds per step, split of each step)
PLAN: dict[int, tuple[float, float, dict[str, float]]] = {
    0: (100.0, 1.0, {"compute_s": 0.25, "wait_updates_s": 0.5, "wait_tokens_s": 0.125, "mix_s": 0.125}),
    1: (100.25, 1.0, {"compute_s": 0.25, "wait_updates_s": 0.5, "wait_tokens_s": 0.125, "mix_s": 0.125}),
    2: (100.5, 2.0, {"compute_s": 1.5, "wait_updates_s": 0.25, "wait_tokens_s": 0.0, "mix_s": 0.25}),
}
ITERATIONS = 5
SKIP = (2, 4)  # rank 2 skips from iteration 2 to 4 (iteration 3 is never computed)


def _rec(event: str, rank: int, mono: float, **fields: Any) -> dict[str, Any]:
    return {"event": event, "rank": rank, "t": round(mono - T0, 6), "mono": mono, **fields}


def synthetic_records(rank: int) -> list[dict[str, Any]]:
    """Exactly timed logs: rank r enters iteration 0 at PLAN[r][0] and finishes a step every
    PLAN[r][1] seconds, entering the next iteration at that moment."""
    begin, step, split = PLAN[rank]
    records = [_rec("start", rank, T0, address="tcp://127.0.0.1:1"), _rec("enter", rank, begin, iter=0),
               _rec("plan", rank, begin, total=ITERATIONS)]
    iterations = [0, 1, 2, 4] if rank == 2 else list(range(ITERATIONS))
    mono = begin
    for position, k in enumerate(iterations):
        mono = begin + (position + 1) * step
        records.append(_rec("iteration", rank, mono, iter=k, queue=1, loss=1.0 / (k + 1), **split))
        if rank == 2 and k == SKIP[0]:
            records.append(_rec("skip", rank, mono, iter=SKIP[0], to=SKIP[1], behind=3))
        if position + 1 < len(iterations):
            records.append(_rec("enter", rank, mono, iter=iterations[position + 1]))
    dropped = {"bad_header": 2, "truncated": 1} if rank == 1 else {}
    records.append(_rec("stop", rank, mono + 0.5, iter=ITERATIONS - 1, dropped=dropped, late_updates_dropped=0))
    return records


def write_run(run_dir: Path, records: dict[int, list[dict[str, Any]]] | None = None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    Graph.ring(3).to_json(run_dir / "graph.json")
    (run_dir / "launch.json").write_text(json.dumps({"config": json.loads(ProtocolConfig(max_ig=2).to_json()),
                                                     "result": {"returncode": 0}}))
    for rank in PLAN:
        recs = records[rank] if records is not None else synthetic_records(rank)
        (run_dir / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return run_dir


# ------------------------------------------------------------------ statistics
def test_statistics_are_exact_on_known_timings(tmp_path: Path) -> None:
    stats = run_stats(load_run_dir(write_run(tmp_path / "run")))
    assert stats.t0 == T0 and stats.total == ITERATIONS
    fast, slow = stats.ranks[0], stats.ranks[2]
    assert (fast.iterations, fast.steps, fast.skips, fast.skipped_iterations) == (5, 5, 0, 0)
    assert (slow.iterations, slow.steps, slow.skips, slow.skipped_iterations) == (5, 4, 1, 1)
    assert fast.elapsed_s == 5.0 and fast.rate == 1.0
    assert slow.elapsed_s == 8.0 and slow.rate == 5 / 8
    assert fast.time_s == {"compute_s": 1.25, "wait_updates_s": 2.5, "wait_tokens_s": 0.625, "mix_s": 0.625}
    assert slow.time_s == {"compute_s": 6.0, "wait_updates_s": 1.0, "wait_tokens_s": 0.0, "mix_s": 1.0}
    assert [fast.share(p) for p in ("compute_s", "wait_updates_s", "wait_tokens_s", "mix_s")] == \
        [0.25, 0.5, 0.125, 0.125]
    assert slow.share("wait_updates_s") == 0.125
    assert stats.ranks[1].dropped == 3 and fast.dropped == 0
    assert fast.last_loss == 1 / 5 and slow.losses[-1] == (108.5, 1 / 5)
    assert slow.skip_points == [(106.5, 2, 4)]
    assert stats.wall_s == 8.5  # rank 2 finishes last, at 108.5
    assert all(s.status == "finished" for s in stats.ranks.values())


def test_gaps_are_replayed_exactly_and_checked_against_table_1(tmp_path: Path) -> None:
    run = load_run_dir(write_run(tmp_path / "run"))
    gaps = {(g.ahead, g.behind): g for g in edge_gaps(run)}
    # rank 0 enters k at 100 + k, rank 1 at 100.25 + k; rank 2 enters 0, 1, 2, 4 at 100.5, 102.5,
    # 104.5, 106.5: when rank 0 enters 4 (t = 104) rank 2 is still in 1, so the gap reaches 3.
    observed = {pair: g.observed for pair, g in gaps.items()}
    assert observed == {(0, 1): 1, (0, 2): 3, (1, 0): 0, (1, 2): 3, (2, 0): 0, (2, 1): 0}
    assert all(g.bound == 1 for g in gaps.values())  # ring, standard: min(len(j->i), 2 * len(i->j))
    assert {pair for pair, g in gaps.items() if not g.within} == {(0, 2), (1, 2)}


def test_error_records_mark_the_rank_failed(tmp_path: Path) -> None:
    records = {rank: synthetic_records(rank) for rank in PLAN}
    records[2] = [r for r in records[2] if r["event"] != "stop"]
    records[2].append(_rec("error", 2, 109.0, iter=5, error="WaitTimeout", message="timed out waiting for updates",
                           peer=1, peer_state="stalled", exit_code=1))
    run = load_run_dir(write_run(tmp_path / "run", records))
    stats = run_stats(run)
    assert stats.ranks[2].status == "failed (WaitTimeout)"
    assert [r["event"] for r in stats.notable] == ["error"]
    written = write_report(run.path, fmt="md")
    text = written[0].read_text()
    assert "failed in iteration 5: WaitTimeout: timed out waiting for updates, peer 1 stalled" in text


# ------------------------------------------------------------------ pages and trace
def test_html_report_embeds_the_figures_and_tables(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run")
    [page] = write_report(run_dir)
    assert page == run_dir / "report.html"
    html = page.read_text()
    # diagnosis (stragglers, lag), iterations, loss, time split, gaps
    assert html.count('src="data:image/png;base64,') == 6
    assert "<td>0</td><td>2</td><td>3</td><td>1</td><td class=\"bad\">NO</td>" in html
    assert "2 of 6 pairs EXCEED" in html
    assert "<td>2</td><td>finished</td><td>5</td><td>4</td><td>0.62</td><td>75.0%</td><td>12.5%</td>" in html


def test_markdown_report_writes_pngs_beside_the_page(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run")
    out = tmp_path / "out" / "summary.md"
    written = write_report(run_dir, out)
    assert written[0] == out
    pngs = written[1:]
    assert {p.name for p in pngs} == {"summary-stragglers.png", "summary-lag.png", "summary-iterations.png",
                                      "summary-loss.png", "summary-time_split.png", "summary-gaps.png"}
    for png in pngs:
        assert png.read_bytes().startswith(b"\x89PNG") and f"]({png.name})" in out.read_text()
    assert "| 0 | 2 | 3 | 1 | NO |" in out.read_text()


def test_chrome_trace_spans_are_the_measured_ones_and_never_overlap(tmp_path: Path) -> None:
    trace = chrome_trace(load_run_dir(write_run(tmp_path / "run")))
    events = trace["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert all({"ts", "dur", "pid", "tid", "name"} <= e.keys() and e["dur"] > 0 for e in spans)
    rank0 = [(e["name"], e["ts"], e["dur"]) for e in spans if e["pid"] == 0]
    assert rank0[:4] == [("compute", 0, 250_000), ("wait for updates", 250_000, 500_000),
                         ("mixing", 750_000, 125_000), ("wait for tokens", 875_000, 125_000)]
    for rank in PLAN:
        mine = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if e["pid"] == rank)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(mine, mine[1:]))
    total = {rank: sum(e["dur"] for e in spans if e["pid"] == rank) for rank in PLAN}
    assert total == {0: 5_000_000, 1: 5_000_000, 2: 8_000_000}
    skips = [e for e in events if e["ph"] == "i" and e["name"].startswith("skip")]
    assert [(e["pid"], e["ts"], e["args"]["to"]) for e in skips] == [(2, 6_500_000, 4)]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}


def test_report_cli_writes_page_and_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hopnet.cli.main import main

    run_dir = write_run(tmp_path / "run")
    code = main(["report", str(run_dir), "--trace", str(tmp_path / "t.json")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.splitlines()[-2:] == [f"wrote {run_dir / 'report.html'}", f"wrote {tmp_path / 't.json'}"]
    assert out.splitlines()[0].startswith("diagnosis: rank 2 computes 6.0x the median")
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]


@pytest.mark.parametrize("where,needle", [("missing", "no such run directory"),
                                          (".", "no rank*.jsonl event logs")])
def test_report_cli_rejects_what_is_not_a_run_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          where: str, needle: str) -> None:
    from hopnet.cli.main import main

    assert main(["report", str(tmp_path / where)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hopnet report: error: ") and needle in err, err


# ------------------------------------------------------------------ readers of growing logs
def test_partial_last_line_is_left_for_later(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run")
    log = run_dir / "rank0.jsonl"
    complete = log.read_text()
    log.write_text(complete + '{"event":"iteration","rank":0,"it')
    assert len(load_run_dir(run_dir).events[0]) == complete.count("\n")
    assert len(read_events(log)) == complete.count("\n")
    tail = LogTail(log)
    assert len(tail.read()) == complete.count("\n")
    with log.open("a") as handle:
        handle.write('er":5,"mono":1}\n')
    assert tail.read() == [{"event": "iteration", "rank": 0, "iter": 5, "mono": 1}]
    assert tail.read() == []


def test_event_log_flushes_on_time_not_only_on_count(tmp_path: Path) -> None:
    path = tmp_path / "rank0.jsonl"
    eager = JsonlEventLog(path, flush_interval_s=0.0)
    eager.write({"event": "start", "rank": 0})
    assert read_events(path) == [{"event": "start", "rank": 0}]  # on disk at once, no close needed
    lazy = JsonlEventLog(tmp_path / "rank1.jsonl", flush_interval_s=3600.0)
    lazy.write({"event": "start", "rank": 1})
    assert read_events(tmp_path / "rank1.jsonl") == []
    lazy.flush()
    assert read_events(tmp_path / "rank1.jsonl") == [{"event": "start", "rank": 1}]
    eager.close()
    lazy.close()


# ------------------------------------------------------------------ live status and summary
def test_status_line_shows_slowest_fastest_rate_loss_skips_and_time_left() -> None:
    state = ProgressState(3)
    assert state.status_text() == "training  starting 3 workers…"
    cutoff = 104.0
    for rank in PLAN:
        state.add(rank, [r for r in synthetic_records(rank) if r["mono"] <= cutoff])
    # by t = 104: rank 0 finished iteration 3, rank 1 iteration 2, rank 2 iteration 0; the fast
    # ranks run at 1 it/s (rank 2 has one point, no rate yet); 5 - 1 iterations left at 1 it/s.
    assert state.status_text() == "training  iter 1–4 of 5  1.00 it/s  loss 0.25  skips 0  ~4 s left"
    for rank in PLAN:
        state.add(rank, [r for r in synthetic_records(rank) if r["mono"] > cutoff])
    text = state.status_text()
    assert text.startswith("training  iter 5–5 of 5") and "skips 1" in text and "loss 0.2 " in text


def test_summary_table_numbers(tmp_path: Path) -> None:
    table = summary_text(run_stats(load_run_dir(write_run(tmp_path / "run"))))
    rows = [line.split() for line in table.splitlines()]
    assert rows[0] == ["rank", "iterations", "it/s", "wait", "updates", "wait", "tokens", "skips", "dropped",
                       "status"]
    assert rows[1:] == [["0", "5", "1.00", "50.0%", "12.5%", "0", "0", "finished"],
                        ["1", "5", "1.00", "50.0%", "12.5%", "0", "3", "finished"],
                        ["2", "5", "0.62", "12.5%", "0.0%", "1", "0", "finished"]]


def test_events_doc_example_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (ROOT / "docs" / "reference" / "events.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    run_dir = write_run(tmp_path / "run")
    exec(code.replace('"runs/20250101-120000-hop-ring-4"', repr(str(run_dir))), {})
    assert capsys.readouterr().out.splitlines() == [
        "0 5 1.0 it/s 50% waiting for updates", "1 5 1.0 it/s 50% waiting for updates",
        "2 5 0.6 it/s 12% waiting for updates"]

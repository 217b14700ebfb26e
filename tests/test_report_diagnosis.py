"""`hopnet report`'s diagnosis: it names the straggler or the slow link that limited a run, whom
each worker waited on (in the page, the records and the trace), and an option with the
simulator's predicted speedup. Runs come from the simulator (virtual time, fast) and, once,
from a real `hopnet launch` with a 20x straggler."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hopnet import Graph, ProtocolConfig
from hopnet.report.contention import core_waits
from hopnet.report.diagnosis import diagnose
from hopnet.report.rundir import load_run_dir
from hopnet.sim.whatif import predict
from hopnet.transports.inproc import LinkModel

from support.launch import run_launch
from support.paths import WORKERS
from support.simrun import write_sim_run

SPEEDUP = re.compile(r"diagnosis: try `([^`]+)`: simulator predicts ([0-9.]+)x faster")


def _report(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[list[str], str, dict]:
    """`hopnet report RUN_DIR --format md --trace`: its diagnosis lines, the page, the trace."""
    from hopnet.cli.main import main

    code = main(["report", str(run_dir), "-o", str(tmp_path / "page.md"), "--trace", str(tmp_path / "t.json")])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.startswith("diagnosis: ")]
    return lines, (tmp_path / "page.md").read_text(), json.loads((tmp_path / "t.json").read_text())


def _check_straggler_report(lines: list[str], page: str, trace: dict) -> float:
    """Rank 1 is named the straggler, its neighbours wait on it, and an option is predicted faster."""
    assert re.match(r"diagnosis: rank 1 computes (1[5-9]|2[0-5])x the median", lines[0]), lines
    assert "ranks 0 and 2 wait" in lines[0], lines
    found = [SPEEDUP.match(line) for line in lines]
    match = next(m for m in found if m)
    assert "--backup-workers 1" in match.group(1) and float(match.group(2)) > 1.5, lines
    assert page.splitlines()[page.splitlines().index("## Diagnosis") + 2].startswith("Rank 1 computes")
    for rank in (0, 2):  # the wait table: each neighbour waited on rank 1 most of its time
        row = next(line for line in page.splitlines() if line.startswith(f"| {rank} | "))
        assert re.search(r"rank 1: (\d+)\.\d%", row) and int(re.search(r"rank 1: (\d+)", row).group(1)) > 50, row
    waits = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"].startswith("wait for updates from")]
    assert {e["pid"] for e in waits if "1" in e["name"].removeprefix("wait for updates from ").split(", ")} >= {0, 2}
    flows = [e for e in trace["traceEvents"] if e.get("cat") == "update"]
    starts = {e["id"]: e for e in flows if e["ph"] == "s"}
    ends = [e for e in flows if e["ph"] == "f"]
    assert ends and all(e["id"] in starts for e in ends)
    assert {(starts[e["id"]]["pid"], e["pid"]) for e in ends} >= {(1, 0), (1, 2)}
    assert all(starts[e["id"]]["ts"] <= e["ts"] for e in ends)  # an arrow never goes back in time
    return float(match.group(2))


def test_simulated_straggler_is_named_waited_on_and_an_option_predicted_faster(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = write_sim_run(tmp_path / "run", Graph.ring(4), ProtocolConfig("hop", slowdown=["rank=1:20"]))
    for rank in (0, 2):  # the records name the peer waited on
        steps = [r for r in load_run_dir(run_dir).events[rank] if r["event"] == "iteration"]
        assert sum(r.get("wait_updates_from", {}).get("1", 0.0) for r in steps) > 0.5 * sum(
            r["wait_updates_s"] for r in steps)
    lines, page, trace = _report(run_dir, tmp_path, capsys)
    _check_straggler_report(lines, page, trace)
    assert any(line.startswith("diagnosis: without them the simulator predicts 20x faster") for line in lines)


def test_simulated_slow_link_is_named_with_its_transfer_time(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Link 1→2 takes 200 ms where the others take 1 ms, beside 10 ms of compute."""
    link = LinkModel(latency_s=0.001, overrides={(1, 2): (0.2, 0.0)})
    run_dir = write_sim_run(tmp_path / "run", Graph.ring(4), ProtocolConfig("hop"), link=link)
    lines, page, _ = _report(run_dir, tmp_path, capsys)
    assert lines[0].startswith("diagnosis: link 1→2 takes 200 ms per update, 20x the median compute step"), lines
    assert "rank 2 waits" in lines[0] and "computes" not in "".join(lines)  # no straggler
    match = next(m for m in map(SPEEDUP.match, lines) if m)
    assert "--staleness" in match.group(1) and float(match.group(2)) > 2, lines


def test_an_even_run_has_nothing_to_blame_and_no_prediction_without_a_predictor(tmp_path: Path) -> None:
    run_dir = write_sim_run(tmp_path / "run", Graph.ring(4), ProtocolConfig("hop"), iterations=20)
    diagnosis = diagnose(load_run_dir(run_dir))
    assert not diagnosis.stragglers and not diagnosis.slow_links and not diagnosis.predictions
    assert diagnosis.lines()[0].startswith("no straggler or slow link")
    # with the simulator, it reproduces the run: 20 steps of 10 ms
    predicted = diagnose(load_run_dir(run_dir), predictor=predict)
    assert predicted.simulated_s == pytest.approx(0.2, rel=0.05) and not predicted.predictions


@pytest.mark.parametrize("result, first", [
    ({"returncode": 1, "failed_rank": 2, "reason": "killed by SIGKILL",
      "summary": "rank 2 died (killed by SIGKILL) after iteration 24"},
     "the run failed: rank 2 died (killed by SIGKILL) after iteration 24"),
    ({"returncode": 130}, "the run was stopped by SIGINT (exit 130)"),
    ({"returncode": 0}, "no straggler or slow link")])
def test_a_run_that_ended_badly_says_so_first(tmp_path: Path, result: dict, first: str) -> None:
    """The launcher's word on how the run ended (launch.json's result) comes before what limited it."""
    run_dir = write_sim_run(tmp_path / "run", Graph.ring(4), ProtocolConfig("hop"), iterations=20)
    launch = json.loads((run_dir / "launch.json").read_text())
    (run_dir / "launch.json").write_text(json.dumps({**launch, "result": result}))
    lines = diagnose(load_run_dir(run_dir)).lines()
    assert lines[0].startswith(first), lines
    assert any(line.startswith("no straggler or slow link") for line in lines), lines


def test_majority_eager_sgd_waits_name_the_straggling_initiator(tmp_path: Path) -> None:
    """Under majority eager-SGD every rank waits for the round's initiator: rank 1's rounds start late."""
    config = ProtocolConfig("eager-sgd", eager_mode="majority", slowdown=["rank=1:20"])
    run_dir = write_sim_run(tmp_path / "run", Graph.ring(4), config, iterations=24)
    [straggler] = diagnose(load_run_dir(run_dir)).stragglers
    assert straggler.rank == 1 and set(straggler.waiters) == {0, 2, 3}
    assert all(share > 0.5 for share in straggler.waiters.values()), straggler


@pytest.mark.slow
def test_real_20x_straggler_is_diagnosed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`hopnet launch --slowdown rank=1:20` on a ring of 4: 5 ms steps, 100 ms on rank 1."""
    run_dir = tmp_path / "run"
    proc = run_launch(["--graph", "ring:4", "--run-dir", str(run_dir), "--slowdown", "rank=1:20",
                       str(WORKERS / "hop_worker.py"), "--iterations", "20", "--compute-ms", "5", "--dim", "100"])
    assert proc.returncode == 0, proc.stderr
    lines, page, trace = _report(run_dir, tmp_path, capsys)
    _check_straggler_report(lines, page, trace)


def _with_cpu_records(run_dir: Path, runq_per_s: float, cores: int) -> None:
    """Give each rank's log what a real worker records: its machine and cores in ``start``, and its busy
    threads' scheduler counters at the start and at the end of training (``runq_s`` growing by
    ``runq_per_s`` per second)."""
    for path in sorted(run_dir.glob("rank*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        start = next(r for r in records if r["event"] == "start")
        last = max(r["mono"] for r in records if isinstance(r.get("mono"), (int, float)))
        start.update(host="node7", cores=cores, cpu_s=0.5, runq_s=0.1)
        records.append({"event": "cpu", "rank": start["rank"], "mono": last, "cpu_s": 0.5 + (last - start["mono"]),
                        "runq_s": 0.1 + runq_per_s * (last - start["mono"])})
        path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_workers_waiting_for_a_core_are_named_contended_and_no_option_is_suggested(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The slow link of the test above, on a machine whose 2 cores its 4 workers shared: the link's
    wait is what contention looks like, so the diagnosis says so and suggests nothing."""
    link = LinkModel(latency_s=0.001, overrides={(1, 2): (0.2, 0.0)})
    run_dir = write_sim_run(tmp_path / "run", Graph.ring(4), ProtocolConfig("hop"), link=link)
    _with_cpu_records(run_dir, runq_per_s=0.5, cores=2)
    lines, _, _ = _report(run_dir, tmp_path, capsys)
    assert lines[0] == ("diagnosis: 4 busy workers share 2 cores on node7: each worker waited runnable for a core "
                        "0.50 s per second of training, so the waits on its peers are CPU contention, not a slow "
                        "link or a straggler"), lines
    assert not any("link 1→2" in line or "try `" in line for line in lines), lines
    assert lines[-1].startswith("diagnosis: no option suggested: no protocol option gives a worker a core; run at "
                                "most 2 busy workers on node7 (for example `--nproc 2`)"), lines


def test_core_waits_gives_each_rank_its_seconds_waiting_for_a_core_per_second(tmp_path: Path) -> None:
    run_dir = write_sim_run(tmp_path / "run", Graph.ring(4), ProtocolConfig("hop"))
    _with_cpu_records(run_dir, runq_per_s=0.3, cores=8)
    assert core_waits(load_run_dir(run_dir)) == pytest.approx(dict.fromkeys(range(4), 0.3))


def test_a_busy_machine_is_named_even_with_a_core_per_worker(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = write_sim_run(tmp_path / "run", Graph.ring(4), ProtocolConfig("hop"))
    _with_cpu_records(run_dir, runq_per_s=0.4, cores=8)
    lines, _, _ = _report(run_dir, tmp_path, capsys)
    assert lines[0].startswith("diagnosis: the threads of 4 workers (each computes and talks at once) and of any "
                               "other process outnumbered the 8 cores of node7"), lines
    assert "give each worker two cores of node7, or measure with them free" in lines[-1]


def test_a_slow_link_on_a_machine_with_cores_to_spare_is_still_a_slow_link(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    link = LinkModel(latency_s=0.001, overrides={(1, 2): (0.2, 0.0)})
    run_dir = write_sim_run(tmp_path / "run", Graph.ring(4), ProtocolConfig("hop"), link=link)
    _with_cpu_records(run_dir, runq_per_s=0.02, cores=2)  # 4 workers on 2 cores, but mostly asleep
    lines, _, _ = _report(run_dir, tmp_path, capsys)
    assert lines[0].startswith("diagnosis: link 1→2 takes 200 ms per update"), lines
    assert any(SPEEDUP.match(line) for line in lines), lines

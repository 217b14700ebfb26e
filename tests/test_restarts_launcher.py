"""`hopnet launch --max-restarts K`, the launcher's side: a worker that dies is started again
(``HOPNET_RESTART=N``) while the budget lasts, recorded in ``launch.json`` and said in one line;
the death watch and the rendezvous let the replacement in. The worker's side (rejoining the
running job) is tested with the protocols."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from hopnet import Graph
from hopnet.analysis import RunLogError, incarnations, load_run
from hopnet.cli.launch_cmd import _parse_launch, resumed_args
from hopnet.errors import ConfigError
from hopnet.launch.death_watch import DeathWatch
from hopnet.rendezvous.client import RendezvousError, exchange_addresses, exchange_addresses_async
from hopnet.rendezvous.server import RendezvousServer
from hopnet.launch.launcher import launch
from hopnet.launch.restarts import RestartBudget
from hopnet.report.content import build_content
from hopnet.report.html import render_html
from hopnet.report.markdown import write_markdown
from hopnet.report.rundir import load_run_dir
from hopnet.report.stats import run_stats
from hopnet.report.trace import chrome_trace

from support.launch import launch_in_process, run_launch, start_launch
from support.paths import ROOT
from support.processes import wait_gone
from support.wait import wait_until

CRASH_ONCE = str(ROOT / "tests" / "scripts" / "crash_once.py")


# --------------------------------------------------------------------------- the budget
def test_the_budget_restarts_deaths_until_it_is_spent() -> None:
    budget = RestartBudget(2)
    assert budget.decide(1, 0, "exit code 0", ending=False) is None  # a worker ending 0 is done
    assert budget.decide(1, -9, "killed by SIGKILL", ending=True) is None  # the run is ending
    first = budget.decide(1, -9, "killed by SIGKILL", ending=False)
    assert first is not None and (first.rank, first.number, first.used) == (1, 1, 1)
    assert first.line() == "rank 1 died (killed by SIGKILL); restarting it (restart 1 of 2)"
    budget.done(first, old_pid=10, new_pid=11, time="2026-01-01T00:00:00+00:00", mono=5.0)
    second = budget.decide(1, 3, "exit code 3", ending=False)
    assert second is not None and (second.number, second.used) == (2, 2)  # the rank's second replacement
    budget.done(second, old_pid=11, new_pid=12, time="2026-01-01T00:00:01+00:00", mono=6.0)
    assert budget.decide(0, 3, "exit code 3", ending=False) is None  # spent: per launcher, not per rank
    assert budget.summary() == "2 restarts: rank 1 (killed by SIGKILL), rank 1 (exit code 3)"
    assert budget.to_json()[0] == {"rank": 1, "restart": 1, "reason": "killed by SIGKILL", "old_pid": 10,
                                   "new_pid": 11, "time": "2026-01-01T00:00:00+00:00", "mono": 5.0}
    assert RestartBudget(0).decide(0, -9, "killed by SIGKILL", ending=False) is None
    assert RestartBudget(0).summary() is None


def test_a_replica_comes_back_under_one_restart_of_the_budget_and_one_number() -> None:
    budget = RestartBudget(1)
    assert budget.follow(2) is None  # nothing decided for its replica yet
    first = budget.decide_replica((2, 3), 3, -9, "killed by SIGKILL", ending=False)
    assert first is not None and (first.rank, first.number, first.used) == (3, 1, 1)
    sibling = budget.follow(2)
    assert sibling is not None and (sibling.rank, sibling.number, sibling.used) == (2, 1, 1)
    assert sibling.line() == ("rank 2 died (with its replica (killed by SIGKILL in rank 3)); restarting it "
                              "(restart 1 of 1)")
    assert budget.follow(2) is None  # once
    assert budget.decide_replica((0, 1), 0, -9, "killed by SIGKILL", ending=False) is None  # spent


@pytest.mark.parametrize("value", ["-1", "two"])
def test_a_bad_max_restarts_is_one_line(tmp_path: Path, value: str) -> None:
    result = launch_in_process(["--max-restarts", value, "--run-dir", str(tmp_path / "run"), CRASH_ONCE, "0", "x"])
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]  # after argparse's usage
    assert last.startswith("hopnet launch: error: argument --max-restarts: "), result.stderr
    assert not (tmp_path / "run").exists()


def test_max_restarts_on_the_torch_plane_is_refused_before_anything_starts(tmp_path: Path) -> None:
    result = launch_in_process(["--max-restarts", "1", "--bulk", "torch", "--run-dir", str(tmp_path / "run"),
                                CRASH_ONCE, "0", "x"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "hopnet launch: error: --max-restarts needs the ZeroMQ plane (CPU tensors, --bulk zmq or auto): "
        "the torch plane's process groups cannot take a new process in"], result.stderr
    assert not (tmp_path / "run").exists()


def test_the_api_refuses_a_negative_max_restarts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--max-restarts must be an integer >= 0"):
        launch(CRASH_ONCE, ["0", "x"], run_dir=tmp_path / "run", max_restarts=-1)
    assert not (tmp_path / "run").exists()


def _recorded_run(tmp_path: Path, *flags: str) -> Path:
    run_dir = tmp_path / "old"
    run_dir.mkdir()
    (run_dir / "launch.json").write_text(json.dumps(
        {"resumable_argv": [*flags, "--run-dir", str(run_dir), CRASH_ONCE, "0", "x"]}))
    return run_dir


def test_resume_keeps_the_recorded_max_restarts_and_refuses_another(tmp_path: Path) -> None:
    run_dir = _recorded_run(tmp_path, "--max-restarts", "2")
    assert resumed_args(_parse_launch(["--resume", str(run_dir)])).max_restarts == 2
    assert resumed_args(_parse_launch(["--resume", str(run_dir), "--max-restarts", "2"])).max_restarts == 2
    with pytest.raises(ConfigError, match="--max-restarts conflicts with the recorded run"):
        resumed_args(_parse_launch(["--resume", str(run_dir), "--max-restarts", "1"]))


# ---------------------------------------------------------------------- the death watch
def _write(path: Path, *recs: dict) -> None:
    with path.open("a") as handle:
        for rec in recs:
            handle.write(json.dumps(rec) + "\n")


def test_a_replacement_is_not_killed_for_what_was_said_about_the_process_it_replaces(tmp_path: Path) -> None:
    watch = DeathWatch(tmp_path, [0, 1], stopped_limit_s=5.0)
    running = {0: os.getpid(), 1: os.getpid()}
    _write(tmp_path / "rank0.jsonl", {"event": "peer_dead", "peer": 1, "silent_s": 5.0, "iter": 4, "mono": 100.0})
    (found,) = watch.poll(running)
    assert found.rank == 1
    watch.restarted(1, mono=101.0, number=1)
    _write(tmp_path / "rank0.jsonl", {"event": "peer_dead", "peer": 1, "silent_s": 5.5, "iter": 4, "mono": 100.5})
    assert watch.poll(running) == []  # written before the replacement started: about the old process
    _write(tmp_path / "rank0.jsonl", {"event": "peer_dead", "peer": 1, "silent_s": 5.5, "iter": 4, "mono": 106.0,
                                      "restart": 0})
    assert watch.poll(running) == []  # later, but about the process its declarer had heard from: the old one
    _write(tmp_path / "rank0.jsonl", {"event": "peer_dead", "peer": 1, "silent_s": 5.0, "iter": 9, "mono": 120.0,
                                      "restart": 1})
    (again,) = watch.poll(running)  # the replacement itself went silent later
    assert again.rank == 1 and again.iteration == 9


# ------------------------------------------------------------------------- rendezvous
def _complete_table(server: RendezvousServer, world_size: int) -> dict[int, str]:
    tables: list[dict[int, str]] = []
    threads = [threading.Thread(target=lambda r=r: tables.append(
        exchange_addresses(server.endpoint, r, world_size, f"tcp://old:{r}", timeout_s=5)))
        for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(tables) == world_size
    return tables[0]


def test_a_restart_registration_replaces_the_address_once_the_table_is_complete() -> None:
    with RendezvousServer(3) as server:
        _complete_table(server, 3)
        with pytest.raises(RendezvousError, match="rank 1 registered twice"):
            exchange_addresses(server.endpoint, 1, 3, "tcp://new:1", timeout_s=2)  # no "restart": refused
        table = exchange_addresses(server.endpoint, 1, 3, "tcp://new:1", timeout_s=2, restart=1)
        assert table == {0: "tcp://old:0", 1: "tcp://new:1", 2: "tcp://old:2"}  # answered at once
        assert server.addresses == table
        again = exchange_addresses(server.endpoint, 1, 3, "tcp://newer:1", timeout_s=2, restart=2)
        assert again[1] == "tcp://newer:1"


async def test_the_async_client_sends_the_restart_too() -> None:
    with RendezvousServer(2) as server:
        _complete_table(server, 2)
        table = await exchange_addresses_async(server.endpoint, 0, 2, "tcp://new:0", 2, restart=1)
        assert table == {0: "tcp://new:0", 1: "tcp://old:1"}


def test_a_restart_registration_before_the_table_is_complete_is_a_registration() -> None:
    with RendezvousServer(2) as server:
        tables: list[dict[int, str]] = []
        t = threading.Thread(target=lambda: tables.append(
            exchange_addresses(server.endpoint, 0, 2, "tcp://a", timeout_s=5, restart=1)))
        t.start()
        wait_until(lambda: server.registered_ranks() == [0], 10, interval=0.01, what="rank 0's registration")
        assert not server.complete.is_set()  # it waits for the others like any registration
        assert exchange_addresses(server.endpoint, 1, 2, "tcp://b", timeout_s=5) == {0: "tcp://a", 1: "tcp://b"}
        t.join(5)
        assert tables == [{0: "tcp://a", 1: "tcp://b"}]
    with pytest.raises(ConfigError, match="restart"):
        exchange_addresses("tcp://127.0.0.1:1", 0, 2, "tcp://a", timeout_s=1, restart=-1)


# ----------------------------------------------------------------- real processes
def _launch(tmp_path: Path, *flags: str, victim: int = 1, script_args: tuple[str, ...] = ()) -> tuple[
        int, str, dict]:
    out = tmp_path / "out"
    out.mkdir()
    run_dir = tmp_path / "run"
    proc = run_launch(["--nproc", "3", *flags, "--run-dir", str(run_dir), "--no-progress", CRASH_ONCE,
                       str(victim), str(out), *script_args], timeout=120)
    return proc.returncode, proc.stderr, json.loads((run_dir / "launch.json").read_text())


def _pid(out: Path, rank: int, incarnation: int) -> int:
    return int((out / f"rank{rank}.{incarnation}.pid").read_text())


@pytest.mark.parametrize("start_method", ["forkserver", "exec"])
def test_a_killed_worker_is_restarted_and_the_run_finishes(tmp_path: Path, start_method: str) -> None:
    code, err, record = _launch(tmp_path, "--max-restarts", "1", "--start-method", start_method)
    assert code == 0, err
    assert "hopnet launch: rank 1 died (killed by SIGKILL); restarting it (restart 1 of 1)" in err.splitlines()
    assert "hopnet launch: 1 restart: rank 1 (killed by SIGKILL)" in err.splitlines()
    out = tmp_path / "out"
    seen = json.loads((out / "rank1.restart1.json").read_text())
    assert seen == {"pid": _pid(out, 1, 1), "HOPNET_RESTART": "1", "HOPNET_MAX_RESTARTS": "1"}
    (restart,) = record["restarts"]
    assert {k: restart[k] for k in ("rank", "restart", "reason", "old_pid", "new_pid")} == {
        "rank": 1, "restart": 1, "reason": "killed by SIGKILL", "old_pid": _pid(out, 1, 0), "new_pid": _pid(out, 1, 1)}
    assert isinstance(restart["mono"], float) and restart["time"].startswith(record["start_time"][:10])
    assert record["worker_pids"] == {"0": _pid(out, 0, 0), "1": _pid(out, 1, 1), "2": _pid(out, 2, 0)}
    assert record["max_restarts"] == 1
    assert record["result"]["lost_ranks"] == [] and record["result"]["worker_returncodes"] == {"0": 0, "1": 0, "2": 0}


def test_a_stopped_worker_killed_by_the_launcher_is_restarted(tmp_path: Path) -> None:
    code, err, record = _launch(tmp_path, "--max-restarts", "1", "--peer-timeout", "1",
                                script_args=("--how", "stop", "--sleep", "3"))
    assert code == 0, err
    (line,) = [line for line in err.splitlines() if "restarting it" in line]
    assert line.startswith("hopnet launch: rank 1 died (went silent: stopped (state T) for 1."), line
    assert line.endswith("; killed); restarting it (restart 1 of 1)")
    assert record["restarts"][0]["reason"].startswith("went silent: stopped (state T)")
    assert (tmp_path / "out" / "rank1.restart1.json").exists()
    assert record["result"]["worker_returncodes"] == {"0": 0, "1": 0, "2": 0}


def test_without_restarts_a_dead_worker_fails_the_run_as_before(tmp_path: Path) -> None:
    code, err, record = _launch(tmp_path, script_args=("--how", "exit"))
    assert code == 1, err
    assert "hopnet launch: worker 1 failed (exit code 3)" in err.splitlines()
    assert not any("restart" in line for line in err.splitlines() if "run dir" not in line)
    assert "restarts" not in record
    assert not (tmp_path / "out" / "rank1.1.pid").exists()


def test_a_worker_ended_by_a_configuration_error_is_not_restarted(tmp_path: Path) -> None:
    """A new process would meet the same error: the run fails at once, saying it once, with no restart."""
    out = tmp_path / "out"
    out.mkdir()
    proc = run_launch(["--nproc", "3", "--max-restarts", "1", "--run-dir", str(tmp_path / "run"), "--no-progress",
                       CRASH_ONCE, "1", str(out), "--how", "config"], timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert not any("restart" in line for line in proc.stderr.splitlines()), proc.stderr
    assert proc.stderr.count("this rank's configuration is wrong") == 1, proc.stderr
    assert not (out / "rank1.1.pid").exists()


@pytest.mark.parametrize("max_failures", [0, 1])
def test_a_worker_that_dies_again_past_the_budget_is_lost(tmp_path: Path, max_failures: int) -> None:
    code, err, record = _launch(tmp_path, "--max-restarts", "1", "--max-failures", str(max_failures),
                                script_args=("--how", "exit", "--always"))
    lines = err.splitlines()
    assert "hopnet launch: rank 1 died (exit code 3); restarting it (restart 1 of 1)" in lines
    assert [r["restart"] for r in record["restarts"]] == [1]
    if max_failures == 0:
        assert code == 1, err
        assert "hopnet launch: worker 1 failed (exit code 3)" in lines
        assert record["result"]["failed_rank"] == 1
    else:
        assert code == 0, err
        assert any(line.startswith("hopnet launch: lost rank 1 (1: exit code 3)") for line in lines), err
        assert record["result"]["lost_ranks"] == [1]


def test_sigterm_while_a_replacement_runs_leaves_no_process(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc = start_launch(["--nproc", "3", "--max-restarts", "1", "--run-dir", str(tmp_path / "run"), "--no-progress",
                         CRASH_ONCE, "1", str(out), "--sleep", "60", "--hold", "60"], new_session=True)
    try:
        wait_until((out / "rank1.restart1.json").exists, 60, what="rank 1's replacement", while_running=proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, err
    pids = [int(p.read_text()) for p in out.glob("rank*.pid")]
    assert len(pids) == 4  # three workers and the replacement
    wait_gone(pids, 10)


# ---------------------------------------------------------------------- the report
def _restarted_run(run_dir: Path) -> Path:
    """A hand-written run of 2 ranks in which rank 1 died in iteration 1 (SIGKILL, no record)
    and a replacement rejoined in iteration 2 with rank 0's model."""
    run_dir.mkdir()
    Graph.ring(2).to_json(run_dir / "graph.json")
    (run_dir / "launch.json").write_text(json.dumps({
        "result": {"returncode": 0}, "restarts": [
            {"rank": 1, "restart": 1, "reason": "killed by SIGKILL", "old_pid": 10, "new_pid": 11,
             "time": "2026-01-01T00:00:03+00:00", "mono": 103.0}]}))

    def rec(event: str, rank: int, mono: float, **fields: object) -> str:
        return json.dumps({"event": event, "rank": rank, "mono": mono, **fields}) + "\n"

    def steps(rank: int, iterations: range, begin: float) -> list[str]:
        return [rec("iteration", rank, begin + i - iterations.start + 1, iter=i, compute_s=0.5, wait_updates_s=0.5,
                    wait_tokens_s=0.0, mix_s=0.0) for i in iterations]

    (run_dir / "rank0.jsonl").write_text("".join([
        rec("start", 0, 100.0), rec("plan", 0, 100.0, total=5), *steps(0, range(5), 100.0), rec("stop", 0, 106.0)]))
    (run_dir / "rank1.jsonl").write_text("".join([
        rec("start", 1, 100.0), rec("plan", 1, 100.0, total=5), *steps(1, range(1), 100.0),
        rec("start", 1, 103.1, restart=1), rec("rejoined", 1, 103.5, restart=1, peer=0, iter=2),
        rec("plan", 1, 103.5, total=5), *steps(1, range(2, 5), 103.5), rec("stop", 1, 107.0)]))
    return run_dir


def test_a_rank_log_with_a_replacement_is_one_run(tmp_path: Path) -> None:
    run_dir = _restarted_run(tmp_path / "run")
    logs = load_run(run_dir)
    first, second = incarnations(logs[1])
    assert [r["event"] for r in first] == ["start", "plan", "iteration"]
    assert second[0] == {"event": "start", "rank": 1, "mono": 103.1, "restart": 1}
    assert len(incarnations(logs[0])) == 1
    with (run_dir / "rank0.jsonl").open("a") as handle:  # a second start without "restart": a reused dir
        handle.write(json.dumps({"event": "start", "rank": 0, "mono": 200.0}) + "\n")
    with pytest.raises(RunLogError, match="holds 2 runs"):
        load_run(run_dir)


def test_the_report_and_the_trace_show_the_restart(tmp_path: Path) -> None:
    run = load_run_dir(_restarted_run(tmp_path / "run"))
    stats = run_stats(run)
    assert stats.ranks[1].status == "finished, restarted 1x" and stats.ranks[1].iterations == 5
    assert stats.ranks[1].steps == 4 and stats.ranks[0].status == "finished"
    content = build_content(run)
    assert ["restarts", "1: rank 1 (killed by SIGKILL)"] in content.overview.rows
    (restarts,) = [s for s in content.sections if s.title == "Restarts"]
    assert restarts.tables[0].rows == [["1", "1", "3.00 s", "killed by SIGKILL", "10 → 11",
                                        "iteration 2, model of rank 0"]]
    (notes,) = [s for s in content.sections if s.title.startswith("Departures")]
    assert notes.paragraphs == ["3.50 s: rank 1 (restart 1) rejoined in iteration 2 with rank 0's model"]
    trace = chrome_trace(run)["traceEvents"]
    (restart,) = [e for e in trace if e["name"] == "restart"]
    assert (restart["pid"], restart["ts"], restart["ph"]) == (1, 3_000_000, "i")
    assert restart["args"]["reason"] == "killed by SIGKILL"
    assert [e["ts"] for e in trace if e["name"] == "rejoined"] == [3_500_000]
    assert "<h2>Restarts</h2>" in render_html(content)
    assert "## Restarts" in write_markdown(content, tmp_path / "report.md")[0].read_text()

"""One run per run directory, torch threads per worker, and analysis of logs that are not one run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hopnet.analysis import RunLogError, load_run, max_gap_from_run
from hopnet.errors import ConfigError
from hopnet.graph import Graph
from hopnet.launch.prepare import prepare_run_dir
from hopnet.launch.run_dir import CLAIM_FILE, RUN_FILE_PATTERNS, RunDirClaim, claim_run_dir
from hopnet.launch.spec import LaunchSpec, validate
from hopnet.launch.threads import limit_worker_threads, threads_per_worker, usable_cores
from hopnet.security import RunSecurity

from support.env import clean_env
from support.paths import ROOT, WORKERS
from support.launch import run_launch

HOP_WORKER = str(WORKERS / "hop_worker.py")


def _starts(log: Path) -> int:
    return sum(1 for line in log.read_text().splitlines() if json.loads(line)["event"] == "start")


# ---------------------------------------------------------------------------- the launcher, for real
@pytest.mark.slow
def test_a_reused_run_dir_is_refused_and_overwrite_replaces_only_the_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = run_launch(["--nproc", "4", "--run-dir", str(run_dir), HOP_WORKER, "--iterations", "10", "--dim", "10"])
    assert first.returncode == 0, first.stderr
    (run_dir / "notes.txt").write_text("mine\n")
    before = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()}

    again = run_launch(["--nproc", "2", "--run-dir", str(run_dir), HOP_WORKER, "--iterations", "10", "--dim", "10"])
    assert again.returncode == 2
    assert again.stdout == ""
    assert again.stderr.splitlines() == [
        f"hopnet launch: error: --run-dir {run_dir} already holds a run (graph.json, launch.json, 4 event logs): "
        "choose another directory or pass --overwrite to replace it"]
    assert {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()} == before  # nothing touched

    over = run_launch(["--nproc", "2", "--overwrite", "--run-dir", str(run_dir), HOP_WORKER,
                       "--iterations", "10", "--dim", "10"])
    assert over.returncode == 0, over.stderr
    said = [line for line in over.stderr.splitlines() if "--overwrite" in line]
    assert len(said) == 1 and said[0].startswith(
        f"hopnet launch: --overwrite: removed the previous run's graph.json, launch.json, 4 event logs from {run_dir}")
    assert sorted(p.name for p in run_dir.glob("rank*.jsonl")) == ["rank0.jsonl", "rank1.jsonl"]  # no stale rank3
    assert (run_dir / "notes.txt").read_text() == "mine\n"  # the user's file stays
    assert json.loads((run_dir / "launch.json").read_text())["world_size"] == 2
    events = load_run(run_dir)
    assert all(_starts(run_dir / f"rank{r}.jsonl") == 1 for r in events)
    gaps = max_gap_from_run(events, 2)
    assert gaps.shape == (2, 2) and gaps.max() <= 1


# ---------------------------------------------------------------------------- the run directory rules
def test_a_claim_refuses_a_run_and_overwrite_removes_only_the_runs_files(tmp_path: Path) -> None:
    assert CLAIM_FILE in RUN_FILE_PATTERNS
    (tmp_path / "data.csv").write_text("x\n")
    with claim_run_dir(tmp_path, overwrite=False) as claim:  # user files alone are no run
        assert claim.cleared is None and claim.path == tmp_path.resolve()
        assert json.loads((tmp_path / CLAIM_FILE).read_text()) == {"pid": os.getpid(), "host": socket.gethostname()}
    assert not claim.held
    with pytest.raises(ConfigError, match=r"already holds a run \(launch.lock\): .* pass --overwrite"):
        claim_run_dir(tmp_path, overwrite=False)  # a claim alone is a run (its launcher died before writing)
    (tmp_path / "rank0.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=r"already holds a run \(1 event log\)"):
        claim_run_dir(tmp_path, overwrite=False)
    with claim_run_dir(tmp_path, overwrite=True) as claim:
        assert claim.cleared == f"--overwrite: removed the previous run's 1 event log from {tmp_path}; kept 1 other file"
        assert sorted(os.listdir(tmp_path)) == ["data.csv", CLAIM_FILE]
        with pytest.raises(ConfigError, match=rf"--run-dir {tmp_path} is in use by a running launch "
                                              rf"\(pid {os.getpid()} on {socket.gethostname()}\): choose another"):
            claim_run_dir(tmp_path, overwrite=True)
        with pytest.raises(ConfigError, match=r"already holds a run \(launch.lock\)"):
            claim_run_dir(tmp_path, overwrite=False)
    assert sorted(os.listdir(tmp_path)) == ["data.csv", CLAIM_FILE]


PLAIN = RunSecurity(None, "off: loopback")
CLAIMANTS = 8


def _race(run_dir: Path, overwrite: list[bool]) -> tuple[list[tuple[int, RunDirClaim]], list[str]]:
    """``len(overwrite)`` launches prepare ``run_dir`` at once, launch i on a ring of i + 2 nodes
    (the winner's graph.json tells who won): the claims won, and the losers' messages."""
    plans = [validate(LaunchSpec(ROOT / "tests" / "scripts" / "launch_worker.py", graph=f"ring:{i + 2}",
                                 run_dir=run_dir, overwrite=flag)) for i, flag in enumerate(overwrite)]
    start = threading.Barrier(len(plans))
    won: list[tuple[int, RunDirClaim]] = []
    refused: list[str] = []
    said: list[list[str]] = [[] for _ in plans]

    def claimant(i: int) -> None:
        start.wait()
        try:
            won.append((i, prepare_run_dir(plans[i], PLAIN, said[i].append)))
        except ConfigError as exc:
            refused.append(str(exc))

    threads = [threading.Thread(target=claimant, args=(i,)) for i in range(len(plans))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(1 for lines in said if lines) <= 1  # only the winner says anything
    return won, refused


@pytest.mark.parametrize("mode", ["plain", "overwrite", "mixed"])
def test_of_simultaneous_claims_one_wins_and_the_losers_write_nothing(tmp_path: Path, mode: str) -> None:
    for attempt in range(5):
        run_dir = tmp_path / f"try{attempt}"
        if mode != "plain":  # an earlier run whose launcher was killed, and a file of the user's
            run_dir.mkdir()
            for name in ("graph.json", "launch.json", CLAIM_FILE, "rank0.jsonl", "rank7.jsonl", "notes.txt"):
                (run_dir / name).write_text("{}\n")
        overwrite = [mode == "overwrite" or (mode == "mixed" and i % 2 == 0) for i in range(CLAIMANTS)]
        won, refused = _race(run_dir, overwrite)
        assert len(won) == 1 and len(refused) == CLAIMANTS - 1, refused
        (winner, claim), = won
        assert all("\n" not in r and ("already holds a run" in r or "is in use by a running launch" in r)
                   for r in refused), refused
        user = ["notes.txt"] if mode != "plain" else []
        assert sorted(os.listdir(run_dir)) == sorted(["graph.json", CLAIM_FILE, *user])  # the winner's, and no more
        assert Graph.from_json(run_dir / "graph.json").n == winner + 2
        claim.release()


def test_a_killed_launchers_claim_is_a_run_that_overwrite_replaces(tmp_path: Path) -> None:
    """The launcher dies by SIGKILL holding the directory: its ``flock`` goes with it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with subprocess.Popen(
            [sys.executable, "-c", "import sys; from hopnet.launch.run_dir import claim_run_dir; "
             "claim = claim_run_dir(sys.argv[1], overwrite=False); (claim.path / 'graph.json').write_text('{}'); "
             "print('claimed', flush=True); sys.stdin.read()", str(run_dir)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=clean_env()) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "claimed\n"
            with pytest.raises(ConfigError, match=rf"is in use by a running launch \(pid {holder.pid} on "):
                claim_run_dir(run_dir, overwrite=True)
            holder.send_signal(signal.SIGKILL)
            assert holder.wait(timeout=30) == -signal.SIGKILL
        finally:
            holder.kill()  # nothing left to do if it is gone; the with waits for it
    with pytest.raises(ConfigError, match=r"already holds a run \(graph.json\): .* pass --overwrite"):
        claim_run_dir(run_dir, overwrite=False)
    with claim_run_dir(run_dir, overwrite=True) as claim:
        assert claim.cleared == f"--overwrite: removed the previous run's graph.json from {run_dir}"
        assert os.listdir(run_dir) == [CLAIM_FILE]
        assert json.loads((run_dir / CLAIM_FILE).read_text())["pid"] == os.getpid()


# ---------------------------------------------------------------------------- analysis of logs that are not one run
def _log(rank: int, enters: list[tuple[float, int]]) -> list[dict]:
    records = [{"event": "start", "rank": rank, "t": 0.0}]
    records += [{"event": "enter", "rank": rank, "t": m, "mono": m, "iter": k} for m, k in enters]
    return records


def _write(run_dir: Path, rank: int, records: list[dict], mode: str = "w") -> None:
    with (run_dir / f"rank{rank}.jsonl").open(mode) as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def test_analysis_of_a_clean_run(tmp_path: Path) -> None:
    from hopnet import Graph

    Graph.ring(2).to_json(tmp_path / "graph.json")
    _write(tmp_path, 0, _log(0, [(0.0, 0), (1.0, 1), (2.0, 2)]))
    _write(tmp_path, 1, _log(1, [(0.5, 0), (3.0, 1)]))
    gaps = max_gap_from_run(load_run(tmp_path), 2)
    assert gaps.tolist() == [[0, 2], [0, 0]]


def test_analysis_names_a_reused_directory_and_a_stale_rank(tmp_path: Path) -> None:
    from hopnet import Graph

    Graph.ring(2).to_json(tmp_path / "graph.json")
    _write(tmp_path, 0, _log(0, [(0.0, 0)]))
    _write(tmp_path, 1, _log(1, [(0.0, 0)]))
    _write(tmp_path, 3, _log(3, [(0.0, 0)]))  # left by an earlier run of 4 workers
    with pytest.raises(RunLogError, match=r"rank3.jsonl: rank 3 is not in this run's graph \(2 nodes\)"):
        load_run(tmp_path)
    with pytest.raises(RunLogError, match="event log of rank 3 in a run of 2 workers"):
        max_gap_from_run({0: _log(0, []), 3: _log(3, [])}, 2)
    (tmp_path / "rank3.jsonl").unlink()
    _write(tmp_path, 1, _log(1, [(5.0, 0)]), mode="a")  # a second run appended to the same log
    with pytest.raises(RunLogError, match=r"rank1.jsonl holds 2 runs \(2 start records without \"restart\"\)"):
        load_run(tmp_path)
    (tmp_path / "rank0.jsonl").write_text('{"event": "start", "rank": 0}\nnot json\n')
    with pytest.raises(RunLogError, match=r"rank0.jsonl:2: not a JSON record"):
        load_run(tmp_path)


# ---------------------------------------------------------------------------- threads
def test_threads_per_worker_share_the_usable_cores() -> None:
    assert threads_per_worker(4, cores=16) == 4
    assert threads_per_worker(3, cores=16) == 5
    assert threads_per_worker(8, cores=2) == 1
    assert threads_per_worker(1) == usable_cores()
    env: dict[str, str] = {}
    note = limit_worker_threads(env, 4, cores=8)
    assert env["OMP_NUM_THREADS"] == "2"
    assert note == "OMP_NUM_THREADS=2 for each of 4 workers (8 usable cores); set OMP_NUM_THREADS to choose otherwise"
    user = {"OMP_NUM_THREADS": "3"}
    assert limit_worker_threads(user, 4, cores=8) is None and user["OMP_NUM_THREADS"] == "3"


THREADS_SCRIPT = """\
import os, torch
print("THREADS", torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS"), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_torch_in_the_workers_uses_the_cores_divided_by_the_workers(tmp_path: Path, nproc: int,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    script = tmp_path / "threads.py"
    script.write_text(THREADS_SCRIPT)
    result = run_launch(["--nproc", str(nproc), "--run-dir", str(tmp_path / "run"), str(script)])
    assert result.returncode == 0, result.stderr
    expected = max(1, usable_cores() // nproc)
    threads = [line.split("THREADS ")[1] for line in result.stdout.splitlines() if "THREADS " in line]
    assert threads == [f"{expected} {expected}"] * nproc
    said = [line for line in result.stderr.splitlines() if "OMP_NUM_THREADS" in line]
    assert len(said) == 1 and said[0].startswith(f"hopnet launch: OMP_NUM_THREADS={expected} for each of {nproc}")


@pytest.mark.slow
def test_a_thread_count_the_user_set_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = usable_cores() + 1  # the launcher alone would give the one worker every core, one fewer than this
    monkeypatch.setenv("OMP_NUM_THREADS", str(mine))
    script = tmp_path / "threads.py"
    script.write_text(THREADS_SCRIPT)
    result = run_launch(["--nproc", "1", "--run-dir", str(tmp_path / "run"), str(script)])
    assert result.returncode == 0, result.stderr
    threads = [line.split("THREADS ")[1] for line in result.stdout.splitlines() if "THREADS " in line]
    assert [t.split()[1] for t in threads] == [str(mine)]  # torch itself caps the pool at the cores
    assert "OMP_NUM_THREADS" not in result.stderr


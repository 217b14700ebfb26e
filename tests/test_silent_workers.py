"""A worker that goes silent without exiting (SIGSTOP, a hang) is killed by the launcher, which
reacts only to exits otherwise: declared dead by a peer, or stopped for longer than
``--peer-timeout`` (:mod:`hopnet.launch.death_watch`). No run waits for it for ever."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hopnet.launch.death_watch import DeathWatch, process_state

from support.launch import kill, start_launch, worker_pids
from support.paths import WORKERS
from support.records import records
from support.wait import wait_until

HOP_WORKER = str(WORKERS / "hop_worker.py")


def _write(path: Path, *recs: dict) -> None:
    with path.open("a") as handle:
        for rec in recs:
            handle.write(json.dumps(rec) + "\n")


def test_a_peer_dead_record_about_a_running_rank_is_reported_once(tmp_path: Path) -> None:
    watch = DeathWatch(tmp_path, [0, 1, 2], stopped_limit_s=5.0)
    running = {0: os.getpid(), 2: os.getpid()}
    _write(tmp_path / "rank0.jsonl", {"event": "iteration", "iter": 3},
           {"event": "peer_dead", "peer": 2, "silent_s": 5.02, "iter": 4})
    _write(tmp_path / "rank1.jsonl", {"event": "peer_dead", "peer": 2, "silent_s": 5.1, "iter": 4},
           {"event": "peer_dead", "peer": 7, "silent_s": 5.1, "iter": 4})  # no such running rank
    (found,) = watch.poll(running)
    assert found.rank == 2 and found.iteration == 4
    assert found.reason == "declared dead by rank 0 after 5.0 s of silence, in iteration 4"
    _write(tmp_path / "rank0.jsonl", {"event": "peer_dead", "peer": 2, "silent_s": 9.0, "iter": 5})
    assert watch.poll(running) == []  # once per rank


def test_a_process_stopped_past_the_limit_is_reported(tmp_path: Path) -> None:
    now = [100.0]
    watch = DeathWatch(tmp_path, [0], stopped_limit_s=5.0, clock=lambda: now[0])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert watch.poll({0: sleeper.pid}) == []
        sleeper.send_signal(signal.SIGSTOP)
        wait_until(lambda: process_state(sleeper.pid) == "T", 10, interval=0.01, what="the sleeper to be stopped")
        assert watch.poll({0: sleeper.pid}) == []  # stopped from now on
        now[0] += 4.9
        assert watch.poll({0: sleeper.pid}) == []
        now[0] += 0.2
        (found,) = watch.poll({0: sleeper.pid})
        assert found.rank == 0 and found.reason.startswith("stopped (state T) for 5.")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert process_state(sleeper.pid) is None


def _stop_in_a_tolerant_hop_run(run_dir: Path, victim: int,
                                *flags: str) -> tuple[subprocess.Popen[str], dict[int, int], str]:
    """4 Hop workers with a backup worker each and --max-failures 1; ``victim`` SIGSTOPped once it
    is in iteration 5. The launch (ended), the workers' pids and its stderr."""
    proc = start_launch(["--nproc", "4", "--backup-workers", "1", "--max-failures", "1", "--peer-timeout", "2",
                         *flags, "--run-dir", str(run_dir), "--no-progress", HOP_WORKER, "--dim", "100",
                         "--compute-ms", "5", "--iterations", "300"], new_session=True)
    try:
        pids = worker_pids(run_dir, 4)
        wait_until(lambda: any(r.get("iter", -1) >= 5 for r in records(run_dir, victim, "iteration")), 120,
                   interval=0.1, what=f"rank {victim}'s iteration 5", while_running=proc)
        os.kill(pids[victim], signal.SIGSTOP)
        _, err = proc.communicate(timeout=120)
    finally:
        kill(proc)
    return proc, pids, err


@pytest.mark.slow
def test_a_stopped_worker_is_killed_and_a_tolerant_run_finishes(tmp_path: Path) -> None:
    """The issue's hang: SIGSTOP one of 4 Hop workers with a backup worker each and
    --max-failures 1. The launcher kills it and the run ends with exit 0 and the lost-rank line."""
    run_dir = tmp_path / "run"
    victim = 3
    proc, pids, err = _stop_in_a_tolerant_hop_run(run_dir, victim)
    assert proc.returncode == 0, err
    lost = [line for line in err.splitlines() if line.startswith("hopnet launch: lost rank 3 ")]
    assert lost and "went silent" in lost[0] and "killed" in lost[0], err
    for rank in range(3):
        assert max(r["iter"] for r in records(run_dir, rank, "iteration")) == 299
    assert all(process_state(pid) in (None, "Z") for pid in pids.values())


@pytest.mark.slow
def test_a_stopped_worker_on_the_torch_plane_is_lost_and_a_tolerant_run_finishes(tmp_path: Path) -> None:
    """The same on --bulk torch: the launcher kills the stopped worker, and its neighbours declare it
    dead (by their heartbeats, or from its pair connections closing), also one that only waited
    for it (blocked on its tokens, receiving nothing), which used to wait out --timeout."""
    run_dir = tmp_path / "run"
    victim = 2
    proc, _, err = _stop_in_a_tolerant_hop_run(run_dir, victim, "--bulk", "torch", "--timeout", "60")
    assert proc.returncode == 0, err
    lost = [line for line in err.splitlines() if line.startswith(f"hopnet launch: lost rank {victim} ")]
    assert lost and "killed" in lost[0], err
    for rank in (1, 3):  # its neighbours, whatever they were doing when it stopped
        (dead,) = records(run_dir, rank, "peer_dead")
        assert dead["peer"] == victim
    for rank in (0, 1, 3):
        assert max(r["iter"] for r in records(run_dir, rank, "iteration")) == 299

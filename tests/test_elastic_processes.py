"""Elastic runs as a user meets them: `hopnet launch --max-nproc`, `hopnet join RUN_DIR`, and a
preemption (SIGTERM to one worker) that the run survives."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from hopnet import Graph

from support.launch import JOIN, joining, kill, recorded_worker_pids, run_launch, start_launch
from support.paths import ROOT, WORKERS
from support.records import all_records, records
from support.wait import wait_until

DIGITS = str(ROOT / "examples" / "train_digits.py")
VIEW_GATED = str(ROOT / "tests" / "scripts" / "view_gated.py")
SLEEPY = (str(WORKERS / "hop_worker.py"), "--compute-ms", "10")
"""A worker that sleeps through its compute: for runs that only need to be training meanwhile."""
def _iteration(run_dir: Path, rank: int) -> int:
    done = records(run_dir, rank, "iteration")
    return done[-1]["iter"] if done else -1


@pytest.mark.slow
def test_two_workers_join_a_running_job_and_a_preempted_one_leaves(tmp_path: Path) -> None:
    # (DiLoCo's view changes, at outer steps, are tested with replica groups: test_elastic_replicas.py)
    run_dir = tmp_path / "run"
    # Every worker waits at iteration 150 until ranks 4 and 5 are admitted and at 300 until rank 2 has left
    # (tests/scripts/view_gated.py): a busy machine slows the joiners, not the run's outcome.
    launcher = start_launch(["--nproc", "4", "--max-nproc", "6", "--protocol", "hop", "--run-dir",
                             str(run_dir), VIEW_GATED, "--view-gate", "150:joined=4,5", "--view-gate", "300:left=2",
                             "--iterations", "500", "--eval-every", "100000"])
    try:
        with joining(run_dir, 2) as joiner:
            wait_until(lambda: all(records(run_dir, r, "joined") for r in (4, 5)), 120,
                       what="ranks 4 and 5 to join", while_running=launcher)
            os.kill(recorded_worker_pids(run_dir)[2], signal.SIGTERM)  # a preemption notice, to that worker alone
            out, err = launcher.communicate(timeout=180)
            joined_out, _ = joiner.communicate(timeout=60)
    finally:
        kill(launcher)
    assert launcher.returncode == 0, out + err
    assert "(mean of ranks 0, 1, 3, 4, 5)" in out  # the consensus names ranks, not places in the view
    assert joiner.returncode == 0, joined_out
    record = json.loads((run_dir / "launch.json").read_text())
    views = record["views"]
    assert views[0]["members"] == [0, 1, 2, 3]
    assert sorted(rank for view in views for rank in view["joined"]) == [4, 5]
    assert [rank for view in views for rank in view["left"]] == [2]
    assert views[-1]["members"] == [0, 1, 3, 4, 5]
    assert len(views) >= 3
    assert record["result"]["worker_returncodes"]["2"] == 0  # a leave is not a failure
    left = records(run_dir, 2, "left")
    assert left and left[0]["line"].startswith("rank 2 left after iteration")
    finals = {r["rank"]: r["accuracy"] for r in all_records(run_dir, "eval") if r.get("final")}
    assert set(finals) == {0, 1, 3, 4, 5}
    assert min(finals.values()) >= 0.95, finals
    for joined in (4, 5):  # each took a state from a member that was there before it, not both from one
        assert records(run_dir, joined, "joined")[0]["donor"] in (0, 1, 2, 3)
    gates = all_records(run_dir, "view_gate")
    assert {gate["rank"] for gate in gates} >= {0, 1, 3, 4, 5} and all(gate["opened"] for gate in gates), gates


def test_a_fixed_graph_refuses_an_elastic_run_at_launch(tmp_path: Path) -> None:
    graph = tmp_path / "ring.json"
    Graph.ring(4).to_json(graph)
    done = run_launch(["--max-nproc", "6", "--graph", str(graph), "--run-dir", str(tmp_path / "run"), DIGITS])
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"hopnet launch: error: --min-nproc/--max-nproc: --graph {graph} is a fixed graph and cannot re-form when "
        "workers join or leave: give a builder such as --graph ring or --graph torus")


@pytest.mark.parametrize("flags, line", [
    (["--protocol", "diloco", "--fragments", "2"], "--protocol diloco changes membership at an outer step: not "
                                                    "with --fragments, --overlap-steps or --outer-quorum"),
    (["--protocol", "ad-psgd"], "--protocol ad-psgd's workers drift apart without bound (a passive one runs far "
                                "ahead), and a view begins at one iteration for all; it cannot change membership yet"),
    (["--max-restarts", "1"], "--max-restarts replaces a dead worker in place; an elastic run re-forms without "
                              "it instead"),
])
def test_a_protocol_that_cannot_change_membership_says_so_at_launch(tmp_path: Path, flags: list[str],
                                                                    line: str) -> None:
    done = run_launch(["--nproc", "4", "--min-nproc", "2", *flags, "--run-dir", str(tmp_path / "run"), DIGITS])
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == f"hopnet launch: error: --min-nproc/--max-nproc: {line}"


def test_max_and_min_must_bracket_the_starting_size(tmp_path: Path) -> None:
    done = run_launch(["--nproc", "4", "--max-nproc", "3", "--run-dir", str(tmp_path / "run"), DIGITS])
    assert done.returncode == 2
    assert "--min-nproc 1 and --max-nproc 3 must bracket the 4 workers" in done.stderr


def test_join_refuses_a_run_that_is_not_elastic(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launcher = start_launch(["--nproc", "2", "--run-dir", str(run_dir), *SLEEPY, "--iterations", "100000"])
    try:
        wait_until(lambda: _iteration(run_dir, 0) >= 0, 120, what="the run to start training")
        done = subprocess.run([*JOIN, str(run_dir), "--nproc", "1"], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)
    finally:
        kill(launcher)
    assert done.returncode == 2
    assert done.stderr.strip() == ("hopnet join: error: this run is not elastic: it was launched without "
                                   "--max-nproc or --min-nproc, so it takes no joiners")


@pytest.mark.slow
def test_a_leave_below_min_nproc_stops_the_run_naming_who_left(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launcher = start_launch(["--nproc", "4", "--min-nproc", "4", "--run-dir", str(run_dir), *SLEEPY,
                             "--iterations", "1000000"])
    try:
        wait_until(lambda: _iteration(run_dir, 0) >= 20, 120, what="rank 0 to train")
        os.kill(recorded_worker_pids(run_dir)[2], signal.SIGTERM)
        out, err = launcher.communicate(timeout=120)
    finally:
        kill(launcher)
    assert launcher.returncode == 1, out + err
    line = "view 1 has 3 members, fewer than the minimum 4 (rank 2 left): the run stops"
    assert f"MembershipStopped: {line}" in err  # the launcher's summary: one line, the membership's
    record = json.loads((run_dir / "launch.json").read_text())
    assert record["result"]["worker_returncodes"]["2"] == 0  # the leaver left; the others stopped
    assert {record["result"]["worker_returncodes"][str(r)] for r in (0, 1, 3)} == {1}


@pytest.mark.slow
def test_a_join_beyond_max_nproc_is_refused_in_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launcher = start_launch(["--nproc", "2", "--max-nproc", "2", "--run-dir", str(run_dir), *SLEEPY,
                             "--iterations", "1000000"])
    try:
        wait_until(lambda: _iteration(run_dir, 0) >= 20, 120, what="rank 0 to train")
        done = subprocess.run([*JOIN, str(run_dir), "--nproc", "1"], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        still_training = _iteration(run_dir, 0)
        wait_until(lambda: _iteration(run_dir, 0) > still_training + 20, 60, what="the run to go on")
    finally:
        kill(launcher)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the join of rank 2 was refused: view 1 has 2 members, the most allowed (2)" in done.stderr
    assert "hopnet join: rank 2 exited 1" in done.stderr

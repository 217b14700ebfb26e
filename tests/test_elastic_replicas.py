"""Elastic runs of replica groups, as a user meets them: `hopnet join --nproc 2` adds a replica of 2
processes, which takes each lane's state from the same lane of a neighbour replica (under fsdp,
that lane's shards); a SIGTERM to one process of a replica makes the whole replica leave; a SIGKILL
under --max-failures takes a replica out of the views, and the others finish."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from support.launch import JOIN, joining, kill, recorded_worker_pids, start_launch
from support.paths import ROOT
from support.records import member_log
from support.wait import wait_until

VIEW_GATED = str(ROOT / "tests" / "scripts" / "view_gated.py")
FINGERPRINTED = str(ROOT / "tests" / "scripts" / "fingerprinted.py")


def _events(run_dir: Path, replica: int, member: int, event: str) -> list[dict]:
    return [r for r in member_log(run_dir, replica, member) if r.get("event") == event]


@pytest.mark.slow
def test_a_replica_joins_with_its_neighbours_shards_and_a_preempted_replica_leaves_whole(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # Every process waits at iteration 150 until replica 2 is admitted and at 300 until replica 1 has left
    # (tests/scripts/view_gated.py): a busy machine slows the joiners, not the run's outcome.
    # DiLoCo: a view begins at an outer step, and the joiner takes the outer optimizer's state too
    launcher = start_launch(["--nproc", "4", "--replica-size", "2", "--replica-mode", "fsdp", "--max-nproc", "6",
                             "--protocol", "diloco", "--local-steps", "8", "--run-dir", str(run_dir), VIEW_GATED,
                             "--view-gate", "150:joined=2",
                             "--view-gate", "300:left=1", "--iterations", "500", "--eval-every", "100000"])
    try:
        with joining(run_dir, 2) as joiner:
            wait_until(lambda: all(_events(run_dir, 2, m, "joined") for m in (0, 1)), 120,
                       what="replica 2 (ranks 4, 5) to join", while_running=launcher)
            # a preemption notice to member 1 of replica 1 alone: member 0 speaks for the replica, which leaves
            os.kill(recorded_worker_pids(run_dir)[3], signal.SIGTERM)
            out, err = launcher.communicate(timeout=180)
            joined_out, _ = joiner.communicate(timeout=60)
    finally:
        kill(launcher)
    assert launcher.returncode == 0, out + err
    assert joiner.returncode == 0, joined_out
    assert "view 1: replica 2 joined (3 replicas)" in err and "replica 1 left (2 replicas)" in err, err
    record = json.loads((run_dir / "launch.json").read_text())
    views = record["views"]
    assert views[0]["members"] == [0, 1] and views[-1]["members"] == [0, 2], views
    assert record["result"]["worker_returncodes"]["2"] == record["result"]["worker_returncodes"]["3"] == 0
    # both processes of replica 1 left after the same iteration, with the replica's line
    left = [_events(run_dir, 1, m, "left") for m in (0, 1)]
    assert all(left) and left[0][0]["iter"] == left[1][0]["iter"], left
    assert left[1][0]["line"].startswith("rank 3 (replica 1) left after iteration"), left
    # each lane of replica 2 took its shard from the same lane of one donor replica, at one iteration
    joined = [_events(run_dir, 2, m, "joined")[0] for m in (0, 1)]
    assert joined[0]["donor"] == joined[1]["donor"] in (0, 1) and joined[0]["iter"] == joined[1]["iter"], joined
    donor = joined[0]["donor"]
    sent = [[r for r in _events(run_dir, donor, m, "state_sent") if r["view"] == joined[m]["view"]] for m in (0, 1)]
    assert all(sent), sent
    assert [s[0]["fingerprint"] for s in sent] == [j["fingerprint"] for j in joined], (sent, joined)
    assert joined[0]["fingerprint"] != joined[1]["fingerprint"]  # (the lanes hold different shards)
    finals = {(replica, member): r["accuracy"] for replica in (0, 2) for member in (0, 1)
              for r in _events(run_dir, replica, member, "eval") if r.get("final")}
    assert set(finals) == {(0, 0), (0, 1), (2, 0), (2, 1)}, finals
    assert min(finals.values()) >= 0.95, finals


@pytest.mark.slow
def test_a_replica_whose_process_is_killed_leaves_the_views_and_the_others_finish_in_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launcher = start_launch(["--nproc", "6", "--replica-size", "2", "--min-nproc", "2", "--max-failures", "1",
                             "--protocol", "hop", "--backup-workers", "1", "--peer-timeout", "3",
                             "--run-dir", str(run_dir), "--no-progress", FINGERPRINTED,
                             "--example", "../tests/scripts/view_gated.py", "--view-gate", "150:died=1",
                             "--iterations", "250", "--eval-every", "100000"], new_session=True)
    try:
        wait_until(lambda: len(_events(run_dir, 1, 1, "iteration")) >= 30, 120, what="replica 1's iteration 30",
                   while_running=launcher)
        os.kill(recorded_worker_pids(run_dir)[3], signal.SIGKILL)
        out, err = launcher.communicate(timeout=180)
    finally:
        kill(launcher)
    assert launcher.returncode == 0, out + err
    assert "view 1: replica 1 died (2 replicas)" in err, err
    assert "lost ranks 2, 3" in err, err
    views = json.loads((run_dir / "launch.json").read_text())["views"]
    assert views[-1]["members"] == [0, 2] and views[-1]["died"] == [1], views
    for replica in (0, 2):
        entered = [_events(run_dir, replica, m, "view_entered") for m in (0, 1)]
        assert entered[0] and [e["iter"] for e in entered[0]] == [e["iter"] for e in entered[1]], entered
        # under ddp a replica's members hold one model at every step, across the view change
        digests = [{r["iter"]: r["digest"] for r in _events(run_dir, replica, m, "fingerprint")} for m in (0, 1)]
        assert digests[0] == digests[1] and 249 in digests[0], replica
        for member in (0, 1):
            assert _events(run_dir, replica, member, "stop")[-1]["iter"] == 249
    finals = [r["accuracy"] for replica in (0, 2) for r in _events(run_dir, replica, 0, "eval") if r.get("final")]
    assert len(finals) == 2 and min(finals) >= 0.9, finals


def test_a_join_into_a_run_of_replica_groups_brings_whole_replicas(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "launch.json").write_text(json.dumps({"rendezvous": "127.0.0.1:9", "replicas": {"size": 2,
                                                                                              "mode": "ddp"}}))
    done = subprocess.run([*JOIN, str(run_dir), "--nproc", "3"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "hopnet join: error: --nproc 3: the run's replica groups have 2 processes each, and a replica joins whole: "
        "give a multiple of 2")

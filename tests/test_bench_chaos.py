"""Smoke test of the fault-injection benches: one short bench/chaos.py trial and one churn trial
(bench/churn.py), through the same functions the bench runs (bench/dead_peers.py shares them,
bench/faults.py), so a change that breaks them shows. The launcher's handling of a stopped worker has its own tests
(test_silent_workers.py)."""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import pytest

from support.paths import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import chaos  # noqa: E402
import churn  # noqa: E402

SEED = 1
"""Its two churn events are a join and a leave (a seeded draw)."""


@pytest.mark.slow
def test_one_chaos_trial_names_the_victim_and_leaves_no_process(tmp_path: Path) -> None:
    args = argparse.Namespace(peer_timeout=2.0, timeout=20.0, compute_ms=10.0, iterations=600,
                              hang_after=60.0, start_timeout=90.0)
    trial = chaos.run_trial("hop", "SIGKILL", 2, random.Random(0), tmp_path / "run", args)
    assert trial.note == "" and not trial.hang and trial.orphans == 0
    assert trial.named and trial.lost_line  # "worker 2 lost ...", then "lost rank 2 ..."
    assert trial.exit == 0 and trial.ok  # hop with a backup worker and --max-failures 1 survives it


@pytest.mark.slow
def test_one_churn_trial_joins_and_leaves_without_a_hang_or_an_orphan(tmp_path: Path) -> None:
    args = argparse.Namespace(peer_timeout=3.0, timeout=20.0, compute_ms=10.0, churn_iterations=1000,
                              churn_events=2, hang_after=60.0, start_timeout=90.0)
    trial = churn.run_churn_trial("hop", random.Random(SEED), tmp_path / "run", args)
    assert trial.note == "" and sorted(e.split()[0] for e in trial.events) == ["join", "leave"], trial
    assert not trial.hang and trial.orphans == 0, trial
    assert trial.exit == 0 and trial.join_exits == [0], trial
    assert list(trial.leave_exits.values()) == [0], trial  # a leave is a SIGTERM the worker survives: exit 0
    assert trial.ok

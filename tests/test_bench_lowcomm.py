"""Smoke test of bench/lowcomm.py: one tiny row on one machine, through the functions the bench
runs, so a change that breaks its launch flags or its reading of the event logs shows. (The
capped two-host setting needs root and network namespaces; its launch is bench/multihost.py's.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from support.paths import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import lowcomm  # noqa: E402


@pytest.mark.slow
def test_one_local_steps_row_with_a_straggler_reports_its_time_and_accuracy(tmp_path: Path) -> None:
    flags = dict(lowcomm.CONFIGS)["hop H=10"]
    script = [lowcomm.DIGITS, "--iterations", "20", "--hidden", "16", "--eval-every", "10"]
    result = lowcomm.one_machine(tmp_path, "hop H=10", [*flags, *dict(lowcomm.STRAGGLERS)["rank 3 4x slower"]],
                                 script, target=0.2)
    assert result.codes == [0]
    assert result.accuracy is not None and result.accuracy > 0.2
    assert result.train_s is not None and result.time_to_target_s is not None
    assert 0 < result.time_to_target_s <= result.train_s
    assert result.link_bytes is None  # one machine: no link counted

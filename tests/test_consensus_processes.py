"""worker.consensus() in real processes, through `hopnet launch --save-model`, after a worker was
killed under --max-failures: every live rank ends with the same model, the lowest live rank
writes it to model.pt, and it loads and evaluates. (tests/test_train_cnn.py runs --save-model
under every protocol.)"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest
import torch

from support.launch import run_launch
from support.paths import WORKERS

WORKER = WORKERS / "consensus_worker.py"
CONSENSUS = re.compile(r"^\[rank (\d+)\] consensus of ranks \[([0-9, ]+)\] in (\d+) round\(s\): "
                       r"held-out accuracy ([0-9.]+) digest (\S+)$", re.MULTILINE)

pytestmark = pytest.mark.slow  # a launch of 4-5 workers importing torch and scikit-learn: 10 s or more


def worker_module() -> ModuleType:
    """The worker script's model, data and digest, to evaluate what it saved."""
    spec = importlib.util.spec_from_file_location("consensus_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_saved_model(run_dir: Path, stdout: str, members: list[int]) -> float:
    """Every member printed the same consensus; model.pt is that model. Its held-out accuracy."""
    lines = {int(rank): rest for rank, *rest in CONSENSUS.findall(stdout)}
    assert sorted(lines) == members, stdout
    assert {rest[0] for rest in lines.values()} == {", ".join(map(str, members))}, stdout
    assert len({rest[3] for rest in lines.values()}) == 1, stdout  # one model everywhere, buffers too
    worker = worker_module()
    state = torch.load(run_dir / "model.pt")
    model = worker.make_model()
    model.load_state_dict(state)
    _, _, x_test, y_test = worker.held_out()
    accuracy = worker.accuracy(model, x_test, y_test)
    _, _, printed, digest = lines[members[0]]
    assert worker.digest(state) == digest
    assert f"{accuracy:.4f}" == printed
    return accuracy


def test_the_consensus_completes_after_a_worker_was_killed(tmp_path: Path) -> None:
    """Rank 3 of a ring of 5 dies at iteration 5 (SIGKILL, no goodbye); with a backup worker
    the others train on, and only its neighbours' heartbeats find it dead."""
    run_dir = tmp_path / "run"
    proc = run_launch(["--graph", "ring:5", "--backup-workers", "1", "--max-failures", "1",
                       "--save-model", "--run-dir", str(run_dir), str(WORKER), "--iterations", "40",
                       "--compute-ms", "20", "--kill-rank", "3", "--kill-at", "5"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lost rank 3" in proc.stderr
    check_saved_model(run_dir, proc.stdout, [0, 1, 2, 4])

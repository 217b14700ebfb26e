"""Prague between real processes: `hopnet launch` starts the random Group Generator as a
process of its own, and a run fails promptly, naming it, when that process is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from support.paths import WORKERS
from support.launch import kill, recorded_worker_pids, run_launch, start_launch
from support.records import coordinator_records, records
from support.wait import wait_until

PRAGUE_WORKER = str(WORKERS / "prague_worker.py")
N = 4
ITERATIONS = 30
DIM = 256


def _launch_args(run_dir: Path, *extra: str, nproc: int = N) -> list[str]:
    return ["--protocol", "prague", "--group-generator", "random", "--nproc", str(nproc), "--run-dir", str(run_dir),
            *extra]


@pytest.fixture(scope="module")
def prague_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    run_dir = tmp_path_factory.mktemp("prague") / "run"
    result = run_launch(_launch_args(run_dir, PRAGUE_WORKER, "--iterations", str(ITERATIONS), "--dim", str(DIM)))
    return result, run_dir


@pytest.mark.slow
def test_prague_random_preserves_the_models_sum_and_pulls_them_together(prague_run) -> None:
    result, run_dir = prague_run
    assert result.returncode == 0, result.stderr
    before = [torch.randn(DIM, generator=torch.Generator().manual_seed(r), dtype=torch.float64) for r in range(N)]
    after = [torch.load(run_dir / f"final_rank{r}.pt") for r in range(N)]
    assert torch.allclose(sum(after), sum(before), rtol=0, atol=1e-9), "P-Reduce preserves the sum"
    spread_before = max((p - before[0]).abs().max().item() for p in before)
    spread_after = max((p - after[0]).abs().max().item() for p in after)
    assert spread_after < 1e-3 * spread_before, (spread_before, spread_after)
    for rank in range(N):
        groups = [r["group"] for r in records(run_dir, rank, "iteration")]
        assert len(groups) == ITERATIONS and all(rank in g and len(set(g)) == len(g) for g in groups)


@pytest.mark.slow
def test_the_launcher_runs_the_coordinator_and_it_logs_the_groups(prague_run) -> None:
    result, run_dir = prague_run
    assert result.returncode == 0, result.stderr
    assert "the coordinator (prague random group generator) at tcp://127.0.0.1:" in result.stderr
    launch_info = json.loads((run_dir / "launch.json").read_text())
    assert launch_info["coordinator"]["name"] == "prague random group generator"
    logged = coordinator_records(run_dir)
    assert logged[0]["event"] == "start" and logged[0]["address"] == launch_info["coordinator"]["address"]
    groups = [r for r in logged if r["event"] == "group"]
    assert len(groups) == N * ITERATIONS
    assert len({r["gid"] for r in groups}) == len(groups)
    stop = logged[-1]
    assert stop["event"] == "stop" and stop["workers_left"] == list(range(N)) and stop["workers_dead"] == []
    assert stop["groups"] == N * ITERATIONS and stop["acks"] + stop["dropped"].get("from_gone_worker", 0) >= \
        sum(len(r["members"]) for r in groups) - N * 2  # acks of the last groups may follow their bye


def _processes_of(run_dir: Path) -> list[int]:
    """Pids of live processes of this run: the workers and the coordinator launch.json lists,
    and any whose environment or command line names the run directory."""
    needle = str(run_dir).encode()
    workers = set(recorded_worker_pids(run_dir).values())
    workers.add(json.loads((run_dir / "launch.json").read_text())["coordinator"]["pid"])
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (int(entry.name) in workers or needle in (entry / "environ").read_bytes()
                    or needle in (entry / "cmdline").read_bytes()):
                state = (entry / "stat").read_text().split(")")[-1].split()[0]
                if state != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_killing_the_coordinator_fails_the_run_promptly_naming_it(tmp_path: Path) -> None:
    """Two workers (groups of 2) keep it cheap; both wait on the coordinator every iteration."""
    run_dir = tmp_path / "run"
    launcher = start_launch(_launch_args(run_dir, "--peer-timeout", "2", "--timeout", "120", "--group-size", "2",
                                         PRAGUE_WORKER, "--iterations", "100000", "--compute-ms", "5", nproc=2),
                            new_session=True)
    try:
        wait_until(lambda: len(coordinator_records(run_dir, "group")) >= 40, 120, interval=0.2,  # training through it
                   what="the workers to form 40 groups", while_running=launcher)
        pid = coordinator_records(run_dir)[0]["pid"]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = launcher.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        kill(launcher)
    assert launcher.returncode == 1, stderr
    assert took < 30, took  # --peer-timeout 2 and the launcher's settle; the --timeout of 120 s never ran out
    assert "hopnet launch: the coordinator (prague random group generator) at tcp://127.0.0.1:" in stderr
    assert "died (killed by SIGKILL)" in stderr
    errors = [r for rank in range(2) for r in records(run_dir, rank, "error")]
    named = [e for e in errors if "the coordinator (prague random group generator) at tcp://" in e["message"]
             and "stopped answering" in e["message"]]
    assert named and all(e["error"] == "CoordinatorLost" and e["peer_state"] == "dead" for e in named), errors
    launch_info = json.loads((run_dir / "launch.json").read_text())
    assert launch_info["result"]["returncode"] == 1
    assert all(code != 0 for code in launch_info["result"]["worker_returncodes"].values())
    assert _processes_of(run_dir) == []

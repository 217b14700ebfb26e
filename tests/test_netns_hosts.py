"""Two emulated hosts (network namespaces on a bridge, each its own IP and its own launcher).

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from contextlib import suppress
from pathlib import Path

import pytest

from support.env import clean_env
from support.launch import LAUNCH, worker_pids
from support.records import consensus_error, records
from support.wait import WaitTimedOut, wait_until

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from netns_hosts import NamespacedHosts, unavailable_reason  # noqa: E402

DIGITS = str(REPO / "examples" / "train_digits.py")
HOP_WORKER = str(REPO / "tests" / "workers" / "hop_worker.py")
ACCURACY = re.compile(r"final held-out accuracy ([0-9.]+)")
WHY_NOT = unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=f"no emulated hosts: {WHY_NOT}")]


@pytest.fixture(scope="module")
def hosts():
    with NamespacedHosts(2) as made:
        yield made


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hopnet.security import CurveKeys, write_key_file

    return write_key_file(tmp_path_factory.mktemp("key") / "run.key", CurveKeys.generate())


def _run_all(cmds: list[list[str]], cwd: Path, timeout: float = 240,
             during=None, **variables: str) -> list[tuple[int, str]]:
    env = clean_env(PYTHONUNBUFFERED="1", **variables)
    procs = [subprocess.Popen(c, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for c in cmds]
    try:
        if during is not None:
            during()
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
    return [(p.returncode, o) for p, o in zip(procs, outs)]


def _launch(hosts: NamespacedHosts, node: int, port: int, run_dir: Path, flags: list[str], script: list[str],
            key_file: Path) -> list[str]:
    return hosts.command(node, [*LAUNCH, "--nnodes", "2",
                                "--key-file", str(key_file),
                                "--node-rank", str(node), "--rdzv-endpoint", f"{hosts.addresses[0]}:{port}",
                                "--bind", hosts.addresses[node], "--no-progress", "--run-dir", str(run_dir),
                                *flags, *script])


def test_digits_on_two_hosts_under_hopnet_launch(hosts: NamespacedHosts, key_file: Path, tmp_path: Path) -> None:
    script = [DIGITS, "--iterations", "200", "--eval-every", "1000"]
    results = _run_all([_launch(hosts, n, 29811, tmp_path / f"node{n}", ["--graph", "ring:4"], script,
                                key_file) for n in (0, 1)], tmp_path)
    assert [rc for rc, _ in results] == [0, 0], "\n".join(o[-2000:] for _, o in results)
    accuracies = [float(a) for _, out in results for a in ACCURACY.findall(out)]
    assert len(accuracies) == 4 and min(accuracies) >= 0.95, accuracies
    info = json.loads((tmp_path / "node1" / "launch.json").read_text())
    assert info["store"] == f"{hosts.addresses[0]}:29811" and info["security"] == "curve"


def test_digits_on_two_hosts_under_torchrun(hosts: NamespacedHosts, tmp_path: Path) -> None:
    """torchrun's c10d rendezvous over two hosts of two processes: every rank learns, the ranks end
    agreeing, and the run directory (one here: the hosts share a file system) holds the graph and a
    log per rank, numbered as torchrun numbered the processes."""
    run_dir = tmp_path / "run"
    endpoint = f"{hosts.addresses[0]}:29812"
    cmds = []
    for node in (0, 1):
        cmds.append(hosts.command(node, [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
            "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--local-addr", hosts.addresses[node],  # both namespaces share one host name
            "--rdzv-conf", f"is_host={int(node == 0)}",  # torchrun cannot tell the address is its own
            DIGITS, "--iterations", "200", "--eval-every", "1000"]))
    results = _run_all(cmds, tmp_path, HOPNET_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1")
    assert [rc for rc, _ in results] == [0, 0], "\n".join(o[-2000:] for _, o in results)
    accuracies = [float(a) for _, out in results for a in ACCURACY.findall(out)]
    assert len(accuracies) == 4 and min(accuracies) >= 0.95, accuracies
    assert consensus_error(run_dir, 4) < 1e-3
    assert (run_dir / "graph.json").exists()
    starts = [records(run_dir, r)[0] for r in range(4)]
    assert [s["rank"] for s in starts] == [0, 1, 2, 3] and all(s["event"] == "start" for s in starts)


def test_killing_one_hosts_workers_lets_the_other_host_finish(hosts: NamespacedHosts, key_file: Path,
                                                             tmp_path: Path) -> None:
    flags = ["--graph", "complete:4", "--backup-workers", "2", "--max-failures", "2"]
    script = [HOP_WORKER, "--iterations", "150", "--compute-ms", "20"]
    victim_dir = tmp_path / "node1"

    def kill_host_1() -> None:
        log = victim_dir / "rank2.jsonl"
        with suppress(WaitTimedOut):  # then it is killed where it is
            wait_until(lambda: log.exists() and len(re.findall(r'"event": ?"iteration"', log.read_text())) >= 10, 120,
                       interval=0.2, what="rank 2's iteration 10")
        pids = worker_pids(victim_dir, 2)
        for rank in (2, 3):
            os.kill(pids[rank], signal.SIGKILL)

    results = _run_all([_launch(hosts, n, 29813, tmp_path / f"node{n}", flags, script, key_file) for n in (0, 1)],
                       tmp_path, during=kill_host_1)
    (rc0, out0), (rc1, out1) = results
    assert rc0 == 0, out0[-3000:]
    assert sorted(re.findall(r"^\[rank (\d)\] done at iteration 149", out0, re.M)) == ["0", "1"], out0[-3000:]
    assert "lost ranks 2, 3" in out1, out1[-3000:]


def _stop_records(run_dirs: list[Path]) -> dict[int, dict]:
    from hopnet.runtime.events import read_events

    stops = {}
    for run_dir in run_dirs:
        for log in run_dir.glob("rank*.jsonl"):
            stop = [r for r in read_events(log) if r.get("event") == "stop"]
            if stop:
                stops[stop[-1]["rank"]] = stop[-1]
    return stops


def test_a_capped_link_does_not_hold_back_hop_with_backup_workers(hosts: NamespacedHosts, key_file: Path,
                                                                  tmp_path: Path) -> None:
    """Across a 2 mbit link, each worker's remote out-neighbour gets only its newest update
    whenever the link frees: the workers run every iteration without waiting for the link
    (each needs one in-neighbour's update, its own host's), and still converge."""
    iterations = 60
    flags = ["--graph", "ring:4", "--backup-workers", "1", "--staleness", "4", "--max-ig", "16"]
    script = [DIGITS, "--iterations", str(iterations), "--hidden", "512", "--eval-every", "100000"]
    hosts.cap(1, "2mbit")
    try:
        results = _run_all([_launch(hosts, n, 29814, tmp_path / f"node{n}", flags, script, key_file)
                            for n in (0, 1)], tmp_path)
    finally:
        hosts.uncap(1)
    assert [rc for rc, _ in results] == [0, 0], "\n".join(o[-2000:] for _, o in results)
    stops = _stop_records([tmp_path / "node0", tmp_path / "node1"])
    assert sorted(stops) == [0, 1, 2, 3]
    # A 154 KB update takes 0.6 s on this link: far fewer than half of each worker's updates
    # to its remote neighbour crossed, the rest were replaced by newer ones before leaving.
    superseded = {rank: stop["dropped"].get("superseded", 0) for rank, stop in stops.items()}
    assert all(n >= iterations // 2 for n in superseded.values()), superseded
    assert all(stop["iter"] == iterations - 1 for stop in stops.values()), stops
    accuracies = [float(a) for _, out in results for a in ACCURACY.findall(out)]
    assert len(accuracies) == 4 and min(accuracies) >= 0.9, accuracies

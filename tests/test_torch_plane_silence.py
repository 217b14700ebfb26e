"""A silent peer on the torch plane (`--bulk torch`): named within --peer-timeout, not --timeout.

A SIGSTOPped worker keeps its connections open, so no TCP reset tells anyone: from its
neighbours' side it is a host cut off. gloo's ops on it would wait out --timeout (120 s here);
the heartbeats over ZeroMQ name it within --peer-timeout (3 s) plus at most one beat interval,
and every torch-plane wait on it ends then. The cluster tests start the workers without
`hopnet launch` (whose death watch would kill a stopped worker after --peer-timeout, closing its
connections): what the survivors do, they do on their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hopnet import Graph, ProtocolConfig
from hopnet.analysis import load_run
from hopnet.rendezvous.store import host_store

from support.cluster import Cluster
from support.env import clean_env
from support.launch import LAUNCH, recorded_worker_pids, start_launch, worker_pids
from support.paths import ROOT as REPO, WORKERS
from support.records import records
from support.wait import wait_until

pytestmark = pytest.mark.slow

PEER_TIMEOUT_S = 3.0
TIMEOUT_S = 120.0
NAMED_WITHIN_S = PEER_TIMEOUT_S + 2.0  # the bound
EXIT_WITHIN_S = 40.0  # far below --timeout: only a hang (the old wait for --timeout) reaches it


@pytest.fixture
def store_endpoint() -> Iterator[str]:
    hosted = host_store("127.0.0.1")
    yield hosted.endpoint
    hosted.close()


def _peer_dead(run_dir: Path, rank: int, peer: int) -> dict:
    (dead,) = [r for r in load_run(run_dir)[rank] if r["event"] == "peer_dead" and r["peer"] == peer]
    return dead


def test_an_all_reduce_over_gloo_fails_naming_a_member_that_went_silent(tmp_path: Path, store_endpoint: str) -> None:
    """--protocol allreduce --bulk torch: the gradients are all-reduced by gloo. Rank 2 is stopped
    in the middle of the run; ranks 0 and 1, waiting inside gloo for the round it will never join,
    give the round up once their heartbeats declare rank 2 dead, and fail naming the group and it."""
    config = ProtocolConfig("allreduce", bulk="torch", timeout_s=TIMEOUT_S, peer_timeout_s=PEER_TIMEOUT_S)
    with Cluster(Graph.ring(3), config, tmp_path / "run",
                 ["--iterations", "1000000", "--compute-ms", "5", "--gradients"], store=store_endpoint) as c:
        c.wait_for_iteration(2, 20)
        c.signal(2, signal.SIGSTOP)
        stopped = time.monotonic()
        assert c.wait([0, 1], timeout_s=EXIT_WITHIN_S) == {0: 1, 1: 1}, c.report()
        for rank in (0, 1):
            dead = _peer_dead(c.run_dir, rank, 2)
            assert "cause" not in dead and dead["silent_s"] >= PEER_TIMEOUT_S, dead  # the heartbeats' news
            assert dead["mono"] - stopped <= NAMED_WITHIN_S, dead
            failure = c.failure(rank)
            assert (failure["error"], failure["peer"], failure["peer_state"]) == ("PeerFailure", 2, "dead"), failure
            assert "of group [0, 1, 2]: rank 2 went silent for" in failure["message"], failure


def test_a_stopped_worker_on_the_torch_plane_is_named_by_its_neighbours_and_the_launcher_exits(
        tmp_path: Path) -> None:
    """Hop over `hopnet launch --bulk torch`, rank 1 of 3 stopped: its neighbours declare it dead from
    its silence (before, they learned only once the launcher had killed it for being stopped, and
    then only after a 2 s grace for a goodbye), fail naming it, and the launcher exits 1."""
    run_dir = tmp_path / "run"
    proc = start_launch(["--nproc", "3", "--bulk", "torch", "--peer-timeout", str(PEER_TIMEOUT_S), "--timeout",
                         str(TIMEOUT_S), "--no-progress", "--run-dir", str(run_dir), str(WORKERS / "hop_worker.py"),
                         "--dim", "1000", "--compute-ms", "5", "--iterations", "1000000"], new_session=True)
    try:
        wait_until(lambda: all(any(r.get("iter", -1) >= 20 for r in records(run_dir, rank, "enter"))
                               for rank in range(3)),
                   120, interval=0.1, what="ranks 0, 1, 2 to enter iteration 20", while_running=proc)
        os.kill(worker_pids(run_dir, 3)[1], signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            _, err = proc.communicate(timeout=EXIT_WITHIN_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the launcher did not exit within {EXIT_WITHIN_S}s of the stop") from None
    finally:
        for pid in recorded_worker_pids(run_dir).values():
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        proc.kill()
        proc.wait()
    assert proc.returncode == 1, err
    assert json.loads((run_dir / "launch.json").read_text())["result"]["failed_rank"] == 1, err
    messages = {}
    for rank in (0, 2):
        dead = _peer_dead(run_dir, rank, 1)
        assert "cause" not in dead and dead["silent_s"] >= PEER_TIMEOUT_S, dead
        assert dead["mono"] - stopped <= NAMED_WITHIN_S, dead
        (error,) = [r for r in load_run(run_dir)[rank] if r["event"] == "error"]
        messages[rank] = error["message"]
    # The first to notice fails naming rank 1; the other may fail first on that one's goodbye (it left
    # before its last iteration), the news that comes at once, before its own watch names rank 1.
    first = [rank for rank, message in messages.items() if "peer 1 went silent" in message]
    assert first, messages
    for rank in set(messages) - set(first):
        assert f"peer {2 - rank} left at iteration" in messages[rank], messages


def test_a_link_cut_for_good_is_named_by_the_ranks_at_its_ends_within_the_peer_timeout(tmp_path: Path) -> None:
    """Two emulated hosts joined by the user-space forwarder (bench/netem/forwarder.py), 2 workers
    each on ring:4, Hop over `--bulk torch`; the link is then cut both ways for good. No packet
    crosses, no reset comes: each rank whose neighbour is across the cut declares it dead from its
    silence, within --peer-timeout + 2 s (gloo alone would wait --timeout). Both launchers then
    name the link, not a crash, and exit 1 by themselves (a non-tolerant run stops)."""
    sys.path.insert(0, str(REPO / "bench"))
    from netem.forwarder import Faults, ForwardedLink, unavailable_reason

    why_not = unavailable_reason()
    if why_not is not None:
        pytest.skip(f"no emulated hosts: {why_not}")
    across = {0: 3, 1: 2, 2: 1, 3: 0}  # ring:4, ranks 0 and 1 on host a, 2 and 3 on host b
    run_dirs = {"a": tmp_path / "a", "b": tmp_path / "b"}
    with ForwardedLink(seed=5) as link:
        procs = []
        try:
            for node, host in enumerate(("a", "b")):
                argv = [*LAUNCH, "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint",
                        f"{link.addresses['a']}:29831", "--bind", link.addresses[host], "--insecure", "--graph", "ring:4",
                        "--bulk", "torch", "--peer-timeout", str(PEER_TIMEOUT_S), "--timeout", str(TIMEOUT_S),
                        "--no-progress", "--run-dir", str(run_dirs[host]), str(WORKERS / "hop_worker.py"),
                        "--dim", "1000", "--compute-ms", "5", "--iterations", "1000000"]
                with open(tmp_path / f"launch-{host}.txt", "wb") as out:
                    procs.append(subprocess.Popen(link.command(host, argv), env=clean_env(PYTHONUNBUFFERED="1"),
                                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
            home = {0: "a", 1: "a", 2: "b", 3: "b"}
            wait_until(lambda: all(any(r.get("iter", -1) >= 5 for r in records(run_dirs[home[rank]], rank, "enter"))
                                   for rank in range(4)),
                       120, interval=0.2, what="ranks 0-3 to enter iteration 5", while_running=procs)
            link.set_faults(a_to_b=Faults(cut=True), b_to_a=Faults(cut=True))
            cut = time.monotonic()

            def declared() -> dict[int, dict]:
                found = {}
                for rank, peer in across.items():
                    dead = [r for r in records(run_dirs[home[rank]], rank, "peer_dead") if r["peer"] == peer]
                    if dead:
                        found[rank] = dead[0]
                return found if len(found) == 4 else {}

            found = wait_until(declared, NAMED_WITHIN_S + 10, interval=0.2,
                               what="each rank at the cut to declare its neighbour across it dead")
            codes = [proc.wait(timeout=60) for proc in procs]
        finally:
            workers = [pid for run_dir in run_dirs.values() for pid in recorded_worker_pids(run_dir).values()]
            for pid in [proc.pid for proc in procs] + workers:  # each worker leads a process group of its own
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
            for proc in procs:
                proc.wait()
    for rank, dead in found.items():
        assert "cause" not in dead and dead["silent_s"] >= PEER_TIMEOUT_S, (rank, dead)
        assert dead["mono"] - cut <= NAMED_WITHIN_S, (rank, dead)
    outputs = [(tmp_path / f"launch-{host}.txt").read_text(errors="replace") for host in ("a", "b")]
    assert codes == [1, 1], outputs
    for output in outputs:
        assert "the link between node 0 (ranks 0, 1) and node 1 (ranks 2, 3) is down" in output, output[-3000:]
        assert "died (" not in output and "killed by" not in output, output[-3000:]

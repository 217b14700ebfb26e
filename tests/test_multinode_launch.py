"""`hopnet launch --nnodes 2`: two launchers on loopback, as two machines would run them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hopnet.errors import ConfigError
from hopnet.graph import Graph
from hopnet.launch.nodes import place_ranks

from support.env import clean_env
from support.launch import kill, start_launch
from support.ports import free_port

REPO = Path(__file__).resolve().parent.parent
HOP_WORKER = str(REPO / "tests" / "workers" / "hop_worker.py")


# --------------------------------------------------------------------------- placement
def test_placement_follows_machine_labels() -> None:
    g = Graph(4, Graph.ring(4).edges, machines=["a", "b", "a", "b"])
    assert [place_ranks(g, 2, r) for r in (0, 1)] == [[0, 2], [1, 3]]
    with pytest.raises(ConfigError, match="2 machines .* but --nnodes is 3"):
        place_ranks(g, 3, 0)


def test_placement_without_labels_is_contiguous_blocks() -> None:
    assert [place_ranks(Graph.ring(5), 2, r) for r in (0, 1)] == [[0, 1, 2], [3, 4]]
    with pytest.raises(ConfigError, match="--node-rank must be from 0 to 1"):
        place_ranks(Graph.ring(4), 2, 2)


def test_nnodes_without_rdzv_endpoint_is_refused_before_anything_starts(tmp_path: Path) -> None:
    from hopnet.launch.launcher import launch

    with pytest.raises(ConfigError, match="--nnodes above 1 needs --rdzv-endpoint HOST:PORT"):
        launch(HOP_WORKER, graph="ring:4", nnodes=2, node_rank=1, run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_node_1_refuses_at_once_what_node_0_would_refuse(tmp_path: Path) -> None:
    """Off loopback without --key-file: refused before waiting for node 0 (which is not there)."""
    from hopnet.launch.launcher import launch

    with pytest.raises(ConfigError, match="several machines with CurveZMQ need the same --key-file"):
        launch(HOP_WORKER, graph="ring:4", nnodes=2, node_rank=1, bind="0.0.0.0",
               rdzv_endpoint=f"127.0.0.1:{free_port()}", run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_node_1_says_what_it_waits_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from hopnet.errors import HopnetError
    from hopnet.launch import prepare
    from hopnet.launch.launcher import launch

    monkeypatch.setattr(prepare, "JOIN_TIMEOUT_S", 1.0)
    endpoint = f"127.0.0.1:{free_port()}"  # nobody: node 0's launcher never comes
    err = io.StringIO()
    with pytest.raises(HopnetError, match="unreachable after 1s"):
        launch(HOP_WORKER, graph="ring:4", nnodes=2, node_rank=1, insecure=True, rdzv_endpoint=endpoint,
               run_dir=tmp_path / "r", stderr=err)
    assert err.getvalue().splitlines()[0] == (
        f"hopnet launch: waiting for node 0's launcher at {endpoint} to publish the run "
        "(node 1 of 2 machines; node 0 hosts the rendezvous)")
    assert not (tmp_path / "r").exists()


# --------------------------------------------------------------------------- two launchers

def _two_launchers(tmp_path: Path, graph: str, extra: list[str], worker_args: list[str]) -> list[tuple[int, str, str]]:
    port = free_port()
    procs = []
    try:
        for node in (0, 1):
            args = ["--graph", graph, "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}",
                    "--no-progress", "--run-dir", str(tmp_path / f"node{node}"), *extra, HOP_WORKER, *worker_args]
            procs.append(start_launch(args, env=clean_env(PYTHONUNBUFFERED="1"), new_session=True))
        outputs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            kill(p)
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]


@pytest.mark.slow
def test_two_launchers_place_by_machine_labels_and_a_failure_stops_both(tmp_path: Path) -> None:
    """One run serves both: the ranks meet across the launchers (they train until rank 3 leaves
    in iteration 5), and rank 3's failure on node 1 stops node 0's workers too."""
    graph = tmp_path / "g.json"
    Graph(4, Graph.ring(4).edges, machines=["a", "b", "a", "b"]).to_json(graph)
    (rc0, out0, err0), (rc1, _, err1) = _two_launchers(
        tmp_path, str(graph), [], ["--iterations", "100000", "--compute-ms", "20", "--exit-rank", "3", "--fail-at", "5"])
    assert rc0 == 1 and rc1 == 1, err0[-2000:] + err1[-2000:]
    info = [json.loads((tmp_path / f"node{n}" / "launch.json").read_text()) for n in (0, 1)]
    assert [i["ranks"] for i in info] == [[0, 2], [1, 3]] and info[1]["nnodes"] == 2
    assert info[1]["store"] == info[0]["store"] and info[1]["store"].startswith("127.0.0.1:")
    for rank in (0, 1, 2):  # every rank got through iterations 0-4 with its neighbours on the other launcher
        log = (tmp_path / f"node{rank % 2}" / f"rank{rank}.jsonl").read_text()
        assert max(json.loads(line).get("iter", -1) for line in log.splitlines()
                   if '"iteration"' in line) >= 4, rank
    root = r"worker 3 failed \(exit code 3\).*\[rank 3 runs on 127\.0\.0\.1, node 1\]"
    assert re.search("stopping: " + root, err0), err0[-2000:]  # node 0 names the other machine's rank
    assert re.search(root, err1), err1[-2000:]

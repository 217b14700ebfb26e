"""Hop over ZeroMQ between real processes, started by `hopnet launch`."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
import torch

from hopnet import Graph, ProtocolConfig
from hopnet.analysis import gap_bound, load_run, max_gap_from_run

from support.paths import WORKERS
from support.cluster import close_workers, start_workers, train
from support.launch import kill, start_launch
from support.wait import wait_until

HOP_WORKER = str(WORKERS / "hop_worker.py")
BULK = pytest.mark.parametrize("bulk", ["zmq", "torch"])  # Hop runs unchanged over either plane


def _tensors(run_dir: Path, prefix: str, n: int) -> list[torch.Tensor]:
    return [torch.load(run_dir / f"{prefix}_rank{r}.pt") for r in range(n)]


# Both planes on the ring; ring_based over the torch plane (its 6 ranks once caught the pair groups
# deadlocking in the store). ring_based and the torus over ZeroMQ run in one process below.
@pytest.mark.slow
@pytest.mark.parametrize("graph,n,bulk", [("ring:4", 4, "zmq"), ("ring:4", 4, "torch"), ("ring_based:6", 6, "torch")])
def test_zero_gradient_hop_averages_to_the_mean(launch, tmp_path: Path, graph: str, n: int, bulk: str) -> None:
    """W is doubly stochastic on these graphs, so gossip alone reaches the initial average."""
    run_dir = tmp_path / "run"
    result = launch(["--graph", graph, "--bulk", bulk, "--run-dir", str(run_dir), HOP_WORKER,
                     "--iterations", "80", "--compute-ms", "1"])
    assert result.returncode == 0, result.stderr
    initial = torch.stack(_tensors(run_dir, "initial", n))
    final = torch.stack(_tensors(run_dir, "final", n))
    mean = initial.mean(dim=0)
    assert (initial - mean).abs().max() > 1.0  # the workers really started apart
    assert (final - mean).abs().max() < 1e-6


# torus:2x3 also streams its updates: 8000 bytes in two chunks (4 KiB and the rest), each its own ZeroMQ message.
@pytest.mark.parametrize("graph,stream_mib", [("ring_based:6", 16.0), ("torus:2x3", 4 / 1024)])
async def test_zero_gradient_hop_over_zeromq_in_one_process_averages_to_the_mean(graph: str,
                                                                                 stream_mib: float) -> None:
    """The same, with the workers on this process's loop over real ZeroMQ sockets."""
    g = Graph.by_name(graph)
    initial = [torch.randn(1000, generator=torch.Generator().manual_seed(1234 + r), dtype=torch.float64)
               for r in range(g.n)]
    params = [p.clone() for p in initial]
    workers = await start_workers(g, ProtocolConfig(timeout_s=60.0, stream_mib=stream_mib),
                                  params=lambda rank: params[rank])
    try:
        await asyncio.wait_for(asyncio.gather(*(train(w, 80) for w in workers)), 120)
    finally:
        await close_workers(workers)
    mean = torch.stack(initial).mean(dim=0)
    assert (torch.stack(initial) - mean).abs().max() > 1.0  # the workers really started apart
    assert (torch.stack(params) - mean).abs().max() < 1e-6


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (one per rank, for NCCL)")
@pytest.mark.parametrize("bulk", ["torch", "auto"])
def test_hop_on_gpus_averages_over_nccl(launch, tmp_path: Path, bulk: str) -> None:
    n = min(4, torch.cuda.device_count())
    run_dir = tmp_path / "run"
    result = launch(["--graph", f"ring:{n}", "--bulk", bulk, "--run-dir", str(run_dir), HOP_WORKER,
                     "--iterations", "80", "--compute-ms", "1", "--device", "cuda"])
    assert result.returncode == 0, result.stderr
    initial = torch.stack(_tensors(run_dir, "initial", n))
    final = torch.stack(_tensors(run_dir, "final", n))
    assert (final - initial.mean(dim=0)).abs().max() < 1e-6


def test_a_cuda_model_over_zmq_is_refused_in_one_line() -> None:
    from hopnet.errors import ConfigError
    from hopnet.bootstrap.plane import make_transport

    with pytest.raises(ConfigError, match="--bulk zmq moves CPU tensors only"):
        make_transport(rank=0, peers=frozenset({1}), bind_host="127.0.0.1", bulk="zmq",
                       device=torch.device("cuda", 0), store_endpoint="", timeout_s=5)


@pytest.mark.slow
def test_iteration_gap_and_queue_bounds_with_uneven_workers(launch, tmp_path: Path) -> None:
    """Theorem 2: Iter(i) - Iter(j) <= min(len(j->i), max_ig * len(i->j)); queues <= (1+max_ig)|N_in|."""
    run_dir = tmp_path / "run"
    max_ig = 2
    result = launch(["--graph", "ring:5", "--max-ig", str(max_ig), "--slowdown", "rank=0:6",
                     "--slowdown", "random:3:0.2", "--run-dir", str(run_dir), HOP_WORKER,
                     "--iterations", "60", "--compute-ms", "3", "--dim", "100"])
    assert result.returncode == 0, result.stderr
    graph = Graph.ring(5)
    events = load_run(run_dir)
    observed = max_gap_from_run(events, graph.n)
    bound = gap_bound(graph, ProtocolConfig(max_ig=max_ig))
    assert (observed <= bound).all(), f"observed gaps\n{observed}\nexceed Table 1 bounds\n{bound}"
    assert observed.max() >= 1  # the slow worker really held the others back
    for rank, records in events.items():
        stop = next(rec for rec in records if rec["event"] == "stop")
        assert stop["queue_high_water"] <= (1 + max_ig) * len(graph.in_peers(rank))
    slowed = [rec for rec in events[0] if rec["event"] == "iteration" and rec.get("slowdown")]
    assert len(slowed) >= 59 and all(rec["slowdown"] >= 6 for rec in slowed)  # visible in the log


@pytest.mark.slow
@BULK
def test_backup_workers_keep_training_after_a_worker_leaves(launch, tmp_path: Path, bulk: str) -> None:
    run_dir = tmp_path / "run"
    result = launch(["--graph", "ring_based:6", "--backup-workers", "1", "--bulk", bulk, "--run-dir", str(run_dir),
                     HOP_WORKER, "--iterations", "60", "--stop-rank", "2", "--stop-at", "10"])
    assert result.returncode == 0, result.stderr
    events = load_run(run_dir)
    for rank, records in events.items():
        last = max(rec["iter"] for rec in records if rec["event"] == "iteration")
        assert last == (9 if rank == 2 else 59), (rank, last)
    graph = Graph.ring_based(6)
    for rank in graph.peers(2):
        first_left = next(rec for rec in events[rank] if rec["event"] == "peer_left")
        assert (first_left["peer"], first_left["last_iter"]) == (2, 10)


@pytest.mark.slow
@BULK
def test_without_backup_workers_a_departure_is_a_named_error(launch, tmp_path: Path, bulk: str) -> None:
    result = launch(["--graph", "ring:4", "--bulk", bulk, "--run-dir", str(tmp_path / "run"), HOP_WORKER,
                     "--iterations", "40", "--stop-rank", "2", "--stop-at", "5"])
    assert result.returncode != 0
    # Its neighbours (1 and 3) need its update of iteration 6; whichever fails first names it.
    assert re.search(r"\[rank [13]\] hopnet: PeerFailure: rank [13] cannot finish iteration 6: peer 2 "
                     r"left at iteration 5, before its last iteration 39", result.stderr), result.stderr


@pytest.mark.slow
def test_malformed_frames_are_dropped_and_counted_while_training(launch, tmp_path: Path) -> None:
    """A rogue peer floods rank 0's socket with garbage during training; training completes."""
    import zmq

    from hopnet.transports.zmq import routing_id, zmq_endpoint
    from hopnet.wire import Message, encode_header

    run_dir = tmp_path / "run"
    proc = start_launch(["--graph", "ring:4", "--run-dir", str(run_dir), HOP_WORKER, "--iterations", "150",
                         "--compute-ms", "10", "--dim", "64"])
    try:
        log = run_dir / "rank0.jsonl"

        def address_once_training() -> str | None:
            recs = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
            if any(rec["event"] == "iteration" for rec in recs):
                return next(rec["address"] for rec in recs if rec["event"] == "start")
            return None
        address = wait_until(address_once_training, 60, what="rank 0 to start training",
                             tolerate=(json.JSONDecodeError,))  # a line still being written
        ctx = zmq.Context()
        rogue = ctx.socket(zmq.DEALER)
        # Rank 2 is not a neighbour of rank 0 on ring:4 (a connection claiming a connected
        # neighbour's identity would take that neighbour's connection over: ROUTER_HANDOVER).
        rogue.setsockopt(zmq.ROUTING_ID, routing_id(2))
        rogue.setsockopt(zmq.LINGER, 2000)  # deliver everything before closing
        rogue.connect(zmq_endpoint(address))
        bad_shape = encode_header(Message("update", 1, 0, 5, tensors=[torch.zeros(64, dtype=torch.float64)]))
        garbage = [
            [b"\xc1\xff not msgpack"],
            [json.dumps({"k": "update"}).encode()],
            [encode_header(Message("update", 1, 0, 5, tensors=[torch.zeros(64, dtype=torch.float64)]))],
            [bad_shape, b"\x00" * 12],
            [encode_header(Message("update", 2, 0, 5))],
            [encode_header(Message("token", 1, 0, 5, meta={"c": 1}))],
        ]
        for _ in range(20):
            for frames in garbage:
                rogue.send_multipart(frames)
        rogue.close()
        ctx.term()
        out, err = proc.communicate(timeout=120)
    finally:
        kill(proc)
    assert proc.returncode == 0, err
    stop = next(rec for rec in load_run(run_dir)[0] if rec["event"] == "stop")
    assert stop["iter"] == 149
    assert sum(stop["dropped"].values()) >= 100, stop["dropped"]
    assert "bad_header" in stop["dropped"] or "truncated" in stop["dropped"]


@pytest.mark.slow
@BULK
def test_zero_copy_sends_to_a_finished_neighbour_do_not_stall(launch, tmp_path: Path, bulk: str) -> None:
    """With backup workers the fast workers finish first; the straggler's last zero-copy
    updates to them must be released when they leave, not wait out the send timeout
    (over torch: its sends to a neighbour that closed its channel count as peer_left)."""
    run_dir = tmp_path / "run"
    result = launch(["--graph", "ring:3", "--backup-workers", "1", "--slowdown", "rank=0:4", "--bulk", bulk,
                     "--run-dir", str(run_dir), HOP_WORKER, "--iterations", "20",
                     "--compute-ms", "20", "--dim", "20000"])  # 160 KB: the zero-copy path
    assert result.returncode == 0, result.stderr
    for rank, records in load_run(run_dir).items():
        stop = next(rec for rec in records if rec["event"] == "stop")
        assert "send_timeout" not in stop["dropped"], (rank, stop["dropped"])

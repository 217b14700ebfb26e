"""The per-step timings of the iteration records: exact in virtual time, and in real time
adding up to the time between the ends of consecutive steps."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from hopnet import AsyncWorker, Graph, ProtocolConfig
from hopnet.report.rundir import RunData
from hopnet.report.stats import run_stats
from hopnet.runtime.events import EventLog
from hopnet.sim.engine import ComputeModel, SimSpec, simulate
from hopnet.transports.inproc import InprocNetwork

PARTS = ("compute_s", "wait_updates_s", "wait_tokens_s", "mix_s")


def test_simulated_straggler_gives_exact_waits_to_the_others() -> None:
    """ring:4, 10 ms compute, rank 0 three times slower, 20 iterations, parallel approach.
    Rank 0 sends its update of k on entering k, at 0.03k; its neighbours 1 and 3 finish k
    exactly then (k >= 1), so by 0.57 s they computed 0.2 s and waited 0.37 s. Rank 2 needs
    1's and 3's update of k, sent at 0.03(k-1): it finishes at 0.54 s, having waited 0.34 s."""
    graph, config = Graph.ring(4), ProtocolConfig(slowdown=["rank=0:3"])
    result = simulate(SimSpec(graph, config, 20, ComputeModel.parse("10"), keep_events=True))
    assert result.events is not None
    run = RunData(Path("sim"), dict(enumerate(result.events)), graph, config)
    stats = run_stats(run)
    expected = {0: (0.6, 0.0), 1: (0.2, 0.37), 2: (0.2, 0.34), 3: (0.2, 0.37)}
    for rank, (compute, wait) in expected.items():
        s = stats.ranks[rank]
        assert s.time_s["compute_s"] == pytest.approx(compute, abs=1e-9)
        assert s.time_s["wait_updates_s"] == pytest.approx(wait, abs=1e-9)
        assert s.time_s["wait_tokens_s"] == 0.0 and s.time_s["mix_s"] == pytest.approx(0.0, abs=1e-9)
        assert s.iterations == 20 and s.total == 20
    assert all(r["event"] != "enter" for recs in result.events for r in recs)  # the simulator logs no entries


def test_tokens_wait_is_its_own_part() -> None:
    """A fast worker on a directed ring that may lead by max_ig = 1 waits for tokens, not updates:
    0 -> 1 -> 2 -> 0; rank 1 is slow, so rank 0 (its in-neighbour) runs out of tokens."""
    graph = Graph.from_json({"nodes": 3, "edges": [[0, 1], [1, 2], [2, 0]]})
    config = ProtocolConfig(max_ig=1, slowdown=["rank=1:5"])
    result = simulate(SimSpec(graph, config, 30, ComputeModel.parse("10"), keep_events=True))
    assert result.events is not None
    stats = run_stats(RunData(Path("sim"), dict(enumerate(result.events)), graph, config))
    assert stats.ranks[0].time_s["wait_tokens_s"] > 0.5 * stats.ranks[1].time_s["compute_s"]
    assert stats.ranks[1].time_s["wait_tokens_s"] == 0.0 and stats.ranks[1].time_s["wait_updates_s"] == 0.0


async def test_real_time_parts_add_up_to_the_step() -> None:
    """AsyncWorker on a real loop: rank 1 'computes' 20 ms a step, rank 0 nothing. Each record's
    four parts add up to the time between the ends of consecutive steps (``mono``), and the
    fast worker's time goes to waiting for the slow one's updates."""
    graph = Graph.ring(2)
    network = InprocNetwork()
    config = ProtocolConfig(timeout_s=30)
    barrier = asyncio.Barrier(2)
    logs = [EventLog(keep=True) for _ in range(2)]

    async def exchange(address: str) -> dict[int, str]:
        await barrier.wait()
        return {r: f"inproc://{r}" for r in range(2)}

    workers = await asyncio.gather(*(
        AsyncWorker.start(rank=r, graph=graph, config=config, params=torch.zeros(8),
                          transport=network.transport(r, frozenset(graph.peers(r))), exchange=exchange,
                          events=logs[r]) for r in range(2)))

    async def train(worker: AsyncWorker) -> None:
        worker.plan(15)
        for k in range(15):
            if worker.node.rank == 1:
                await asyncio.sleep(0.02)
            await worker.step(last=k == 14)

    await asyncio.gather(*(train(w) for w in workers))
    await asyncio.gather(*(w.close() for w in workers))
    for log in logs:
        steps = [r for r in log.records if r["event"] == "iteration"]
        assert [r["iter"] for r in steps] == list(range(15))
        for before, after in zip(steps, steps[1:]):
            assert sum(after[p] for p in PARTS) == pytest.approx(after["mono"] - before["mono"], abs=1e-5)  # parts are rounded to microseconds
    stats = run_stats(RunData(Path("mem"), {r: logs[r].records for r in range(2)}, graph, config))
    assert stats.ranks[0].share("wait_updates_s") > 0.5 > stats.ranks[1].share("wait_updates_s")
    assert stats.ranks[1].time_s["compute_s"] >= 15 * 0.02
    assert stats.total == 15

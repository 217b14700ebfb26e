"""worker.consensus(): every live worker ends with the exact mean of the live workers' models.

In process: the eight protocols on the simulator's virtual-time loop (their coordinators too),
workers that finish at different times, a worker that left during training, and one declared
dead by heartbeats (ZeroMQ, real time). Each worker snapshots its model once its protocol has
quiesced (nothing changes it after that but the consensus), and the test computes the mean of
those snapshots over the members in float64.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from hopnet import AsyncWorker, Graph, ProtocolConfig
from hopnet.api import assemble_node
from hopnet.collectives.consensus import ConsensusError, ConsensusResult
from hopnet.coordinator import make_coordinator
from hopnet.coordinator.sim import SimCoordinator
from hopnet.errors import HopnetError, WaitTimeout
from hopnet.bootstrap.env import SAVE_MODEL
from hopnet.launch.prepare import worker_base_env
from hopnet.launch.spec import LaunchSpec, validate
from hopnet.model_state import ModelState
from hopnet.runtime.events import EventLog
from hopnet.sim.vloop import VirtualTimeLoop
from hopnet.security import RunSecurity
from hopnet.transports.inproc import InprocNetwork, LinkModel

from support.cluster import COMPUTE_S, FaultyCluster, within
from support.paths import WORKERS

DIM = 37
STEPS = 12
LINK = LinkModel(latency_s=1e-3)

PROTOCOLS: dict[str, dict[str, Any]] = {
    "allreduce": {},
    "pipe-sgd": {"pipeline_k": 2},
    "eager-sgd": {},
    "hop": {},
    "notify-ack": {},
    "ad-psgd": {},
    "partial-reduce": {"group_size": 3},  # 4 workers in groups of 3: the last one waits for its group
    "prague": {"group_size": 2},  # (the smart GG merges 4 workers' leftovers into one group of 4)
}


@dataclass
class Run:
    """What each rank's consensus returned (or raised), its model before and after."""

    results: dict[int, ConsensusResult] = field(default_factory=dict)
    errors: dict[int, BaseException] = field(default_factory=dict)
    before: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    after: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    records: dict[int, list[dict[str, Any]]] = field(default_factory=dict)


def run_cluster(protocol: str, options: dict[str, Any], *, graph: Graph | None = None, steps: int = STEPS,
                leave_at: dict[int, int] | None = None, no_consensus: frozenset[int] = frozenset(),
                timeout_s: float = 30.0) -> Run:
    """Every rank of ``graph`` (a ring of 4) trains ``steps`` iterations on the virtual-time loop,
    rank ``r`` computing ``(r + 1)`` ms a step (so they finish apart), then quiesces, snapshots
    its model and calls consensus. ``leave_at[r]``: rank ``r`` closes (says bye) at that
    iteration instead; ranks in ``no_consensus`` train but never call consensus."""
    graph = graph if graph is not None else Graph.ring(4)
    leave_at = leave_at or {}
    run = Run()

    async def main() -> None:
        config = ProtocolConfig(protocol=protocol, timeout_s=timeout_s, **options)
        network = InprocNetwork(LINK)
        machine = make_coordinator(config, graph)
        coordinator = SimCoordinator(machine, LINK) if machine is not None else None
        params = [torch.randn(DIM, generator=torch.Generator().manual_seed(r)) for r in range(graph.n)]
        grads = [torch.zeros(DIM) for _ in range(graph.n)]
        logs = [EventLog(keep=True) for _ in range(graph.n)]
        nodes = [assemble_node(rank=r, graph=graph, config=config, params=params[r], grads=grads[r],
                               transport=network.transport(r, frozenset(graph.peers(r))), events=logs[r],
                               collective_factory=None,
                               coordinator=coordinator.client(r) if coordinator is not None else None)
                 for r in range(graph.n)]
        for node in nodes:
            await node.open()
        for node in nodes:
            await node.protocol.start()
        workers = [AsyncWorker(node) for node in nodes]
        everyone_done = asyncio.Event()
        finished = 0

        async def life(rank: int) -> None:
            nonlocal finished
            worker = workers[rank]
            draw = torch.Generator().manual_seed(1000 + rank)
            try:
                for k in range(steps):
                    if leave_at.get(rank) == k:
                        return
                    await asyncio.sleep(0.001 * (rank + 1))
                    grads[rank].copy_(torch.randn(DIM, generator=draw))
                    await worker.step(lambda: params[rank].sub_(0.05 * grads[rank]), last=k == steps - 1)
                if rank in no_consensus:
                    await everyone_done.wait()
                    return
                await worker.node.quiesce()
                run.before[rank] = [t.clone() for t in worker.node.protocol.model_tensors()]
                run.results[rank] = await worker.consensus()
                run.after[rank] = [t.clone() for t in worker.node.protocol.model_tensors()]
            except HopnetError as exc:
                run.errors[rank] = exc
            finally:
                finished += 1
                if finished == graph.n - len(no_consensus):
                    everyone_done.set()
                await worker.close()

        await asyncio.gather(*(life(r) for r in range(graph.n)))
        run.records = {r: logs[r].records for r in range(graph.n)}

    loop = VirtualTimeLoop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    return run


def assert_exact_mean(run: Run, members: tuple[int, ...]) -> None:
    """Every member holds the float64 mean of the members' snapshots (to float32 rounding),
    and all hold the same bytes."""
    assert not run.errors, run.errors
    assert sorted(run.results) == list(members)
    for rank in members:
        assert run.results[rank].members == members
    first = run.after[members[0]]
    for i, tensor in enumerate(first):
        mean = torch.stack([run.before[r][i].double() for r in members]).mean(0)
        assert torch.allclose(tensor.double(), mean, rtol=0, atol=1e-6), (tensor.double() - mean).abs().max()
        for rank in members[1:]:
            assert torch.equal(run.after[rank][i], tensor), f"rank {rank} differs from rank {members[0]}"


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_every_protocol_ends_with_the_exact_mean_on_every_worker(protocol: str) -> None:
    run = run_cluster(protocol, PROTOCOLS[protocol])
    assert_exact_mean(run, (0, 1, 2, 3))
    spread = max((run.before[r][0] - run.before[0][0]).abs().max().item() for r in range(4))
    assert spread > 1e-3  # the workers' models differed before: the consensus did something
    assert all(result.rounds == 1 for result in run.results.values())
    record = next(r for r in run.records[0] if r["event"] == "consensus")
    assert record["members"] == [0, 1, 2, 3] and record["rounds"] == 1


def test_prague_with_the_random_group_generator_ends_with_the_mean() -> None:
    assert_exact_mean(run_cluster("prague", {"group_size": 3, "group_generator": "random"}), (0, 1, 2, 3))


LEAVERS: dict[str, tuple[dict[str, Any], Graph]] = {
    "hop": ({"backup_workers": 1}, Graph.ring(5)),
    "partial-reduce": ({"group_size": 2}, Graph.ring(4)),
    "prague": ({"group_size": 2}, Graph.ring(4)),
    "ad-psgd": ({}, Graph.ring(4)),
}


@pytest.mark.parametrize("protocol", list(LEAVERS))
def test_a_worker_that_left_during_training_is_left_out(protocol: str) -> None:
    """Rank 3 leaves at iteration 4 (as a failing worker does under --max-failures); only its
    neighbours hear its goodbye, the others learn it from their views in a second round."""
    options, graph = LEAVERS[protocol]
    run = run_cluster(protocol, options, graph=graph, leave_at={3: 4})
    live = tuple(r for r in range(graph.n) if r != 3)
    assert_exact_mean(run, live)
    assert {result.rounds for result in run.results.values()} == {2}


def test_a_worker_that_never_calls_consensus_is_named_by_the_others_timeout() -> None:
    run = run_cluster("hop", {}, no_consensus=frozenset({2}), timeout_s=5.0)
    assert sorted(run.errors) == [0, 1, 3]
    for error in run.errors.values():
        assert isinstance(error, WaitTimeout)
        assert "no view from rank(s) 2 (stalled)" in str(error)
        assert "did every live worker call consensus()?" in str(error)
        assert error.peer == 2


def test_no_step_after_consensus() -> None:
    async def main() -> None:
        workers = await hop_workers_after_one_step(2)
        results = await asyncio.gather(*(w.consensus() for w in workers))
        assert [r.members for r in results] == [(0, 1), (0, 1)]
        assert all(torch.allclose(w.node.protocol.model_tensors()[0], torch.full((4,), 0.5), rtol=0, atol=1e-6)
                   for w in workers)
        with pytest.raises(HopnetError, match="step\\(\\) after consensus\\(\\)"):
            await workers[0].step()
        await asyncio.gather(*(w.close() for w in workers))

    loop = VirtualTimeLoop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


async def test_a_worker_declared_dead_is_left_out() -> None:
    """Over ZeroMQ with heartbeats: rank 3 of a ring of 5 falls silent; its neighbours declare it
    dead (maybe only once the consensus has begun), and the four others agree without it."""
    graph = Graph.ring(5)
    config = ProtocolConfig(protocol="hop", backup_workers=1, peer_timeout_s=0.5, timeout_s=20.0)
    start: list[torch.Tensor] = [torch.full((8,), float(r)) for r in range(5)]
    async with FaultyCluster(graph, config, params=lambda r: start[r]) as cluster:
        before: dict[int, torch.Tensor] = {}

        async def survivor(rank: int) -> ConsensusResult:
            worker = cluster.workers[rank]
            for k in range(10):
                await asyncio.sleep(COMPUTE_S)
                await worker.step(last=k == 9)
            await worker.node.quiesce()
            before[rank] = worker.node.protocol.model_tensors()[0].clone()
            return await worker.consensus()

        live = (0, 1, 2, 4)
        _, *results = await within(cluster.fall_silent(3, at_iteration=2), *(survivor(r) for r in live))
        mean = torch.stack([before[r].double() for r in live]).mean(0)
        for rank, result in zip(live, results):
            assert result.members == live
            params = cluster.workers[rank].node.protocol.model_tensors()[0]
            assert torch.allclose(params.double(), mean, rtol=0, atol=1e-6)
        assert any(3 in cluster.workers[r].node.dead for r in (2, 4))


def bn_model(rank: int) -> torch.nn.Module:
    """Parameters in fp32 and bf16, BatchNorm statistics, an integer buffer: different per rank."""
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3))
    model[2].to(torch.bfloat16)
    with torch.no_grad():
        model[1].running_mean.normal_()
        model[1].running_var.uniform_(0.5, 2.0)
    model[1].num_batches_tracked.fill_(10 + rank)
    return model


def test_parameters_and_buffers_of_mixed_dtypes_end_as_the_mean() -> None:
    """The model's state_dict after the consensus: every floating entry (fp32 and bf16 parameters,
    BatchNorm statistics) is the mean of the ranks' ones; the integer buffer stays each rank's own."""
    modules = [bn_model(r) for r in range(3)]
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in modules]

    async def main() -> list[ConsensusResult]:
        graph = Graph.ring(3)
        config = ProtocolConfig(protocol="hop", timeout_s=5.0)
        network = InprocNetwork()
        workers = [AsyncWorker(assemble_node(rank=r, graph=graph, config=config, params=ModelState.of(modules[r]),
                                             grads=None, transport=network.transport(r, frozenset(graph.peers(r))),
                                             events=None, collective_factory=None, coordinator=None))
                   for r in range(3)]
        for worker in workers:
            await worker.node.open()
        for worker in workers:
            await worker.node.protocol.start()
        results = await asyncio.gather(*(w.consensus() for w in workers))
        await asyncio.gather(*(w.close() for w in workers))
        return list(results)

    loop = VirtualTimeLoop()
    try:
        results = loop.run_until_complete(main())
    finally:
        loop.close()
    assert [r.members for r in results] == [(0, 1, 2)] * 3
    for name, first in before[0].items():
        if not first.is_floating_point():
            assert [m.state_dict()[name].item() for m in modules] == [10, 11, 12]
            continue
        mean = torch.stack([b[name].double() for b in before]).mean(0).to(first.dtype)
        for module in modules:
            assert torch.equal(module.state_dict()[name], mean), name


async def hop_workers_after_one_step(n: int = 3) -> list[AsyncWorker]:
    """A Hop ring of ``n`` over the in-process transport, rank r's model ``[r, r, r, r]``,
    after one last step: ready for their consensus."""
    graph = Graph.ring(n)
    config = ProtocolConfig(protocol="hop", timeout_s=5.0)
    network = InprocNetwork()
    workers = [AsyncWorker(assemble_node(rank=r, graph=graph, config=config, params=torch.full((4,), float(r)),
                                         grads=None, transport=network.transport(r, frozenset(graph.peers(r))),
                                         events=None, collective_factory=None, coordinator=None))
               for r in range(n)]
    for worker in workers:
        await worker.node.open()
    for worker in workers:
        await worker.node.protocol.start()
    await asyncio.gather(*(w.step(last=True) for w in workers))
    return workers


def test_a_non_finite_model_is_left_out_of_the_mean_and_gets_it() -> None:
    async def main() -> tuple[list[ConsensusResult], list[torch.Tensor], list[torch.Tensor]]:
        workers = await hop_workers_after_one_step()
        models = [w.node.protocol.model_tensors()[0] for w in workers]
        models[1][2] = float("nan")  # an overflow rank 1's optimizer step did not catch
        before = [m.clone() for m in models]
        results = await asyncio.gather(*(w.consensus() for w in workers))
        await asyncio.gather(*(w.close() for w in workers))
        return list(results), before, models

    loop = VirtualTimeLoop()
    try:
        results, before, after = loop.run_until_complete(main())
    finally:
        loop.close()
    assert [(r.members, r.non_finite) for r in results] == [((0, 1, 2), (1,))] * 3
    mean = (before[0].double() + before[2].double()) / 2
    for model in after:
        assert torch.allclose(model.double(), mean, rtol=0, atol=1e-6)


def test_a_worker_counted_gone_by_another_fails_naming_it() -> None:
    """A worker that another wrote off (declared dead: its messages are dropped from then on)
    cannot join the consensus: it learns so from the others' views and fails saying who."""
    async def main() -> list[BaseException | ConsensusResult]:
        workers = await hop_workers_after_one_step()
        workers[0].node.peer_dead(2, 9.9)  # a false alarm: rank 2 is alive, rank 0 wrote it off
        outcome = await asyncio.gather(*(w.consensus() for w in workers), return_exceptions=True)
        await asyncio.gather(*(w.close() for w in workers), return_exceptions=True)
        return outcome

    loop = VirtualTimeLoop()
    try:
        outcome = loop.run_until_complete(main())
    finally:
        loop.close()
    assert isinstance(outcome[2], ConsensusError)
    assert "rank 0 counts it gone" in str(outcome[2]) or "rank 1 counts it gone" in str(outcome[2])
    assert isinstance(outcome[0], ConsensusResult) and outcome[0].members == (0, 1)
    assert isinstance(outcome[1], ConsensusResult) and outcome[1].members == (0, 1)



def test_save_model_reaches_the_workers_only_from_the_flag() -> None:
    script = str(WORKERS / "consensus_worker.py")
    plain = RunSecurity(None, "off: loopback")
    env, _ = worker_base_env(validate(LaunchSpec(script, graph="ring:2", save_model=True)), plain, {})
    assert env[SAVE_MODEL] == "1"
    env, _ = worker_base_env(validate(LaunchSpec(script, graph="ring:2")), plain, {SAVE_MODEL: "1"})
    assert SAVE_MODEL not in env

"""--local-steps H on the model-averaging protocols: a worker mixes every H iterations and trains
alone in between. Ranks train digits in this process on the simulator's virtual-time loop
(coordinators included), over the in-process transport, whose counters give the bytes sent."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
import torch

from hopnet import AsyncWorker, Graph, ProtocolConfig
from hopnet.analysis import gap_bound
from hopnet.api import assemble_node
from hopnet.coordinator import make_coordinator
from hopnet.coordinator.sim import SimCoordinator
from hopnet.errors import ConfigError
from hopnet.model_state import ModelState
from hopnet.params import FlatGradients
from hopnet.protocols.local_steps import mixes_at, mixing_iteration, round_of, rounds_sent_by
from hopnet.report.diagnosis import update_arrivals
from hopnet.report.rundir import RunData
from hopnet.runtime.events import EventLog
from hopnet.sim.engine import ComputeModel, SimSpec, simulate
from hopnet.sim.vloop import VirtualTimeLoop
from hopnet.transports.inproc import InprocNetwork, LinkModel

from support.digits import digits_split

RANKS = 4
LINK = LinkModel(latency_s=1e-3)
PROTOCOLS: dict[str, dict[str, Any]] = {
    "hop": {},
    "notify-ack": {},
    "ad-psgd": {},
    "prague": {"group_size": 2},
    "partial-reduce": {"group_size": 2},
}


@lru_cache(maxsize=1)
def digits() -> tuple[torch.Tensor, ...]:
    return digits_split(0)


@dataclass
class Trained:
    accuracies: list[float]
    """Each rank's held-out accuracy after its last step."""
    consensus_accuracies: list[float]
    """After ``worker.consensus()`` (the mean model, on every rank)."""
    sent_bytes: list[int]
    iterations: list[int]


def train(protocol: str, local_steps: int, steps: int, *, hidden: int = 32, resume_at: int = 0) -> Trained:
    """Every rank trains examples/train_digits.py's MLP on its shard for ``steps`` iterations, rank
    ``r`` computing ``r + 1`` ms a step in virtual time (so they drift apart between mixes);
    ``resume_at``: every rank starts there instead, as after a checkpoint of the iteration before."""
    x_train, y_train, x_test, y_test = digits()
    graph = Graph.ring(RANKS)
    result = Trained([0.0] * RANKS, [0.0] * RANKS, [0] * RANKS, [0] * RANKS)

    async def main() -> None:
        config = ProtocolConfig(protocol=protocol, timeout_s=30.0, **PROTOCOLS[protocol],
                                **({"local_steps": local_steps} if local_steps != 1 else {}))
        network = InprocNetwork(LINK)
        machine = make_coordinator(config, graph)
        coordinator = SimCoordinator(machine, LINK) if machine is not None else None
        models = []
        for _ in range(RANKS):
            torch.manual_seed(0)  # the same initial model everywhere
            models.append(torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                                              torch.nn.Linear(hidden, 10)))
        nodes = [assemble_node(rank=r, graph=graph, config=config, params=ModelState.of(models[r]),
                               grads=FlatGradients(models[r]),
                               transport=network.transport(r, frozenset(graph.peers(r))), events=EventLog(),
                               collective_factory=None,
                               coordinator=coordinator.client(r) if coordinator is not None else None)
                 for r in range(RANKS)]
        for node in nodes:
            await node.open()
        for node in nodes:
            if resume_at:
                node.protocol.resume_at(resume_at)
            await node.protocol.start()
            node.protocol.final_iteration = steps - 1
        trained = asyncio.Barrier(RANKS)  # none closes (dropping what is still on its way) before all trained

        def accuracy(model: torch.nn.Module) -> float:
            with torch.no_grad():
                return (model(x_test).argmax(1) == y_test).float().mean().item()

        async def life(rank: int) -> None:
            model, node = models[rank], nodes[rank]
            worker = AsyncWorker(node)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            xs, ys = x_train[rank::RANKS], y_train[rank::RANKS]
            draw = torch.Generator().manual_seed(rank)
            loss_fn = torch.nn.CrossEntropyLoss()
            try:
                for k in range(resume_at, steps):  # (the last step leaves the worker in its last iteration)
                    await asyncio.sleep(0.001 * (rank + 1))
                    batch = torch.randint(len(xs), (32,), generator=draw)
                    optimizer.zero_grad()
                    loss_fn(model(xs[batch]), ys[batch]).backward()
                    await worker.step(optimizer.step, last=k == steps - 1)
                result.iterations[rank] = worker.iteration
                await node.quiesce()
                result.sent_bytes[rank] = node.transport.stats.sent_bytes  # training's, not the consensus'
                result.accuracies[rank] = accuracy(model)
                await worker.consensus()
                result.consensus_accuracies[rank] = accuracy(model)
                await trained.wait()
            finally:
                await worker.close()

        await asyncio.gather(*(life(r) for r in range(RANKS)))

    loop = VirtualTimeLoop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    return result


@lru_cache(maxsize=None)
def short_run(protocol: str, local_steps: int, resume_at: int = 0) -> Trained:
    """20 iterations of a tiny model: what the counting tests need (shared by them)."""
    return train(protocol, local_steps, 20, hidden=8, resume_at=resume_at)


def test_rounds_fall_on_every_hth_iteration_and_the_last() -> None:
    assert [k for k in range(12) if mixes_at(k, 5, 11)] == [4, 9, 11]
    assert all(mixes_at(k, 1, None) for k in range(5))
    assert [round_of(k, 5) for k in (0, 4, 5, 11)] == [0, 0, 1, 2]
    assert mixing_iteration(2, 5, 11) == 11 and mixing_iteration(1, 5, None) == 9
    # a goodbye in iteration k: the rounds whose model the worker sent (it enters a round at its mixing iteration)
    assert [rounds_sent_by(k, 5, 11) for k in (0, 3, 4, 5, 9, 10, 11)] == [-1, -1, 0, 0, 1, 1, 2]
    assert [rounds_sent_by(k, 1, None) for k in (0, 7)] == [0, 7]


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_local_steps_send_about_h_times_fewer_bytes(protocol: str) -> None:
    every, fifth = short_run(protocol, 1), short_run(protocol, 5)
    assert every.iterations == fifth.iterations == [19] * RANKS
    ratio = sum(every.sent_bytes) / sum(fifth.sent_bytes)
    # the group protocols' groups vary with timing, Hop's updates are exact: 20 vs 4 rounds
    assert 3.5 <= ratio <= 6.5, (every.sent_bytes, fifth.sent_bytes)


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_a_run_resumed_inside_a_round_mixes_where_the_uninterrupted_one_does(protocol: str) -> None:
    """A checkpoint of iteration 6 (a local step, H = 5): the resumed run goes on with round 1 and
    mixes at 9, 14 and 19, three of the uninterrupted run's four rounds."""
    fresh, resumed = short_run(protocol, 5), short_run(protocol, 5, resume_at=7)
    assert resumed.iterations == [19] * RANKS
    if protocol in ("hop", "notify-ack"):  # every rank sends its model to both neighbours once a round
        assert [4 * b for b in resumed.sent_bytes] == [3 * b for b in fresh.sent_bytes]
    else:
        assert 0 < sum(resumed.sent_bytes) < sum(fresh.sent_bytes)


@pytest.mark.parametrize("protocol", ["hop", "ad-psgd", "prague", "partial-reduce"])
def test_digits_reaches_95_percent_mixing_every_5_iterations(protocol: str) -> None:
    trained = train(protocol, 5, 300)
    assert min(trained.consensus_accuracies) >= 0.95, trained.consensus_accuracies
    # the asynchronous protocols' slowest rank (4x the fastest's compute) mixes least: 0.93-0.94 seen
    assert min(trained.accuracies) >= 0.9, trained.accuracies


@pytest.mark.parametrize("extra", [{}, {"staleness": 1}, {"backup_workers": 1}],
                         ids=["standard", "staleness", "backup-workers"])
def test_hop_gap_bound_holds_in_rounds(extra: dict[str, Any]) -> None:
    """Entries count rounds under local steps: Table 1's bound holds for them, with stragglers."""
    graph = Graph.ring(6)
    config = ProtocolConfig(protocol="hop", local_steps=4, max_ig=2, slowdown=["random:6:0.2"], **extra)
    result = simulate(SimSpec(graph, config, iterations=81, compute=ComputeModel.parse("uniform:5:15"),
                              model_bytes=1000))
    assert result.iterations == [81] * graph.n
    assert result.max_gap is not None
    bound = gap_bound(graph, config)
    assert (result.max_gap <= bound).all(), f"observed round gaps\n{result.max_gap}\nexceed\n{bound}"
    assert result.largest_gap[0] >= 1  # the workers did drift apart


def test_hop_refuses_skipping_and_restarts_with_local_steps() -> None:
    with pytest.raises(ConfigError, match="--skip-threshold with --local-steps 3"):
        ProtocolConfig(protocol="hop", local_steps=3, skip_threshold=1, max_jump=1)
    config = ProtocolConfig(protocol="hop", local_steps=3)
    refusal = config.spec.restart_refusal
    assert refusal is not None and "--local-steps 3" in (refusal(config.options) or "")
    with pytest.raises(ConfigError, match="--local-steps must be an integer >= 1"):
        ProtocolConfig(protocol="partial-reduce", local_steps=0)


def test_the_reports_link_times_leave_a_local_steps_run_out() -> None:
    """Hop's entries count rounds under --local-steps, its iteration records iterations: the
    diagnosis pairs them only when they count the same."""
    def records(peer: int) -> list[dict[str, Any]]:
        return [{"event": "enter", "rank": 1 - peer, "iter": 0, "mono": 1.0},
                {"event": "iteration", "rank": 1 - peer, "iter": 0, "mono": 2.0, "mix_s": 0.0, "wait_tokens_s": 0.0,
                 "wait_updates_from": {str(peer): 0.5}}]

    def run(**options: Any) -> RunData:
        return RunData(Path("run"), {0: records(1), 1: records(0)}, Graph.ring(2),
                       ProtocolConfig(protocol="hop", **options))

    assert len(update_arrivals(run())) == 2
    assert update_arrivals(run(local_steps=5)) == []


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_a_run_shorter_than_a_round_mixes_once_at_its_end(protocol: str) -> None:
    """The run's end is known only once the trainer's loop starts (after the worker started), as under
    ``worker.iterations(total)``: the last iteration still mixes (Prague asks for its group late)."""
    trained = train(protocol, 5, 1, hidden=8)  # iteration 0 is the last: begun before the worker knew
    assert trained.iterations == [0] * RANKS
    assert sum(trained.sent_bytes) > 0

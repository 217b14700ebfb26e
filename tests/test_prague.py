"""Prague in the simulator: P-Reduce's algebra, whole runs with the random GG, determinism,
clean leaving. The coordinator runs on the virtual loop, exactly as under `hopnet launch`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch

from hopnet import Graph, ProtocolConfig
from hopnet.coordinator.base import Coordinator, Send
from hopnet.errors import ConfigError
from hopnet.sim import engine
from hopnet.sim.engine import ComputeModel, SimSpec, simulate
from hopnet.transports.inproc import LinkModel

RANDOM = ProtocolConfig(protocol="prague", group_generator="random", group_size=3, seed=5)
DIM = 64


def initial_params(config: ProtocolConfig, n: int) -> list[torch.Tensor]:
    """The parameters the simulator starts each rank with (see hopnet.sim.engine)."""
    return [torch.randn(DIM, generator=torch.Generator().manual_seed(config.seed * 1_000_003 + r),
                        dtype=torch.float64) for r in range(n)]


class OneGroup(Coordinator):
    """GOs the group {0, 2, 3} for rank 0's request; every other request gets a group of one."""

    name = "one group"

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size)
        self.acks: list[tuple[int, int]] = []

    def on_message(self, sender: int, message: Mapping[str, Any]) -> list[Send]:
        if message["t"] == "ack":
            self.acks.append((sender, message["gid"]))
            return []
        if sender == 0:
            return [Send(w, {"t": "go", "gid": 0, "members": [0, 2, 3], "reply": w == 0}) for w in (0, 2, 3)]
        gid = 100 + sender
        return [Send(sender, {"t": "go", "gid": gid, "members": [sender], "reply": True})]


def test_p_reduce_averages_its_members_preserves_the_sum_and_leaves_others_bit_identical(monkeypatch) -> None:
    monkeypatch.setattr(engine, "make_coordinator", lambda config, graph: OneGroup(graph.n))
    n = 6
    before = initial_params(RANDOM, n)
    result = simulate(SimSpec(Graph.complete(n), RANDOM, 1, ComputeModel.parse("1"), param_dim=DIM,
                              link=LinkModel(latency_s=1e-4)))
    after = result.params
    assert after is not None
    mean = (before[0] + before[2] + before[3]) / 3
    for r in (0, 2, 3):
        assert torch.equal(after[r], after[0]), "members end bit-identical"
        assert torch.allclose(after[r], mean, rtol=0, atol=1e-12)
    for r in (1, 4, 5):
        assert torch.equal(after[r], before[r]), f"non-member {r} was touched"
    assert torch.allclose(sum(after), sum(before), rtol=0, atol=1e-12)
    assert result.coordinator is not None and result.coordinator["groups_formed"] == 6


ITERATIONS = 20


def _random_run(n: int = 5, iterations: int = ITERATIONS, **overrides: Any) -> engine.SimResult:
    spec = SimSpec(Graph.complete(n), RANDOM, iterations, ComputeModel.parse("uniform:5:15"), param_dim=DIM,
                   link=LinkModel(latency_s=2e-4), **overrides)
    return simulate(spec)


@pytest.fixture(scope="module")
def random_run() -> engine.SimResult:
    return _random_run(keep_events=True)


def test_a_random_gg_run_preserves_the_sum_and_reaches_consensus(random_run: engine.SimResult) -> None:
    n = 5
    before = initial_params(RANDOM, n)
    result = random_run
    after = result.params
    assert after is not None and result.iterations == [ITERATIONS] * n
    assert torch.allclose(sum(after), sum(before), rtol=0, atol=1e-9)
    spread_before = max((p - before[0]).abs().max().item() for p in before)
    spread_after = max((p - after[0]).abs().max().item() for p in after)
    assert spread_after < 1e-2 * spread_before, (spread_before, spread_after)
    summary = result.coordinator
    assert summary is not None
    assert summary["groups"] == n * ITERATIONS and summary["workers_left"] == list(range(n))
    assert summary["dropped"].get("bad_message", 0) == 0
    # every iteration record names the group that answered the worker's own request
    assert result.events is not None
    for rank, records in enumerate(result.events):
        groups = [r["group"] for r in records if r["event"] == "iteration"]
        assert len(groups) == ITERATIONS and all(rank in g and len(set(g)) == len(g) for g in groups)
        assert sum(len(g) == 3 for g in groups) >= ITERATIONS - 3  # smaller only once others left
    logged = [r for r in result.coordinator_events or [] if r["event"] == "group"]
    assert len(logged) == n * ITERATIONS


def test_prague_in_the_simulator_is_deterministic(random_run: engine.SimResult) -> None:
    first, second = random_run, _random_run(keep_events=True)
    assert first.to_dict() == second.to_dict()
    assert all(torch.equal(a, b) for a, b in zip(first.params or [], second.params or []))


def test_a_worker_that_stops_early_strands_nobody() -> None:
    """Rank 2 leaves after 5 iterations: it says bye and runs what was GO'd to it first; the
    others finish all their iterations without waiting on it, and the models' sum is preserved."""
    n = 5
    before = initial_params(RANDOM, n)
    result = _random_run(n, stop_at={2: 5})
    assert result.iterations == [ITERATIONS, ITERATIONS, 5, ITERATIONS, ITERATIONS]
    assert torch.allclose(sum(result.params or []), sum(before), rtol=0, atol=1e-9)
    assert result.coordinator is not None and result.coordinator["workers_left"] == list(range(n))


def test_prague_with_a_generator_needs_a_coordinator() -> None:
    from hopnet.protocols import make_protocol
    from hopnet.runtime.clock import Clock
    from hopnet.runtime.node import Node
    from hopnet.transports.inproc import InprocNetwork

    protocol = make_protocol(RANDOM, torch.zeros(4))
    transport = InprocNetwork().transport(0, frozenset({1}))
    with pytest.raises(ConfigError, match="needs its Group Generator"):
        Node(0, Graph.ring(3), transport, protocol, clock=Clock(1.0))


class DeadMember(Coordinator):
    """GOs {0, 2, 4} for rank 0's request to 0 and 4 only, and when rank 2 leaves reports it
    dead to them, as the host does for a worker gone silent."""

    name = "dead member"

    def on_message(self, sender: int, message: Mapping[str, Any]) -> list[Send]:
        if message["t"] == "req" and sender == 0 and message["iter"] == 0:
            return [Send(w, {"t": "go", "gid": 0, "members": [0, 2, 4], "reply": w == 0}) for w in (0, 4)]
        return []

    def on_worker_gone(self, rank: int) -> list[Send]:
        return [Send(w, {"t": "peer_dead", "rank": rank, "silent_s": 5.0}) for w in (0, 4)]


def test_a_member_reported_dead_fails_the_p_reduce_waiting_on_it_naming_it(monkeypatch) -> None:
    from hopnet.errors import PeerFailure

    monkeypatch.setattr(engine, "make_coordinator", lambda config, graph: DeadMember(graph.n))
    spec = SimSpec(Graph.ring(5), RANDOM, 3, ComputeModel.parse("1"), param_dim=DIM, stop_at={2: 0},
                   link=LinkModel(latency_s=1e-3))
    with pytest.raises(PeerFailure) as failure:
        simulate(spec)
    assert (failure.value.peer, failure.value.peer_state) == (2, "dead")
    assert "prague/0" in str(failure.value)

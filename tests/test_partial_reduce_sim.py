"""Partial Reduce end to end in the simulator (the real protocol, controller, host and client
on the virtual loop), a member's death mid-group, and one real `hopnet launch` run."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from support.paths import EXAMPLES
from support.launch import run_launch
from support.records import all_records
from hopnet import ConfigError, Graph, ProtocolConfig
from hopnet.coordinator import make_coordinator
from hopnet.protocols.partial_reduce.mixing import GROUP_RECORD, groups_from_records, mixing_matrix, spectral_rho
from hopnet.coordinator.sim import SimCoordinator
from hopnet.protocols.partial_reduce.weights import dynamic_weights
from hopnet.errors import PeerFailure
from hopnet.protocols import make_protocol
from hopnet.runtime.clock import Clock
from hopnet.runtime.events import EventLog
from hopnet.runtime.node import Node
from hopnet.sim.engine import ComputeModel, SimResult, SimSpec, simulate
from hopnet.sim.vloop import VirtualTimeLoop
from hopnet.transports.inproc import InprocNetwork, LinkModel


def run_sim(n: int, p: int, iterations: int, *, weights: str = "const", compute: str = "exp:10",
            slow: dict[int, str] | None = None, stop_at: dict[int, int] | None = None, seed: int = 3,
            param_dim: int = 64) -> SimResult:
    config = ProtocolConfig(protocol="partial-reduce", group_size=p, weights=weights, seed=seed)
    model = ComputeModel.parse(compute)
    for rank, text in (slow or {}).items():
        model = model.with_rank(rank, ComputeModel.parse(text))
    return simulate(SimSpec(Graph.ring(n), config, iterations, compute=model, link=LinkModel(latency_s=0.0005),
                            param_dim=param_dim, stop_at=stop_at or {}, keep_events=True))


def group_records(result: SimResult) -> list[dict]:
    assert result.events is not None
    return [r for events in result.events for r in events if r["event"] == GROUP_RECORD]


def initial_params(n: int, dim: int, seed: int) -> torch.Tensor:
    """What the simulator starts each rank's float64 parameters at (SimSpec.param_dim)."""
    return torch.stack([torch.randn(dim, generator=torch.Generator().manual_seed(seed * 1_000_003 + r),
                                    dtype=torch.float64) for r in range(n)])


@pytest.fixture(scope="module")
def const_run() -> SimResult:
    return run_sim(6, 3, 40)


def test_the_simulator_runs_it_deterministically(const_run: SimResult) -> None:
    again = run_sim(6, 3, 40)
    assert const_run.params is not None and again.params is not None
    assert all(torch.equal(a, b) for a, b in zip(const_run.params, again.params))
    assert group_records(const_run) == group_records(again)
    assert const_run.finish_times == again.finish_times


def test_constant_weights_reach_consensus_and_keep_the_mean(const_run: SimResult) -> None:
    assert const_run.params is not None
    start = initial_params(6, 64, 3)
    final = torch.stack(const_run.params)
    spread_before = (start - start.mean(0)).abs().max().item()
    spread_after = (final - final.mean(0)).abs().max().item()
    assert spread_after < 1e-6 * spread_before
    assert (final.sum(0) - start.sum(0)).abs().max() < 1e-12  # the sum (and mean) is kept
    summary = const_run.coordinator
    assert summary is not None and summary["groups"] == len(groups_from_records(group_records(const_run)))
    assert const_run.iterations == [40] * 6


def test_group_records_agree_among_members(const_run: SimResult) -> None:
    by_gid: dict[int, list[dict]] = {}
    for record in group_records(const_run):
        by_gid.setdefault(record["gid"], []).append(record)
    for gid, records in by_gid.items():
        members = records[0]["members"]
        assert sorted(r["rank"] for r in records) == members, gid  # every member, once
        assert all(r["members"] == members and r["weights"] == records[0]["weights"] for r in records)
        assert len({r["counter"] for r in records}) == 1  # k <- max k on every member
    assert const_run.coordinator_events is not None  # the coordinator's log names the same groups
    assert groups_from_records(const_run.coordinator_events) == groups_from_records(group_records(const_run))


def test_dynamic_weights_reach_consensus_with_a_straggler() -> None:
    result = run_sim(6, 3, 40, weights="dynamic", slow={1: "exp:50"})
    assert result.params is not None
    start = initial_params(6, 64, 3)
    final = torch.stack(result.params)
    assert (final - final.mean(0)).abs().max() < 1e-3 * (start - start.mean(0)).abs().max()
    weights = [r["weights"] for r in group_records(result)]
    assert any(max(w) - min(w) > 0.05 for w in weights)  # the straggler made them uneven
    assert all(abs(sum(w) - 1) < 1e-12 for w in weights)
    assert abs(final.mean(0) - start.mean(0)).max() > 1e-6  # the mean moved


def test_the_logged_groups_of_three_workers_in_pairs_give_rho_one_half() -> None:
    result = run_sim(3, 2, 600, param_dim=4, seed=5)
    groups = groups_from_records(group_records(result))
    assert len(groups) > 800
    rho = spectral_rho(mixing_matrix(groups, 3))
    assert rho == pytest.approx(0.5, abs=0.05)


def test_a_worker_that_leaves_early_is_grouped_no_more_and_nobody_waits() -> None:
    result = run_sim(5, 3, 30, stop_at={2: 6})
    assert result.iterations[2] == 6 and all(result.iterations[r] == 30 for r in (0, 1, 3, 4))
    records = group_records(result)
    last_of_2 = max(r["gid"] for r in records if r["rank"] == 2)
    later = {r["gid"]: r["members"] for r in records if r["gid"] > last_of_2}
    assert later and all(2 not in members for members in later.values())
    assert result.coordinator is not None and 2 in result.coordinator["left"]


def test_group_size_larger_than_the_run_is_refused() -> None:
    with pytest.raises(ConfigError, match="--group-size 5 is larger than the run's 4 workers"):
        make_coordinator(ProtocolConfig(protocol="partial-reduce", group_size=5), Graph.ring(4))


def test_a_dynamic_group_leaves_members_identical_at_the_newest_counter_and_moves_the_mean() -> None:
    n = 3
    graph = Graph.ring(n)
    config = ProtocolConfig(protocol="partial-reduce", group_size=3, weights="dynamic", timeout_s=60)
    loop = VirtualTimeLoop()
    network = InprocNetwork(LinkModel(latency_s=0.001))
    machine = make_coordinator(config, graph)
    assert machine is not None
    host = SimCoordinator(machine, LinkModel(latency_s=0.001))
    start = initial_params(n, 32, 7)
    params = [start[r].clone() for r in range(n)]
    nodes: list[Node] = []

    async def main() -> None:
        for rank in range(n):
            protocol = make_protocol(config, params[rank])
            protocol.counter = [9, 3, 0][rank]  # models of different ages: they send 10, 4 and 1
            nodes.append(Node(rank, graph, network.transport(rank, frozenset(graph.peers(rank))), protocol,
                              clock=Clock(config.timeout_s), events=EventLog(keep=True),
                              coordinator=host.client(rank)))
        for node in nodes:
            await node.open()
            await node.protocol.start()
        await asyncio.gather(*(node.run_step(None, last=True) for node in nodes))
        for node in nodes:
            await node.close()

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    betas = dynamic_weights([10, 4, 1], 0.9, "oldest")
    assert torch.equal(params[0], params[1]) and torch.equal(params[1], params[2])  # bit-identical
    expected = sum(b * start[r] for r, b in enumerate(betas))
    assert (params[0] - expected).abs().max() < 1e-12
    assert [node.protocol.counter for node in nodes] == [10, 10, 10]
    assert (torch.stack(params).mean(0) - start.mean(0)).abs().max() > 1e-3  # DYN moves the mean


# ---------------------------------------------------------------------------- a member dies mid-group


def test_a_member_dead_during_its_group_fails_the_others_naming_it() -> None:
    """Rank 2 sends ready and vanishes before averaging; the coordinator's peer_dead notice
    (here delivered as the client would: ``node.peer_dead``) fails the others' all-reduce."""
    n, p = 3, 3
    graph = Graph.ring(n)
    config = ProtocolConfig(protocol="partial-reduce", group_size=p, timeout_s=60)
    loop = VirtualTimeLoop()
    network = InprocNetwork(LinkModel(latency_s=0.001))
    machine = make_coordinator(config, graph)
    assert machine is not None
    host = SimCoordinator(machine, LinkModel(latency_s=0.001))
    nodes: list[Node] = []
    outcomes: dict[int, BaseException | None] = {}

    async def main() -> None:
        for rank in range(n):
            protocol = make_protocol(config, torch.ones(8, dtype=torch.float64) * rank)
            nodes.append(Node(rank, graph, network.transport(rank, frozenset(graph.peers(rank))), protocol,
                              clock=Clock(config.timeout_s), events=EventLog(keep=True),
                              coordinator=host.client(rank)))
        for node in nodes:
            await node.open()

        async def survivor(node: Node) -> None:
            await node.protocol.start()
            try:
                await node.run_step(None, last=True)
                outcomes[node.rank] = None
            except PeerFailure as exc:
                outcomes[node.rank] = exc

        async def dies(node: Node) -> None:
            await node.protocol.start()
            node.coordinator.send({"t": "ready", "iter": 1})  # and never averages
            await asyncio.sleep(5.0)
            for other in nodes[:2]:
                other.peer_dead(2, 5.0)

        await asyncio.gather(survivor(nodes[0]), survivor(nodes[1]), dies(nodes[2]))
        ended.append(asyncio.get_running_loop().time())

    ended: list[float] = []
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    for rank in (0, 1):
        exc = outcomes[rank]
        assert isinstance(exc, PeerFailure), outcomes
        assert exc.peer == 2 and exc.peer_state == "dead" and exc.iteration == 0
        assert f"rank {rank}: group 0 [0, 1, 2] of iteration 0 failed" in str(exc)
    # rank 1 waits on rank 0 (its ring predecessor), which is alive: rank 0's abort names 2 to it
    assert "rank 0 reported rank 2 dead" in str(outcomes[1])
    assert ended[0] < 6.0  # virtual seconds: nobody waited out the 60 s --timeout


def test_a_worker_stopped_while_waiting_still_averages_in_the_group_formed_for_it() -> None:
    """Rank 0 is stopped (its step cancelled, as Ctrl-C does) while waiting for its group; rank 1's
    ready reaches the controller just before rank 0's goodbye, so the controller pairs them. Rank 0
    averages in that group while leaving, and rank 1 is not left waiting."""
    n = 3
    graph = Graph.ring(n)
    config = ProtocolConfig(protocol="partial-reduce", group_size=2, timeout_s=60)
    loop = VirtualTimeLoop()
    network = InprocNetwork(LinkModel(latency_s=0.001))
    machine = make_coordinator(config, graph)
    assert machine is not None
    host = SimCoordinator(machine, LinkModel(latency_s=0.001))
    params = [torch.full((8,), float(rank), dtype=torch.float64) for rank in range(n)]
    nodes: list[Node] = []

    async def main() -> None:
        for rank in range(n):
            nodes.append(Node(rank, graph, network.transport(rank, frozenset(graph.peers(rank))),
                              make_protocol(config, params[rank]), clock=Clock(config.timeout_s),
                              events=EventLog(keep=True), coordinator=host.client(rank)))
        for node in nodes:
            await node.open()
        for node in nodes[:2]:
            await node.protocol.start()
        waiting = asyncio.get_running_loop().create_task(nodes[0].run_step(None, last=True))
        await asyncio.sleep(0.9995)
        partner = asyncio.get_running_loop().create_task(nodes[1].run_step(None, last=True))
        await asyncio.sleep(0.0005)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await nodes[0].close()  # says bye, and averages in the group formed before the bye arrived
        await partner
        await nodes[1].close()
        await nodes[2].close()

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert nodes[0].protocol.summary()["groups_while_leaving"] == 1
    assert torch.equal(params[0], params[1]) and params[0][0].item() == 0.5


# ---------------------------------------------------------------------------- real processes


@pytest.mark.slow
def test_hopnet_launch_runs_partial_reduce_on_four_processes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    iterations = 20
    result = run_launch(["--nproc", "4", "--protocol", "partial-reduce", "--group-size", "2", "--weights",
                         "dynamic", "--run-dir", str(run_dir), str(EXAMPLES / "synthetic.py"),
                         "--compute-ms", "5", "--model-mb", "0.01", "--iterations", str(iterations),
                         "--warmup", "2"], timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    records = all_records(run_dir)
    assert not [r for r in records if r["event"] == "error"]
    groups = [r for r in records if r["event"] == GROUP_RECORD]
    assert len(groups) == 4 * iterations  # every worker averaged once per iteration
    by_gid: dict[int, list[dict]] = {}
    for record in groups:
        by_gid.setdefault(record["gid"], []).append(record)
    last_gids = sorted(max(r["gid"] for r in groups if r["rank"] == rank) for rank in range(4))
    for gid, members_records in by_gid.items():
        members = members_records[0]["members"]
        assert sorted(r["rank"] for r in members_records) == members, gid  # all members, once each
        assert len(members) == 2 or gid > last_gids[2]  # alone only once the three others finished
        assert len({r["counter"] for r in members_records}) == 1
    assert len({tuple(rs[0]["members"]) for rs in by_gid.values()}) >= 3  # not a frozen pairing

"""AD-PSGD (--protocol ad-psgd): the bipartite split, atomic pairwise averaging, how a run
ends, failure paths, and its throughput against allreduce in the simulator."""

from __future__ import annotations

import asyncio
import random
import threading
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hopnet import ConfigError, Graph, ProtocolConfig, Worker
from hopnet.config_checks import check_config_for_graph
from hopnet.errors import PeerFailure, WaitTimeout
from hopnet.protocols import make_protocol
from hopnet.protocols.adpsgd.protocol import AdPsgdProtocol, Averaging
from hopnet.runtime.clock import Clock
from hopnet.runtime.events import EventLog
from hopnet.runtime.node import Node
from hopnet.sim.engine import ComputeModel, SimSpec, simulate
from hopnet.sim.vloop import VirtualTimeLoop
from hopnet.transports.inproc import InprocNetwork, LinkModel


# ---------------------------------------------------------------------------- the bipartite split


def test_ring_of_four_splits_into_actives_and_passives() -> None:
    assert Graph.ring(4).two_colouring() == ((0, 2), (1, 3))
    assert Graph.by_name("torus:2x4").two_colouring() == ((0, 2, 5, 7), (1, 3, 4, 6))


def test_an_odd_ring_is_refused_in_one_line_naming_its_cycle() -> None:
    with pytest.raises(ConfigError) as info:
        check_config_for_graph(ProtocolConfig(protocol="ad-psgd"), Graph.by_name("ring:5"))
    assert str(info.value).startswith("ring:5 is not bipartite: odd cycle 0-1-2-3-4-0 ")
    assert "\n" not in str(info.value)


def test_a_one_way_graph_is_refused() -> None:
    graph = Graph(4, [(0, 1), (1, 2), (2, 3), (3, 0)], name="directed")
    with pytest.raises(ConfigError, match="undirected graph: directed has one-way edges"):
        check_config_for_graph(ProtocolConfig(protocol="ad-psgd"), graph)


def test_hop_options_are_refused_with_adpsgd() -> None:
    with pytest.raises(ConfigError, match=r"--max-ig: option\(s\) that --protocol ad-psgd does not take"):
        ProtocolConfig(protocol="ad-psgd", max_ig=3)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 9), st.data())
def test_two_colouring_is_a_split_or_an_odd_cycle(n: int, data: st.DataObject) -> None:
    pairs = data.draw(st.sets(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=20))
    edges = [(i, i + 1) for i in range(n - 1)]  # connected
    edges += [(i, j) for i, j in pairs if i != j]
    graph = Graph(n, edges + [(j, i) for i, j in edges])
    result = graph.two_colouring()
    if isinstance(result, tuple):
        side = {v: 0 for v in result[0]} | {v: 1 for v in result[1]}
        assert sorted(side) == list(range(n)) and 0 in result[0]
        assert all(side[i] != side[j] for i, j in graph.edges if i != j)
    else:
        cycle = result
        assert cycle[0] == cycle[-1] and len(cycle) % 2 == 0  # closed, an odd number of edges
        assert len(set(cycle[:-1])) == len(cycle) - 1  # simple
        assert all(graph.has_edge(a, b) for a, b in zip(cycle, cycle[1:]))


def test_simulate_refuses_an_odd_ring_before_starting(capsys: pytest.CaptureFixture[str]) -> None:
    from hopnet.cli.main import main

    assert main(["simulate", "--graph", "ring:5", "--protocol", "ad-psgd"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "hopnet simulate: error: ring:5 is not bipartite: odd cycle 0-1-2-3-4-0 "
        "(--protocol ad-psgd needs active and passive sides with every edge between them)"]


# ---------------------------------------------------------------------------- a virtual-time harness

Apply = Callable[[int, int, torch.Tensor], None]


def run_virtual(graph: Graph, params: list[torch.Tensor], iterations: int | list[int], *,
                compute: Callable[[int, int], float] = lambda rank, k: 0.01,
                apply: Apply | None = None, observer: Callable[[Averaging], None] | None = None,
                skip_ranks: tuple[int, ...] = (), stop_at: dict[int, int] | None = None,
                timeout_s: float = 30.0, link: LinkModel | None = None,
                script: Callable[[list[Node]], None] | None = None) -> list[Node]:
    """Run AD-PSGD workers (all but ``skip_ranks``, which never start) on a virtual-time loop.

    ``iterations`` per rank (or one count for all); ``apply(rank, k, params)`` is the step."""
    counts = iterations if isinstance(iterations, list) else [iterations] * graph.n
    stops = stop_at or {}
    config = ProtocolConfig(protocol="ad-psgd", seed=7, timeout_s=timeout_s)
    loop = VirtualTimeLoop()
    network = InprocNetwork(link or LinkModel(latency_s=0.001))
    nodes: list[Node] = []

    async def main() -> None:
        for rank in range(graph.n):
            protocol = make_protocol(config, params[rank])
            protocol.observer = observer
            protocol.final_iteration = counts[rank] - 1
            nodes.append(Node(rank, graph, network.transport(rank, frozenset(graph.peers(rank))), protocol,
                              clock=Clock(timeout_s), events=EventLog(keep=True)))
        running = [node for node in nodes if node.rank not in skip_ranks]
        for node in running:
            await node.open()
        if script is not None:
            script(nodes)

        async def work(node: Node) -> None:
            rank, protocol = node.rank, node.protocol
            await protocol.start()
            try:
                for k in range(counts[rank]):
                    if rank in stops and k >= stops[rank]:
                        break
                    await asyncio.sleep(compute(rank, k))
                    step = None if apply is None else (lambda k=k: apply(rank, k, params[rank]))
                    await node.run_step(step, last=k == counts[rank] - 1)
            finally:
                await node.close()

        await asyncio.gather(*(work(node) for node in running))

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    return nodes


def records(node: Node, event: str) -> list[dict]:
    return [r for r in node.events.records if r["event"] == event]


# ---------------------------------------------------------------------------- averaging


def test_one_averaging_preserves_the_pair_sum_exactly_with_dyadic_values() -> None:
    active = torch.tensor([1.5, -2.25, 3.0, 0.125], dtype=torch.float64)
    passive = torch.tensor([0.5, 0.25, 1.0, -0.375], dtype=torch.float64)
    total = active + passive
    nodes = run_virtual(Graph.ring(2), [active, passive], 1)
    assert torch.equal(active, torch.tensor([1.0, -1.0, 2.0, -0.125], dtype=torch.float64))
    assert torch.equal(active, passive)
    assert torch.equal(active + passive, total)
    assert nodes[0].protocol.partners == [1]
    assert records(nodes[0], "role")[0]["role"] == "active" and records(nodes[1], "role")[0]["role"] == "passive"
    assert records(nodes[0], "iteration")[0]["partner"] == 1


def test_long_random_run_keeps_every_invariant() -> None:
    """torus:2x4, random compute times, gradient steps of dyadic sizes. Every model state is
    explained by a sequence of atomic events: each averaging starts from the passive's and the
    active's exact last states (no half-update, no two averagings at once), both end on the same
    mean, and the sum of all models changes only by the steps applied."""
    graph = Graph.by_name("torus:2x4")
    n, dim, iterations = graph.n, 64, 150
    gen = torch.Generator().manual_seed(3)
    params = [torch.randint(-64, 64, (dim,), generator=gen).double() / 8 for _ in range(n)]
    expected = [p.clone() for p in params]  # each model's state after its last event
    initial_sum = torch.stack(params).sum(0)
    applied = torch.zeros(dim, dtype=torch.float64)
    per_pair: Counter[tuple[int, int]] = Counter()
    rng = random.Random(5)
    slow = {rank: rng.choice([1.0, 1.0, 3.0]) for rank in range(n)}
    events: list[str] = []

    def apply(rank: int, k: int, x: torch.Tensor) -> None:
        nonlocal applied
        assert torch.equal(x, expected[rank]), f"rank {rank} changed outside an event before step {k}"
        step = torch.full((dim,), (rank + 1) / 64, dtype=torch.float64)
        x.sub_(step)
        applied += step
        expected[rank] = x.clone()
        events.append("apply")

    def observe(avg: Averaging) -> None:
        assert torch.equal(avg.passive_before, expected[avg.passive]), "passive seen mid-way or by two at once"
        assert torch.equal(avg.active_model, expected[avg.active]), "active changed during its request"
        exact = (avg.active_model + avg.passive_before) / 2
        assert torch.equal(avg.mean, exact)
        expected[avg.passive] = avg.mean.clone()
        expected[avg.active] = avg.mean.clone()
        per_pair[(avg.active, avg.passive)] += 1
        events.append("average")

    nodes = run_virtual(graph, params, iterations, apply=apply, observer=observe,
                        compute=lambda rank, k: rng.expovariate(100.0) * slow[rank])
    actives, passives = graph.two_colouring()
    for rank in range(n):
        assert torch.equal(params[rank], expected[rank]), f"rank {rank} ended off its last event"
    # Averagings only move mass between models; the steps remove exactly what they applied.
    torch.testing.assert_close(torch.stack(params).sum(0), initial_sum - applied, rtol=0, atol=1e-9)
    for a in actives:
        partners = nodes[a].protocol.partners
        assert len(partners) == iterations and set(partners) == set(graph.peers(a))
        assert all(per_pair[(a, p)] == partners.count(p) for p in graph.peers(a))
    served = sum(nodes[p].protocol.served for p in passives)
    assert served == len(actives) * iterations == events.count("average")
    assert events.count("apply") == n * iterations
    # Passives served while they computed: some served averagings fall inside their iterations.
    assert any(r.get("served", 0) > 0 for p in passives for r in records(nodes[p], "iteration")[:-1])


def test_a_passive_queues_concurrent_requests_and_serves_them_one_by_one() -> None:
    """Star K(3,1): three actives all pick passive 3 at the same instant."""
    graph = Graph(4, [(a, 3) for a in range(3)] + [(3, a) for a in range(3)])
    params = [torch.full((8,), float(v), dtype=torch.float64) for v in (8, 16, 32, 0)]
    seen: list[tuple[int, float, float]] = []
    nodes = run_virtual(graph, params, 1, observer=lambda avg: seen.append(
        (avg.active, avg.passive_before[0].item(), avg.mean[0].item())))
    assert sorted(a for a, _, _ in seen) == [0, 1, 2]
    value = 0.0  # the passive's model, one averaging after the other, in the order served
    for active, before, mean in seen:
        assert before == value and mean == (value + 8 * 2 ** active) / 2
        value = mean
        assert params[active][0].item() == mean
    assert params[3][0].item() == value
    assert nodes[3].protocol.served == 3


def test_passives_keep_serving_until_every_active_said_bye() -> None:
    """Actives run 40 iterations, passives 5: the passives' last step returns only once the
    actives are done, having served every one of their averagings."""
    graph = Graph.ring(4)
    params = [torch.zeros(4, dtype=torch.float64) for _ in range(4)]
    nodes = run_virtual(graph, params, [40, 5, 40, 5])
    assert nodes[1].protocol.served + nodes[3].protocol.served == 80
    for passive in (1, 3):
        last = records(nodes[passive], "iteration")[-1]
        assert last["iter"] == 4 and last["wait_updates_s"] > 0
        left = {r["peer"] for r in records(nodes[passive], "peer_left")}
        assert left == {0, 2}


# ---------------------------------------------------------------------------- failures


def test_a_passive_that_leaves_early_is_skipped_with_its_name() -> None:
    graph = Graph.ring(2)
    params = [torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)]
    nodes = run_virtual(graph, params, 10, stop_at={1: 3})
    active = nodes[0].protocol
    averaged = active.partners.count(1)
    assert 1 <= averaged <= 3 and active.partners == [1] * averaged + [None] * (10 - averaged)
    skips = records(nodes[0], "averaging_skipped")
    assert len(skips) == 10 - averaged
    assert all(s["why"] in ("passive 1 left before serving the averaging", "no passive neighbour left")
               for s in skips)
    assert skips[-1]["why"] == "no passive neighbour left"
    assert nodes[1].protocol.served == averaged
    # Nothing served after the goodbye: the pair's sum is what the three averagings left.
    assert torch.equal(params[0], params[1])


def test_a_passive_that_dies_mid_averaging_fails_the_active_naming_it() -> None:
    """Passive 1 never runs; the active's node declares it dead while waiting for its reply."""
    graph = Graph.ring(2)
    params = [torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)]

    def kill_later(nodes: list[Node]) -> None:
        asyncio.get_running_loop().call_later(1.0, nodes[0].peer_dead, 1, 5.0)

    with pytest.raises(PeerFailure) as info:
        run_virtual(graph, params, 5, skip_ranks=(1,), script=kill_later)
    assert info.value.peer == 1 and info.value.peer_state == "dead"
    assert "passive partner 1 went silent (dead)" in str(info.value)


def test_a_silent_passive_times_out_naming_it() -> None:
    graph = Graph.ring(2)
    params = [torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)]
    with pytest.raises(WaitTimeout) as info:
        run_virtual(graph, params, 5, skip_ranks=(1,), timeout_s=3.0)
    assert str(info.value) == ("timed out waiting for the averaging reply of passive 1 from peer 1 (stalled) "
                               "in iteration 0 after 3.0s")


def test_a_passive_whose_actives_never_say_bye_times_out_naming_them() -> None:
    graph = Graph.ring(4)
    params = [torch.zeros(4, dtype=torch.float64) for _ in range(4)]
    with pytest.raises(WaitTimeout) as info:
        run_virtual(graph, params, 2, skip_ranks=(0, 2, 3), timeout_s=3.0)
    assert "requests or goodbyes from active neighbour(s) 0, 2 after the last iteration" in str(info.value)


def test_adpsgd_needs_a_flat_parameter_buffer() -> None:
    with pytest.raises(ConfigError, match="averages models"):
        AdPsgdProtocol(ProtocolConfig(protocol="ad-psgd"), None)


# ---------------------------------------------------------------------------- threads


def test_readers_on_another_thread_never_see_a_half_updated_passive() -> None:
    """Real threads: two actives and a passive over the in-process transport, a large model.
    A reader thread holding the worker's model lock must always find the passive's model
    constant (every state is) and equal to a state the passive actually went through."""
    graph = Graph(3, [(0, 1), (1, 0), (2, 1), (1, 2)])
    n, dim, steps = 3, 1 << 20, 40
    network = InprocNetwork()
    barrier = threading.Barrier(n)
    params = [torch.full((dim,), float(8 * r), dtype=torch.float64) for r in range(n)]
    passive_states = {params[1][0].item()}
    errors: dict[int, BaseException] = {}
    workers: dict[int, Worker] = {}
    started = threading.Event()
    done = threading.Event()
    readings: list[float] = []

    async def exchange(address: str) -> dict[int, str]:
        await asyncio.to_thread(barrier.wait)
        return {r: f"inproc://{r}" for r in range(n)}

    def train(rank: int) -> None:
        try:
            config = ProtocolConfig(protocol="ad-psgd", timeout_s=60)
            worker = Worker(rank=rank, graph=graph, config=config, params=params[rank],
                            transport=network.transport(rank, frozenset(graph.peers(rank))), exchange=exchange)
            workers[rank] = worker
            if rank == 1:
                worker.node.protocol.observer = lambda avg: passive_states.add(avg.mean[0].item())
                started.set()
            else:  # no averaging before the passive records its states (one served first went unrecorded)
                started.wait(60)
            x = params[rank]

            def step() -> None:
                x.sub_(0.25)
                if rank == 1:
                    passive_states.add(x[0].item())

            try:
                for _ in worker.iterations(steps):
                    torch.mm(torch.ones(64, 64), torch.ones(64, 64))  # a little compute
                    worker.step(step)
            finally:
                worker.close()
        except BaseException as exc:  # collected for the test to assert on
            errors[rank] = exc

    def read() -> None:
        started.wait(60)
        lock = workers[1].model_lock
        while not done.is_set():
            with lock:
                value = params[1][0].item()
                assert bool((params[1] == value).all()), "half-updated model seen"
                assert value in passive_states, "a state the passive never had"
            readings.append(value)

    threads = [threading.Thread(target=train, args=(r,)) for r in range(n)]
    reader = threading.Thread(target=read)
    for t in threads + [reader]:
        t.start()
    for t in threads:
        t.join(timeout=120)
    done.set()
    reader.join(timeout=30)
    assert not any(t.is_alive() for t in threads + [reader])
    assert not errors, errors
    assert len(set(readings)) > 1  # the reader did watch the model change
    assert workers[1].node.protocol.served == 2 * steps
    # Averagings move mass, steps remove it: 8 * (0 + 1 + 2) - 3 * steps * 0.25 per element.
    total = params[0] + params[1] + params[2]
    torch.testing.assert_close(total, torch.full((dim,), 24.0 - 0.75 * steps, dtype=torch.float64),
                               rtol=0, atol=1e-9)


# ---------------------------------------------------------------------------- throughput


@pytest.mark.parametrize("slow_rank", [0, 1])
def test_with_one_worker_5x_slower_adpsgd_outruns_allreduce(slow_rank: int) -> None:
    """ring:8, 10 MB model at 10 Gbit/s, 20 ms compute: allreduce goes at the slow worker's
    pace; in AD-PSGD only the slow worker (an active or a passive) is slow."""
    graph = Graph.ring(8)
    common = dict(graph=graph, iterations=30, compute=ComputeModel.parse("20"),
                  link=LinkModel(latency_s=0.0001, bytes_per_s=10e9 / 8), model_bytes=10_000_000)
    rates = {}
    for protocol in ("allreduce", "ad-psgd"):
        config = ProtocolConfig(protocol=protocol, slowdown=[f"rank={slow_rank}:5"])
        result = simulate(SimSpec(config=config, **common))
        assert result.iterations == [30] * 8
        # Up to each worker's second-to-last step: a passive's last step waits for its actives.
        rates[protocol] = sum((len(t) - 1) / t[-2] for t in result.finish_times)
    assert rates["ad-psgd"] / rates["allreduce"] >= 1.5, rates
    assert rates["allreduce"] < 8 * 10  # everyone at the straggler's pace: about 100 ms an iteration

"""eager-SGD's partial all-reduce in one process: in-process transport, virtual time."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from hopnet import ConfigError, Graph, ProtocolConfig
from hopnet.errors import PeerFailure, WaitTimeout
from hopnet.protocols import make_protocol
from hopnet.protocols.eager.protocol import EagerProtocol, activation_targets, majority_initiator
from hopnet.runtime.clock import Clock
from hopnet.runtime.node import Node
from hopnet.sim.engine import SimSpec, simulate
from hopnet.sim.vloop import VirtualTimeLoop
from hopnet.transports.inproc import InprocNetwork, LinkModel
from hopnet.wire import Message

ComputeFn = Callable[[int, int], float]
GradientFn = Callable[[int, int, torch.Tensor], None]


def dyadic_gradient(rank: int, step: int, out: torch.Tensor) -> None:
    """Small integers: every sum of them is exact in floating point."""
    gen = torch.Generator().manual_seed(7919 * rank + step)
    out.copy_(torch.randint(-64, 65, out.shape, generator=gen).to(out.dtype))


@dataclass
class Run:
    nodes: list[Node]
    params: list[torch.Tensor]
    # per rank, per step: (round the step consumed, the gradient it applied, params after the step)
    steps: list[list[tuple[int | None, torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    step_end: list[list[float]] = field(default_factory=list)
    errors: dict[int, BaseException] = field(default_factory=dict)

    @property
    def protocols(self) -> list[EagerProtocol]:
        return [node.protocol for node in self.nodes]  # type: ignore[misc]


def run_workers(n: int, steps: int, config: ProtocolConfig, *, compute: ComputeFn,
                gradient: GradientFn = dyadic_gradient, numel: int = 37, lr: float = 0.25,
                stop_at: dict[int, int] | None = None, link: LinkModel | None = None,
                dtype: torch.dtype = torch.float64, apply_fn: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
                params_init: Callable[[int], torch.Tensor] | None = None) -> Run:
    """``n`` workers on one virtual-time loop, each computing for ``compute(rank, step)`` seconds
    and then stepping with ``gradient(rank, step)``; ``stop_at[rank]`` makes a rank quit early
    without a goodbye (it stays silent)."""
    stop_at = stop_at or {}
    graph = Graph.ring(n)

    async def main() -> Run:
        network = InprocNetwork(link or LinkModel(latency_s=1e-3))
        params = [params_init(r) if params_init else torch.zeros(numel, dtype=dtype) for r in range(n)]
        grads = [torch.zeros_like(p) for p in params]
        nodes = [Node(r, graph, network.transport(r, frozenset(graph.peers(r))),
                      make_protocol(config, params[r], grads[r]), clock=Clock(config.timeout_s),
                      timer=asyncio.get_running_loop().time)
                 for r in range(n)]
        run = Run(nodes, params, [[] for _ in range(n)], [[] for _ in range(n)])
        for node in nodes:
            await node.open()

        async def trainer(rank: int) -> None:
            node = nodes[rank]
            try:
                await node.protocol.start()
                for k in range(steps):
                    if k == stop_at.get(rank):
                        return
                    await asyncio.sleep(compute(rank, k))
                    gradient(rank, k, grads[rank])

                    def apply(rank: int = rank) -> None:
                        if apply_fn is not None:
                            apply_fn(rank, params[rank], grads[rank])
                        else:
                            params[rank].sub_(lr * grads[rank])

                    await node.run_step(apply, last=k == steps - 1)
                    proto = node.protocol
                    run.steps[rank].append((getattr(proto, "last_round", None), grads[rank].clone(), params[rank].clone()))
                    run.step_end[rank].append(asyncio.get_running_loop().time())
                await node.close()
            except BaseException as exc:  # collected for the test to assert on
                run.errors[rank] = exc
                await node.close(leave=False)

        await asyncio.gather(*(trainer(r) for r in range(n)))
        return run

    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def eager(mode: str, **options: object) -> ProtocolConfig:
    return ProtocolConfig(protocol="eager-sgd", eager_mode=mode, timeout_s=30, **options)  # type: ignore[arg-type]


def straggling(rank_delay: dict[int, float], base: float = 0.01) -> ComputeFn:
    return lambda rank, k: base + rank_delay.get(rank, 0.0)


def random_straggler(n: int, base: float, extra: float, seed: int = 0) -> ComputeFn:
    """Each step one rank (the same choice on every rank) gets ``extra`` seconds."""
    return lambda rank, k: base + (extra if (k * 2654435761 + seed) % n == rank else 0.0)


# ---------------------------------------------------------------------- the activation trees
@pytest.mark.parametrize("p", [1, 2, 3, 5, 6, 8, 13, 16])
def test_activation_reaches_every_rank_once_within_log2_p_hops_from_any_root(p: int) -> None:
    for root in range(p):
        depth = {root: 0}
        frontier = [root]
        while frontier:
            nxt = []
            for rank in frontier:
                for target in activation_targets(rank, root, p):
                    assert target not in depth, f"root {root}: rank {target} reached twice"
                    depth[target] = depth[rank] + 1
                    nxt.append(target)
            frontier = nxt
        assert sorted(depth) == list(range(p))
        # A rank's hop count is the number of set bits of its rank relative to the root.
        assert max(depth.values()) <= math.ceil(math.log2(p)) if p > 1 else depth == {0: 0}
        if p & (p - 1) == 0:
            assert max(depth.values()) == p.bit_length() - 1


def test_majority_initiator_is_a_function_of_seed_and_round_only() -> None:
    draws = [majority_initiator(3, r, 8) for r in range(400)]
    assert draws == [majority_initiator(3, r, 8) for r in range(400)]
    assert set(draws) == set(range(8))
    assert draws != [majority_initiator(4, r, 8) for r in range(400)]


# ---------------------------------------------------------------------- invariants
@pytest.mark.parametrize("mode", ["solo", "majority"])
def test_nothing_is_lost_or_counted_twice_and_members_get_identical_results(mode: str) -> None:
    n, steps = 5, 30

    def compute(rank: int, k: int) -> float:  # uneven and changing: many stale contributions
        return 0.002 + 0.004 * ((rank * 7 + k * 3) % 5)

    run = run_workers(n, steps, eager(mode), compute=compute)
    assert not run.errors, run.errors
    stale = 0
    for rank, proto in enumerate(run.protocols):
        computed = torch.zeros(37, dtype=torch.float64)
        for k in range(steps):
            g = torch.zeros(37, dtype=torch.float64)
            dyadic_gradient(rank, k, g)
            computed += g
        assert proto.pend is not None and proto.contributed is not None
        assert torch.equal(proto.contributed + proto.pend, computed), f"rank {rank}"
        assert torch.equal(proto.computed, computed)
        stale += proto.stale_calls
    by_round: dict[int, torch.Tensor] = {}
    for rank in range(n):
        for round_id, applied, _ in run.steps[rank]:
            assert round_id is not None
            if round_id in by_round:
                assert torch.equal(applied, by_round[round_id]), f"rank {rank}, round {round_id}"
            else:
                by_round[round_id] = applied
    actives = run.protocols[0].active_per_round
    assert all(p.active_per_round == actives for p in run.protocols), "ranks disagree on active counts"
    assert len(actives) == run.protocols[0].executed
    assert min(actives) < n, "the skew should have made some rounds partial"
    assert all(1 <= a <= n for a in actives)
    if mode == "solo":
        assert stale > 0


def test_the_result_is_the_sum_of_contributions_divided_by_p() -> None:
    """Round by round: P x result == what the members put in (dyadic values, P = 4: exact)."""
    n, steps = 4, 12
    run = run_workers(n, steps, eager("solo"), compute=straggling({2: 0.025}))
    assert not run.errors, run.errors
    results: dict[int, torch.Tensor] = {}
    for rank in range(n):
        for round_id, applied, _ in run.steps[rank]:
            results[round_id] = applied
    # Every round's result was consumed by somebody (solo: its initiator always takes it).
    assert sorted(results) == list(range(run.protocols[0].executed))
    contributed = sum(p.contributed for p in run.protocols)
    assert torch.equal(sum(results.values()) * n, contributed)


@pytest.mark.parametrize("mode", ["solo", "majority"])
def test_simultaneous_initiators_give_one_execution_per_round(mode: str) -> None:
    n, steps = 6, 10
    run = run_workers(n, steps, eager(mode), compute=lambda r, k: 0.01)
    assert not run.errors, run.errors
    for proto in run.protocols:
        assert proto.executed == steps  # one round per step, however many started it
        assert all(a == n for a in proto.active_per_round)
    if mode == "solo":
        assert all(p.initiated == steps for p in run.protocols)  # everyone started every round


# ---------------------------------------------------------------------- on time == allreduce
def model_step_runner(protocol_config: ProtocolConfig, n: int, steps: int) -> Run:
    """A small MLP on every rank, SGD with momentum through the protocol, everyone on time."""
    torch.manual_seed(0)
    template = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    models = [torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)) for _ in range(n)]
    flats: list[torch.Tensor] = []
    optimizers = []
    from hopnet.params import flatten_parameters

    for m in models:
        m.load_state_dict(template.state_dict())
        flats.append(flatten_parameters(m))
        optimizers.append(torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.9))
    grads_of: dict[int, torch.Tensor] = {}
    loss_fn = torch.nn.CrossEntropyLoss()

    def gradient(rank: int, k: int, out: torch.Tensor) -> None:
        gen = torch.Generator().manual_seed(rank * 1000 + k)
        x, y = torch.randn(16, 5, generator=gen), torch.randint(3, (16,), generator=gen)
        model = models[rank]
        for p in model.parameters():
            p.grad = None
        loss_fn(model(x), y).backward()
        out.copy_(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        grads_of[rank] = out

    def apply(rank: int, params: torch.Tensor, grads: torch.Tensor) -> None:
        offset = 0
        for p in models[rank].parameters():
            p.grad = grads[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        optimizers[rank].step()

    return run_workers(n, steps, protocol_config, compute=lambda r, k: 0.01, gradient=gradient,
                       numel=flats[0].numel(), dtype=torch.float32, apply_fn=apply,
                       params_init=lambda r: flats[r])


@pytest.mark.parametrize("mode", ["solo", "majority"])
def test_with_everyone_on_time_eager_equals_allreduce_step_for_step(mode: str) -> None:
    n, steps = 4, 8
    baseline = model_step_runner(ProtocolConfig(protocol="allreduce", timeout_s=30), n, steps)
    ours = model_step_runner(eager(mode), n, steps)
    assert not baseline.errors and not ours.errors, (baseline.errors, ours.errors)
    for rank in range(n):
        for k in range(steps):
            _, g_ref, p_ref = baseline.steps[rank][k]
            _, g, p = ours.steps[rank][k]
            assert torch.equal(g, g_ref), f"rank {rank} step {k}: gradient differs"
            assert torch.equal(p, p_ref), f"rank {rank} step {k}: parameters differ"
    assert all(a == n for a in ours.protocols[0].active_per_round)
    first, last = baseline.steps[0][0][2], baseline.steps[0][-1][2]
    assert not torch.equal(first, last)  # it did train


# ---------------------------------------------------------------------- modes under a straggler
def test_solo_initiator_never_waits_for_a_stragglers_compute() -> None:
    n, steps, slow = 4, 20, 0.2
    run = run_workers(n, steps, eager("solo"), compute=straggling({3: slow}, base=0.01))
    assert not run.errors, run.errors
    # The fast ranks finish all their steps long before the straggler finishes its first few.
    for rank in range(3):
        assert run.step_end[rank][-1] < 0.5, run.step_end[rank][-1]
    assert run.step_end[3][-1] > steps * slow
    actives = run.protocols[0].active_per_round
    assert min(actives) <= 3


def test_majority_waits_for_its_initiator_and_solo_does_not() -> None:
    n, steps = 8, 40
    compute = random_straggler(n, 0.04, 0.12)
    solo = run_workers(n, steps, eager("solo"), compute=compute)
    majority = run_workers(n, steps, eager("majority"), compute=compute)
    assert not solo.errors and not majority.errors, (solo.errors, majority.errors)

    def mean_active(run: Run) -> float:
        counts = list(run.protocols[0].active_per_round)
        return sum(counts) / len(counts)

    assert mean_active(majority) > mean_active(solo)
    # Every majority round started only once its designated initiator had deposited: the
    # initiator's own gradient is always fresh, so every round has at least one active process.
    assert min(majority.protocols[0].active_per_round) >= 1
    assert max(solo.step_end[r][-1] for r in range(n)) <= max(majority.step_end[r][-1] for r in range(n))


def test_full_sync_makes_the_models_identical_again() -> None:
    n, steps, every = 4, 12, 4
    run = run_workers(n, steps, eager("solo", full_sync_every=every), compute=straggling({1: 0.03}),
                      params_init=lambda r: torch.zeros(37, dtype=torch.float64))
    assert not run.errors, run.errors
    diverged = False
    for k in range(steps):
        models = [run.steps[r][k][2] for r in range(n)]
        same = all(torch.equal(m, models[0]) for m in models)
        if (k + 1) % every == 0:
            assert same, f"step {k}: models differ right after a full sync"
        diverged |= not same
    assert diverged, "the straggler should have made the models differ between syncs"


# ---------------------------------------------------------------------- failures
def test_a_departed_member_fails_the_round_naming_it() -> None:
    n = 4
    graph = Graph.ring(n)
    config = eager("solo")

    async def main() -> dict[int, BaseException]:
        network = InprocNetwork(LinkModel(latency_s=1e-3))
        grads = [torch.zeros(8, dtype=torch.float64) for _ in range(n)]
        nodes = [Node(r, graph, network.transport(r, frozenset(graph.peers(r))),
                      make_protocol(config, None, grads[r]), clock=Clock(30)) for r in range(n)]
        for node in nodes:
            await node.open()
        errors: dict[int, BaseException] = {}

        async def trainer(rank: int) -> None:
            node = nodes[rank]
            await node.protocol.start()
            try:
                for k in range(10):
                    await asyncio.sleep(0.01)
                    if rank == 2 and k == 3:  # leaves without finishing: says bye to everyone
                        for dst in range(n):
                            if dst != rank:
                                node.post(Message("bye", rank, dst, k - 1))
                        await node.flush()
                        await node.close(leave=False)
                        return
                    grads[rank].fill_(1.0)
                    await node.run_step(None, last=k == 9)
            except BaseException as exc:  # collected for the test
                errors[rank] = exc
            await node.close(leave=False)

        await asyncio.gather(*(trainer(r) for r in range(n)))
        return errors

    loop = VirtualTimeLoop()
    try:
        errors = loop.run_until_complete(main())
    finally:
        loop.close()
    assert sorted(errors) == [0, 1, 3]
    for exc in errors.values():
        assert isinstance(exc, PeerFailure), exc
        assert exc.peer == 2 and exc.peer_state == "departed"
        assert "rank 2" in str(exc)


def test_majority_waiting_for_a_silent_initiator_times_out_naming_it() -> None:
    n, config = 4, ProtocolConfig(protocol="eager-sgd", eager_mode="majority", timeout_s=5)
    first = majority_initiator(config.seed, 0, n)
    # The designated initiator of round 0 never reaches its first step (it stays silent).
    run = run_workers(n, 3, config, compute=lambda r, k: 0.01, stop_at={first: 0})
    waiting = [r for r in range(n) if r != first]
    assert sorted(run.errors) == waiting
    for rank in waiting:
        exc = run.errors[rank]
        assert isinstance(exc, WaitTimeout), exc
        assert f"initiator rank {first}" in str(exc) and exc.peer == first


# ---------------------------------------------------------------------- config and simulator
def test_eager_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="--eager-mode must be one of solo, majority"):
        ProtocolConfig(protocol="eager-sgd", eager_mode="quorum")
    with pytest.raises(ConfigError, match="--full-sync-every must be an integer >= 1"):
        ProtocolConfig(protocol="eager-sgd", full_sync_every=0)
    with pytest.raises(ConfigError, match=r"--eager-mode: option\(s\) that --protocol allreduce does not take \(taken by eager-sgd\)"):
        ProtocolConfig(protocol="allreduce", eager_mode="majority")
    with pytest.raises(ConfigError, match=r"--max-ig: option\(s\) that --protocol eager-sgd does not take"):
        ProtocolConfig(protocol="eager-sgd", max_ig=3)
    with pytest.raises(ConfigError, match="averages the models"):
        make_protocol(ProtocolConfig(protocol="eager-sgd", full_sync_every=2), None, torch.zeros(3))


def test_simulated_solo_beats_allreduce_under_a_random_straggler() -> None:
    n, iterations = 8, 40
    rates = {}
    for name, config in {"allreduce": ProtocolConfig(protocol="allreduce", slowdown=["random:4:0.125"]),
                         "solo": eager("solo", slowdown=["random:4:0.125"]),
                         "majority": eager("majority", slowdown=["random:4:0.125"])}.items():
        spec = SimSpec(graph=Graph.ring(n), config=config, iterations=iterations,
                       link=LinkModel(1e-4, 1e9), model_bytes=40_000)
        spec.compute = spec.compute.parse("40")
        result = simulate(spec)
        assert result.iterations == [iterations] * n, (name, result.iterations)
        rates[name] = sum(result.rates) / n
    assert rates["solo"] > 1.3 * rates["allreduce"], rates
    assert rates["majority"] > rates["allreduce"], rates


@pytest.mark.parametrize("seed", range(6))
def test_majority_rounds_with_full_syncs_never_wait_on_an_initiator_inside_the_sync(seed: int) -> None:
    """A rank that took a round's result late is a round behind: the others wait in iteration k
    for the round it is to start at its next call, while it waits in iteration k's full sync (a
    barrier). Its "in the sync" notice lets them start that round themselves."""
    n, steps = 4, 40
    run = run_workers(n, steps, eager("majority", full_sync_every=3),
                      compute=random_straggler(n, 0.01, 0.05, seed=seed))
    assert not run.errors, run.errors
    assert all(len(run.steps[r]) == steps for r in range(n))

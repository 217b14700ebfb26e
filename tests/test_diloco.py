"""DiLoCo (``--protocol diloco``): the outer step, its equivalence with ``allreduce``, streaming
fragments, the checkpointed outer state, and the simulator. Real-process runs are in
tests/test_diloco_processes.py."""

from __future__ import annotations

import time

import pytest
import torch

from hopnet import ConfigError, DistributedOptimizer, Graph, ProtocolConfig, Worker, analysis
from hopnet.protocols.diloco.options import DiLoCoOptions, sync_offsets
from hopnet.protocols.diloco.protocol import DiLoCoProtocol, OuterSGD, fragment_pieces
from hopnet.protocols.diloco.quorum import QuorumBook, QuorumDiLoCoProtocol
from hopnet.sim.engine import SimSpec, simulate
from hopnet.transports.inproc import LinkModel
from tests.support.threaded import Start, run_ranks, seeded


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.Tanh(),
                               torch.nn.Linear(7, 3))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank * 1000 + step)
    return torch.randn(16, 5, generator=gen), torch.randint(3, (16,), generator=gen)


def train(config: ProtocolConfig, n: int, steps: int, lr: float = 0.3) -> list[tuple[torch.Tensor, Worker]]:
    """``n`` ranks, plain SGD inner steps; each rank's final parameters and buffers, and its worker."""

    def body(rank: int, start: Start) -> tuple[torch.Tensor, Worker]:
        model = seeded(make_model)
        worker = start(model)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), worker)
        loss_fn = torch.nn.CrossEntropyLoss()
        for step in worker.iterations(steps):
            opt.zero_grad()
            x, y = batch(rank, step)
            loss_fn(model(x), y).backward()
            opt.step()
        state = torch.cat([t.detach().reshape(-1) for t in model.state_dict().values() if t.is_floating_point()])
        return state, worker

    return run_ranks(n, config, body, buffers=True)


def diloco(**options: object) -> ProtocolConfig:
    return ProtocolConfig(protocol="diloco", timeout_s=30, **options)


# ------------------------------------------------------------------ the outer step
@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_is_torch_sgd_on_the_mean_pseudo_gradient(nesterov: bool) -> None:
    """Three rounds of known ends on three ranks: the outer step is torch's SGD with momentum applied
    to the round's start with the mean pseudo-gradient as its gradient."""
    gen = torch.Generator().manual_seed(1)
    anchor = torch.randn(6, generator=gen, dtype=torch.float64)
    reference = torch.nn.Parameter(anchor.clone())
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=nesterov)
    outer = OuterSGD(0.7, 0.9, nesterov)
    buf = torch.zeros_like(anchor)
    for _ in range(3):
        ends = [anchor - torch.randn(6, generator=gen, dtype=torch.float64) for _ in range(3)]
        mean_delta = torch.stack([anchor - end for end in ends]).mean(0)
        reference.grad = mean_delta.clone()
        sgd.step()
        outer.step(anchor, mean_delta, buf)
        torch.testing.assert_close(anchor, reference.detach(), rtol=0, atol=1e-12)


def test_outer_step_without_momentum_at_lr_1_is_the_mean_of_the_ends() -> None:
    anchor = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    ends = [torch.tensor([0.0, 0.0, 4.0], dtype=torch.float64), torch.tensor([2.0, -6.0, 5.0], dtype=torch.float64)]
    mean_delta = torch.stack([anchor - e for e in ends]).mean(0)
    OuterSGD(1.0, 0.0, True).step(anchor, mean_delta, torch.zeros(3, dtype=torch.float64))
    torch.testing.assert_close(anchor, torch.stack(ends).mean(0))
    # A smaller outer lr moves the start toward the mean by that fraction, no further.
    start = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    half = start.clone()
    OuterSGD(0.5, 0.0, True).step(half, mean_delta, torch.zeros(3, dtype=torch.float64))
    torch.testing.assert_close(half, (start + torch.stack(ends).mean(0)) / 2)


def test_fragments_cover_each_flat_once_and_keep_the_buffers_apart() -> None:
    pieces = fragment_pieces([10, 3], [7, 0], 3)
    covered = {(p.flat, i) for frag in pieces for p in frag for i in range(p.start, p.stop)}
    assert covered == {(0, i) for i in range(10)} | {(1, i) for i in range(3)}
    assert sum(p.stop - p.start for frag in pieces for p in frag) == 13
    for frag in pieces:
        for p in frag:
            assert p.start <= p.params_stop <= p.stop
            assert p.params_stop == min(max(7 if p.flat == 0 else 0, p.start), p.stop)
    assert sync_offsets(10, 2) == [0, 5] and sync_offsets(6, 4) == [0, 1, 3, 4]


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="--fragments 4 must be at most --local-steps 2"):
        DiLoCoOptions(local_steps=2, fragments=4)
    with pytest.raises(ConfigError, match="--outer-momentum must be < 1"):
        DiLoCoOptions(outer_momentum=1.0)
    with pytest.raises(ConfigError, match="--overlap-steps 5 must be below --local-steps 5"):
        DiLoCoOptions(local_steps=5, overlap_steps=5)
    assert DiLoCoOptions(local_steps=8, fragments=2).overlap() == 1 and DiLoCoOptions().overlap() == 0
    with pytest.raises(ConfigError, match="taken by diloco"):
        ProtocolConfig(protocol="allreduce", outer_lr=0.5)


# ------------------------------------------------------------------ with workers
def test_h1_outer_lr1_without_momentum_equals_allreduce() -> None:
    """H = 1, outer lr 1, no momentum: each sync averages the ranks' models after one plain SGD step,
    which is the step on the averaged gradient ``allreduce`` takes (buffers: averaged by both)."""
    n, steps = 3, 6
    ours = train(diloco(local_steps=1, outer_lr=1.0, outer_momentum=0.0), n, steps)
    reference = train(ProtocolConfig(protocol="allreduce", timeout_s=30, buffers="average", bucket_mb=0), n, steps)
    for state, _ in ours:
        assert torch.equal(state, ours[0][0])
        torch.testing.assert_close(state, reference[0][0], rtol=1e-5, atol=1e-6)
    assert not torch.equal(ours[0][0], torch.cat([t.detach().reshape(-1) for t in seeded(make_model).state_dict()
                                                  .values() if t.is_floating_point()]))
    assert ours[0][1].node.protocol.summary()["outer_steps"] == steps


def test_ranks_train_alone_between_syncs_and_end_identical_after_one() -> None:
    """H = 4 over 8 steps: two outer steps, the models identical after the last one (which ends the run),
    and distinct from the models of a run with H = 8 (one sync)."""
    results = train(diloco(local_steps=4), 2, 8)
    assert torch.equal(results[0][0], results[1][0])
    protocol = results[0][1].node.protocol
    assert isinstance(protocol, DiLoCoProtocol) and protocol.outer_steps == 2
    assert torch.equal(protocol.anchor[0], protocol.flats[0])
    once = train(diloco(local_steps=8), 2, 8)
    assert not torch.allclose(once[0][0], results[0][0])


@pytest.mark.parametrize("compress", ["none", "int8"])
def test_streaming_fragments_share_the_anchor_and_keep_the_overlapped_steps(compress: str) -> None:
    """Four fragments over H = 4 (one sync per iteration, each landing one step later): the anchors
    are identical on both ranks, every fragment took its outer steps, and the last iteration lands
    what is in flight and syncs every fragment, so both ranks end with the same model."""
    steps = 9
    results = train(diloco(local_steps=4, fragments=4, compress=compress), 2, steps)
    protocols = [w.node.protocol for _, w in results]
    assert all(isinstance(p, DiLoCoProtocol) for p in protocols)
    a, b = protocols
    assert isinstance(a, DiLoCoProtocol) and isinstance(b, DiLoCoProtocol)
    for x, y in zip(a.anchor, b.anchor):
        assert torch.equal(x, y)
    # Fragment f syncs after iteration t when (t + 1 + f) % 4 == 0, and every fragment after the last.
    assert a.outer_steps == sum(len(a.syncs_after(t)) for t in range(steps - 1)) + 4 == 12
    assert a.summary()["fragments"] == 4
    assert torch.equal(results[0][0], results[1][0])  # the last iteration syncs every fragment
    assert torch.isfinite(results[0][0]).all()


def test_outer_state_round_trips_through_a_checkpoint() -> None:
    results = train(diloco(local_steps=2), 2, 5)
    protocol = results[0][1].node.protocol
    assert isinstance(protocol, DiLoCoProtocol)
    assert protocol.checkpoint_state() is protocol
    saved = protocol.state_dict()
    assert saved["outer_steps"] == 3 and saved["momentum"][0].abs().sum() > 0
    fresh = DiLoCoProtocol(protocol.config, protocol.options, torch.zeros_like(protocol.flats[0]))
    fresh.load_state_dict({k: (list(v) if isinstance(v, list) else v) for k, v in saved.items()})
    assert torch.equal(fresh.momentum[0], saved["momentum"][0]) and fresh.outer_steps == 3
    with pytest.raises(ConfigError, match="does not fit this model"):
        DiLoCoProtocol(protocol.config, protocol.options, torch.zeros(3)).load_state_dict(saved)


# ------------------------------------------------------------------ the simulator
@pytest.mark.parametrize("options,waits_at", [
    ({"local_steps": 5}, [4, 9, 14, 19]),
    # Fragment 0 syncs after 3, 7, ...; fragment 1 after 1, 5, ...; each lands one iteration later.
    ({"local_steps": 4, "fragments": 2, "compress": "int8"}, [2, 4, 6, 8, 10, 12, 14, 16, 18, 19]),
])
def test_diloco_runs_in_the_simulator_and_waits_only_at_syncs(options: dict[str, object],
                                                              waits_at: list[int]) -> None:
    n, iterations = 4, 20
    link = LinkModel(latency_s=0.001, bytes_per_s=1e8)
    result = simulate(SimSpec(Graph.ring(n), diloco(**options), iterations, model_bytes=1 << 22, link=link,
                              keep_events=True))
    assert result.iterations == [iterations] * n
    assert result.events is not None
    waits = [r["iter"] for r in result.events[0] if r.get("event") == "iteration" and r.get("wait_updates_s")]
    assert waits == waits_at
    baseline = simulate(SimSpec(Graph.ring(n), ProtocolConfig(protocol="allreduce"), iterations,
                                model_bytes=1 << 22, link=link))
    assert result.virtual_time < baseline.virtual_time / 2


@pytest.mark.parametrize("options", [{"local_steps": 5}, {"local_steps": 6, "fragments": 3, "overlap_steps": 1}])
def test_a_4x_slow_worker_stays_within_the_gap_bound(options: dict[str, object]) -> None:
    """Every sync is a barrier: the fast workers wait for the slow one there, so no worker gets more
    than the bound ahead of it (and they do get ahead between syncs)."""
    config = diloco(slowdown=["rank=2:4"], **options)
    result = simulate(SimSpec(Graph.ring(4), config, 30, param_dim=8, gap_matrix=True))
    assert result.iterations == [30] * 4
    bound = analysis.gap_bound(Graph.ring(4), config)
    assert bound is not None and result.max_gap is not None
    assert (result.max_gap <= bound).all(), (result.max_gap, bound)
    assert result.max_gap[:, 2].max() >= 2  # the others ran ahead of the slow one between syncs
    assert bound[0, 2] == (5 if len(options) == 1 else 3)


# ------------------------------------------------------------------ --outer-quorum
def test_quorum_book_closes_over_the_ready_and_bounds_the_staleness() -> None:
    book = QuorumBook(3, quorum=2, max_stale=1)
    assert not book.can_start()
    book.announce(0, 1)
    assert not book.can_start()  # one of the two
    book.announce(1, 1)
    assert book.can_start() and book.weight(0) == 1.0
    assert book.close(torch.tensor([1.0, 1.0, 0.0])) == [(0, 0), (1, 0)]
    assert book.staleness(2) == 1 and book.started_at[:2] == [1, 1]
    book.announce(0, 2)
    book.announce(1, 2)
    assert not book.can_start()  # without rank 2 its next pseudo-gradient would be 2 rounds stale
    book.announce(2, 1)
    assert book.can_start() and book.weight(2) == 0.5
    assert book.close(torch.tensor([1.0, 1.0, 0.5])) == [(0, 0), (1, 0), (2, 1)]
    book.announce(0, 3, done=True)
    book.announce(2, 2)
    assert book.can_start()  # rank 0 finished: it counts towards the quorum
    book.close(torch.tensor([1.0, 0.0, 1.0]))
    assert not book.finished()
    book.announce(1, 2, done=True)
    book.announce(2, 2, done=True)
    assert book.finished() and not book.can_start()


def test_quorum_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="--outer-quorum takes neither --fragments nor --overlap-steps"):
        DiLoCoOptions(local_steps=4, fragments=2, outer_quorum=2)
    with pytest.raises(ConfigError, match="--outer-quorum 5 is more than the 4 workers"):
        DiLoCoOptions(outer_quorum=5).check_ranks(4)
    config = diloco(outer_quorum=2)
    with pytest.raises(ConfigError, match="--outer-quorum cannot resume from a checkpoint yet"):
        QuorumDiLoCoProtocol(config, config.options_as(DiLoCoOptions), torch.zeros(4)).resume_at(10)


@pytest.mark.parametrize("stale", [0, 2])
def test_a_quorum_leaves_a_4x_slow_worker_behind_by_at_most_the_bound(stale: int) -> None:
    """4 workers, rank 2 4x slower, rounds over the first 3: with S = 2 the others finish over
    2.5x sooner than synchronous DiLoCo and the slow one's pseudo-gradients join later rounds, at
    most 2 rounds stale; with S = 0 every round waits for every worker."""
    def run(**quorum: int) -> tuple[list[float], list[dict[str, object]]]:
        config = diloco(local_steps=5, slowdown=["rank=2:4"], **quorum)
        result = simulate(SimSpec(Graph.ring(4), config, 40, param_dim=8, keep_events=True))
        assert result.iterations == [40] * 4 and result.events is not None
        rounds = [r for r in result.events[0] if r.get("event") == "outer_round"]
        return [t[-1] for t in result.finish_times], rounds

    synchronous, _ = run()
    times, rounds = run(outer_quorum=3, max_stale_rounds=stale)
    staleness = [s for r in rounds for s in r["staleness"]]  # type: ignore[attr-defined]
    assert max(staleness) == stale
    if stale:
        assert max(times[r] for r in (0, 1, 3)) * 2.5 < synchronous[0]
        assert any(len(r["took"]) == 3 for r in rounds)  # type: ignore[arg-type]
    else:
        assert all(r["took"] == [0, 1, 2, 3] for r in rounds) and times == synchronous


def test_a_quorum_run_trains_and_ends_with_one_model_on_every_rank() -> None:
    """3 threads, rank 2 slowed, rounds over the first 2: every pseudo-gradient is taken, none more
    than 1 round stale, and every rank ends with the anchor."""
    def body(rank: int, start: Start) -> tuple[torch.nn.Module, Worker]:
        model = seeded(make_model)
        worker = start(model)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.3), worker)
        loss_fn = torch.nn.CrossEntropyLoss()
        for step in worker.iterations(12):
            opt.zero_grad()
            x, y = batch(rank, step)
            loss_fn(model(x), y).backward()
            if rank == 2:
                time.sleep(0.02)
            opt.step()
        return model, worker

    results = run_ranks(3, diloco(local_steps=2, outer_quorum=2, max_stale_rounds=1), body, buffers=True)
    protocols = [w.node.protocol for _, w in results]
    for p in protocols:
        assert isinstance(p, QuorumDiLoCoProtocol)
        assert p.max_staleness <= 1
        assert p.book.taken == p.book.announced and p.book.rounds == protocols[0].book.rounds  # type: ignore
    # Closing, each served the rounds the others still needed, then took the last anchor.
    states = [torch.cat([t.detach().reshape(-1) for t in m.state_dict().values() if t.is_floating_point()])
              for m, _ in results]
    for state in states:
        assert torch.equal(state, states[0])
    assert not torch.equal(states[0], torch.cat([t.detach().reshape(-1) for t in seeded(make_model).state_dict()
                                                 .values() if t.is_floating_point()]))

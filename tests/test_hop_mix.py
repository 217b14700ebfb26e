"""Hop mixes by accumulation (hopnet/protocols/hop/mix_sums.py): the mix equals the weighted average of
the model and the updates used, computed directly, with backup workers and with staleness."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

import pytest
import torch

from hopnet import Graph, ProtocolConfig
from hopnet.protocols.hop.mix_sums import MixSums, RegionPool, mix_into, plan_regions
from hopnet.protocols.hop.protocol import PART, STREAM_WINDOW
from hopnet.transports.base import Transport
from hopnet.wire import Message, TensorSpec

from support.faults import FaultyTransport
from support.threaded import Start, run_ranks

SIZE = 1000


def _random_updates(gen: torch.Generator, count: int) -> list[list[torch.Tensor]]:
    return [[torch.randn(SIZE, generator=gen), torch.randn(7, generator=gen, dtype=torch.float64)]
            for _ in range(count)]


def _direct_mix(model: list[torch.Tensor], own: float, updates: list[list[torch.Tensor]],
                weights: list[float]) -> list[torch.Tensor]:
    return [(own * m + sum(w * u[i] for w, u in zip(weights, updates))) / (own + sum(weights))
            for i, m in enumerate(model)]


def _specs(tensors: list[torch.Tensor]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(t.dtype, tuple(t.shape)) for t in tensors)


@pytest.mark.parametrize("chunk_bytes", [None, 1024], ids=["whole", "streamed"])
def test_summed_updates_mix_as_the_weighted_average_computed_directly(chunk_bytes: int | None) -> None:
    """Whole updates (the receive buffer becomes the sum) and streamed ones (each chunk added into
    its region as it arrives, in any order) mix as the weighted average computed directly."""
    gen = torch.Generator().manual_seed(0)
    model = [torch.randn(SIZE, generator=gen), torch.randn(7, generator=gen, dtype=torch.float64)]
    updates = {k: _random_updates(gen, 3) for k in (4, 5)}
    weights = [0.2, 0.5, 1.5]  # e.g. graph weight x staleness factor
    own = 0.75
    regions = plan_regions(_specs(model), chunk_bytes)
    assert len(regions) == (2 if chunk_bytes is None else 4 + 1)  # 4000 B of float32 in 1 KiB chunks
    pool = RegionPool()
    sums = MixSums(regions, pool)
    for k, received in updates.items():
        for update, weight in zip(received, weights):
            if chunk_bytes is None:
                assert sums.add_whole(k, [t.clone() for t in update], weight) == []
            else:
                for index in reversed(range(len(regions))):
                    sums.add(k, index, regions[index].of(update).clone(), weight)
    assert len(sums) == 2

    summed = sums.pop(5)
    assert summed is not None and summed.chunks == 3 * len(regions)
    mixed = [m.clone() for m in model]
    mix_into(mixed, own, summed, regions)
    for got, want in zip(mixed, _direct_mix(model, own, updates[5], weights)):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    sums.release(summed)
    sums.discard_older_than(6)
    assert len(sums) == 0
    # every part went back to the pool: the next iteration's sums reuse it
    allocated = pool.allocated
    sums.add(7, 0, pool.take(regions[0]).fill_(1.0), 1.0)
    assert pool.allocated == allocated


def test_an_update_that_arrived_in_part_counts_in_the_regions_it_delivered() -> None:
    """A sender that stopped mid-stream (or whose update was still arriving at the reduce): each
    region is divided by the weights of the updates that delivered it, and a region nothing came
    for keeps the model's values."""
    gen = torch.Generator().manual_seed(1)
    model = [torch.randn(SIZE, generator=gen), torch.randn(7, generator=gen, dtype=torch.float64)]
    full, partial = _random_updates(gen, 2)
    regions = plan_regions(_specs(model), 1024)
    sums = MixSums(regions, RegionPool())
    own, w_full, w_partial = 0.4, 0.35, 0.25
    for index, region in enumerate(regions):
        if index not in (0, 3):  # nobody sent region 0; the full update's region 3 never came either
            sums.add(2, index, region.of(full).clone(), w_full)
    for index in (0, 1):  # the partial update stopped after its first two chunks
        sums.add(2, index, regions[index].of(partial).clone(), w_partial)
    summed = sums.pop(2)
    assert summed is not None
    mixed = [m.clone() for m in model]
    mix_into(mixed, own, summed, regions)

    def expect(index: int) -> torch.Tensor:
        mine = regions[index].of(model)
        if index == 0:
            return (own * mine + w_partial * regions[0].of(partial)) / (own + w_partial)
        if index == 1:
            return ((own * mine + w_full * regions[1].of(full) + w_partial * regions[1].of(partial))
                    / (own + w_full + w_partial))
        if index == 3:
            return mine
        return (own * mine + w_full * regions[index].of(full)) / (own + w_full)

    for index, region in enumerate(regions):
        assert torch.allclose(region.of(mixed), expect(index), rtol=1e-6, atol=1e-6), index


def test_a_whole_update_of_a_streamed_model_is_added_region_by_region() -> None:
    """A whole update where regions are chunks (a replacement's welcome) is copied out, not kept."""
    gen = torch.Generator().manual_seed(2)
    model = [torch.randn(SIZE, generator=gen), torch.randn(7, generator=gen, dtype=torch.float64)]
    update = _random_updates(gen, 1)[0]
    regions = plan_regions(_specs(model), 1024)
    sums = MixSums(regions, RegionPool())
    left = sums.add_whole(0, update, 0.5)
    assert len(left) == 1 and left[0] is update[0]  # the float64 tensor is one region: the sum took it
    summed = sums.pop(0)
    assert summed is not None
    mixed = [m.clone() for m in model]
    mix_into(mixed, 0.5, summed, regions)
    for got, m, u in zip(mixed, model, [update[0], (update[1] / 0.5)]):
        assert torch.allclose(got, (m + u) / 2, rtol=1e-6, atol=1e-6)


# With --staleness S >= 1 iteration 0 would not wait (an update of iteration -1 is fresh enough): S = 0
# takes the staleness path (the newest update of each sender kept until the reduce) and still waits.
@pytest.mark.parametrize("flags", [{"backup_workers": 1}, {"backup_workers": 1, "staleness": 0}],
                         ids=["backup-workers", "backup-workers+staleness"])
def test_a_worker_mixes_the_updates_that_came_as_their_weighted_average(flags: dict[str, int]) -> None:
    """Rank 0 of complete:4 needs 2 of its 3 in-neighbours' updates: rank 3 sends its own only once
    rank 0 has mixed (serial approach: the update leaves after the step), so rank 0 mixes itself,
    rank 1 and rank 2."""
    graph = Graph.complete(4)
    config = ProtocolConfig(protocol="hop", serial=True, timeout_s=30.0, **flags)
    mixed = threading.Event()
    initial = {r: torch.randn(SIZE, generator=torch.Generator().manual_seed(r)) for r in range(4)}

    def body(rank: int, start: Start) -> torch.Tensor:
        model = torch.nn.Linear(SIZE, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(initial[rank].view(1, SIZE))
        worker = start(model)
        for _ in worker.iterations(1):
            if rank == 3:
                assert mixed.wait(30.0)
            worker.step()
        if rank == 0:
            mixed.set()
        return model.weight.detach().view(SIZE).clone()

    results = run_ranks(4, config, body, graph=graph)
    used = (0, 1, 2)
    weights = {j: graph.weight(j, 0) for j in used}
    expected = sum(weights[j] * initial[j] for j in used) / sum(weights.values())
    assert torch.allclose(results[0], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("flags", [{}, {"backup_workers": 1}], ids=["standard", "backup-workers"])
def test_streamed_updates_mix_as_whole_ones(flags: dict[str, int]) -> None:
    """Hop on ring:4 with updates streamed in 1 KiB chunks (each its own message, added into its
    region as it comes) ends with the models Hop ends with when updates go whole."""
    initial = {r: torch.randn(SIZE, generator=torch.Generator().manual_seed(r)) for r in range(4)}

    def run(stream_mib: float) -> tuple[list[torch.Tensor], list[dict[str, int]]]:
        config = ProtocolConfig(protocol="hop", timeout_s=30.0, stream_mib=stream_mib, **flags)

        def body(rank: int, start: Start) -> tuple[torch.Tensor, dict[str, int]]:
            model = torch.nn.Linear(SIZE, 1, bias=False)
            with torch.no_grad():
                model.weight.copy_(initial[rank].view(1, SIZE))
            worker = start(model)
            for _ in worker.iterations(3):
                worker.step()
            summary = worker.node.protocol.summary()
            return model.weight.detach().view(SIZE).clone(), summary

        results = run_ranks(4, config, body)
        return [r[0] for r in results], [r[1] for r in results]

    whole, _ = run(0.0)
    streamed, summaries = run(1 / 1024)
    if not flags:  # every update of every iteration is used: the same mix, up to summation order
        for got, want in zip(streamed, whole):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    # weighted averages, whichever updates came whole or in part: inside the initial models' range
    stacked = torch.stack(list(initial.values()))
    low, high = stacked.min(0).values - 1e-6, stacked.max(0).values + 1e-6
    assert all(bool(((low <= m) & (m <= high)).all()) for m in streamed)
    assert all(s["buffers_allocated"] >= 4 for s in summaries)  # 4 regions of 1 KiB: the chunks were pooled


class _StopsMidStream(FaultyTransport):
    """Rank 1's link to rank 0 carries the first two chunks of its update and nothing after."""

    async def _outbound(self, msg: Message, send: Callable[[Message], Awaitable[None]]) -> None:
        if msg.kind == "update" and msg.dst == 0 and msg.meta and msg.meta.get(PART, 0) >= 2:
            return
        await super()._outbound(msg, send)


def test_a_streamed_update_cut_off_mid_stream_counts_in_the_regions_that_came() -> None:
    """complete:3, one backup worker, serial approach: rank 1's update reaches rank 0 in part (its
    first two chunks), then rank 2's whole; rank 0 mixes each region with the updates that delivered it."""
    graph = Graph.complete(3)
    config = ProtocolConfig(protocol="hop", serial=True, timeout_s=30.0, backup_workers=1, stream_mib=1 / 1024)
    rank1_done = threading.Event()
    initial = {r: torch.randn(SIZE, generator=torch.Generator().manual_seed(r)) for r in range(3)}

    def body(rank: int, start: Start) -> torch.Tensor:
        model = torch.nn.Linear(SIZE, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(initial[rank].view(1, SIZE))
        worker = start(model)
        for _ in worker.iterations(1):
            if rank == 2:  # after rank 1's chunks reached rank 0 (rank 1 mixed with rank 0's update)
                assert rank1_done.wait(30.0)
            worker.step()
        if rank == 1:
            rank1_done.set()
        return model.weight.detach().view(SIZE).clone()

    results = run_ranks(3, config, body, graph=graph,
                        wrap=lambda rank, inner: _StopsMidStream(inner) if rank == 1 else inner)
    w = {j: graph.weight(j, 0) for j in range(3)}
    cut = 2 * 256  # two chunks of 1 KiB of float32
    both = (w[0] * initial[0] + w[1] * initial[1] + w[2] * initial[2]) / (w[0] + w[1] + w[2])
    without_1 = (w[0] * initial[0] + w[2] * initial[2]) / (w[0] + w[2])
    assert torch.allclose(results[0][:cut], both[:cut], rtol=1e-5, atol=1e-6)
    assert torch.allclose(results[0][cut:], without_1[cut:], rtol=1e-5, atol=1e-6)


class _CountsChunksInFlight(FaultyTransport):
    """Counts, per receiver, how many chunks are inside ``send`` at once (each send takes a while)."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self.in_flight: dict[int, int] = {}
        self.most: dict[int, int] = {}

    async def send(self, msg: Message) -> None:
        if not (msg.kind == "update" and msg.meta and PART in msg.meta):
            await super().send(msg)
            return
        self.in_flight[msg.dst] = self.in_flight.get(msg.dst, 0) + 1
        self.most[msg.dst] = max(self.most.get(msg.dst, 0), self.in_flight[msg.dst])
        try:
            await asyncio.sleep(0.002)
            await super().send(msg)
        finally:
            self.in_flight[msg.dst] -= 1


def test_a_streamed_update_has_at_most_the_window_of_chunks_in_the_transport_per_peer() -> None:
    """Node.post_stream hands the transport STREAM_WINDOW chunks per out-neighbour at a time (the torch
    plane posts a receive per chunk whose header came: this bounds the receiver's buffers in flight)."""
    config = ProtocolConfig(protocol="hop", timeout_s=30.0, stream_mib=1 / 1024)
    counters: dict[int, _CountsChunksInFlight] = {}

    def wrap(rank: int, inner: Transport) -> Transport:
        counters[rank] = _CountsChunksInFlight(inner)
        return counters[rank]

    def body(rank: int, start: Start) -> None:
        worker = start(torch.nn.Linear(SIZE, 1, bias=False))
        for _ in worker.iterations(2):
            worker.step()

    run_ranks(4, config, body, wrap=wrap)
    assert all(set(c.most) == {(r - 1) % 4, (r + 1) % 4} for r, c in counters.items())
    assert all(c.most.values() and max(c.most.values()) == STREAM_WINDOW for c in counters.values())


def test_by_default_only_updates_of_256_mib_or_more_stream() -> None:
    from hopnet.protocols.hop.options import HopOptions

    mib = 1 << 20
    default = HopOptions()
    assert default.stream_bytes("auto", 100 * mib) == 0             # whole: streaming costs speed here
    assert default.stream_bytes("auto", 400 * mib) == 16 * mib      # chunks of the torch plane's threshold
    assert default.stream_bytes("zmq", 400 * mib) == 2 * mib
    assert HopOptions(stream_mib=4).stream_bytes("auto", 100 * mib) == 4 * mib
    assert HopOptions(stream_mib=0).stream_bytes("auto", 400 * mib) == 0

"""The ring all-reduce over the in-process transport: results, tags, groups, failures, virtual time."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest
import torch

from hopnet import ConfigError, Graph, PeerFailure, ProtocolConfig, WaitTimeout
from hopnet.collectives import Codec, check_group
from hopnet.collectives.ring import RingCollective
from hopnet.errors import ProtocolError
from hopnet.protocols import make_protocol
from hopnet.runtime.clock import Clock
from hopnet.runtime.node import Node
from hopnet.sim.vloop import VirtualTimeLoop
from hopnet.transports.inproc import InprocNetwork, LinkModel
from hopnet.wire import Header, Message, TensorSpec

Body = Callable[[list[Node]], Awaitable[Any]]


def run_nodes(n: int, body: Body, *, graph: Graph | None = None, link: LinkModel | None = None,
              chunk_bytes: int = 1 << 20, timeout_s: float = 30.0, virtual: bool = False) -> Any:
    """``n`` nodes on one event loop (a virtual-time one with ``virtual``), each with a ring collective."""
    graph = graph or Graph.ring(n)

    async def main() -> Any:
        network = InprocNetwork(link)
        config = ProtocolConfig(protocol="allreduce", timeout_s=timeout_s)
        nodes = [Node(r, graph, network.transport(r, frozenset(graph.peers(r))), make_protocol(config, None),
                      clock=Clock(timeout_s),
                      collective_factory=lambda node: RingCollective(node, chunk_bytes=chunk_bytes))
                 for r in range(n)]
        for node in nodes:
            await node.open()
        try:
            return await body(nodes)
        finally:
            for node in nodes:
                await node.close(leave=False)

    loop = VirtualTimeLoop() if virtual else asyncio.new_event_loop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def start_values(n: int, numel: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.randn(numel, generator=torch.Generator().manual_seed(100 + r), dtype=dtype) for r in range(n)]


async def allreduce_in(nodes: list[Node], group: Sequence[int], tensors: list[torch.Tensor], op: str,
                       tag: str) -> None:
    await asyncio.gather(*(nodes[r].collective.allreduce(group, tensors[r], op, tag=tag) for r in group))


def assert_reduced(group: Sequence[int], before: list[torch.Tensor], after: list[torch.Tensor], op: str) -> None:
    stacked = torch.stack([before[r].double() for r in group])
    expected = stacked.sum(0) if op == "sum" else stacked.mean(0)
    first = after[group[0]]
    for r in group:
        assert torch.equal(after[r], first), f"rank {r} differs from rank {group[0]}"
    torch.testing.assert_close(first.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,group", [(5, (0, 3)), (5, (4, 1, 2)), (5, (0, 1, 2, 3, 4)), (4, (2, 0, 3, 1))])
@pytest.mark.parametrize("op", ["mean", "sum"])
def test_group_results_equal_the_reduction_bit_for_bit_and_leave_others_alone(
        n: int, group: tuple[int, ...], op: str) -> None:
    before = start_values(n, 10_007)  # not a multiple of the group size
    tensors = [t.clone() for t in before]

    async def body(nodes: list[Node]) -> None:
        await allreduce_in(nodes, group, tensors, op, "t/0")

    run_nodes(n, body, chunk_bytes=4096)  # several chunks per segment: the pipelined path
    assert_reduced(group, before, tensors, op)
    for r in range(n):
        if r not in group:
            assert torch.equal(tensors[r], before[r])


def test_concurrent_disjoint_groups_and_back_to_back_rounds_never_mix() -> None:
    n = 7
    groups = [(0, 3), (6, 1, 4), (2, 5)]  # mostly not graph neighbours on ring:7
    rounds = 4
    before = start_values(n, 3001)
    tensors = [t.clone() for t in before]
    history: list[list[torch.Tensor]] = []

    async def body(nodes: list[Node]) -> None:
        for k in range(rounds):
            # Each round the values change, so a message from another round would show.
            for r in range(n):
                tensors[r].add_(float(k * 10 + r))
            history.append([t.clone() for t in tensors])
            await asyncio.gather(*(allreduce_in(nodes, g, tensors, "mean", f"g{i}/{k}")
                                   for i, g in enumerate(groups)))
        assert all(len(node.mailbox) == 0 for node in nodes)

    run_nodes(n, body, chunk_bytes=1024)
    last = history[-1]
    for g in groups:
        assert_reduced(g, last, tensors, "mean")


def test_back_to_back_rounds_of_one_group_run_ahead_without_mixing() -> None:
    """A member that runs ahead sends round k+1 while its neighbour still reads round k."""
    n = 3
    tensors = [torch.full((999,), float(r)) for r in range(n)]
    ones = [torch.ones(999) * (r + 1) for r in range(n)]

    async def member(node: Node, rounds: int) -> None:
        for k in range(rounds):
            target = tensors[node.rank] if k % 2 == 0 else ones[node.rank]
            await node.collective.allreduce((0, 1, 2), target, "sum", tag=f"r/{k}")
            if node.rank == 2:
                await asyncio.sleep(0.01)  # rank 2 lags: the others queue messages for it

    async def body(nodes: list[Node]) -> None:
        await asyncio.gather(*(member(node, 4) for node in nodes))

    run_nodes(n, body)
    # tensors: sum 3 after round 0, then 9 after round 2; ones: 6 after round 1, 18 after round 3.
    assert all(torch.equal(t, torch.full((999,), 9.0)) for t in tensors)
    assert all(torch.equal(t, torch.full((999,), 18.0)) for t in ones)


def test_tiny_tensors_and_single_member_groups() -> None:
    n = 4
    tensors = [torch.tensor([float(r)]) for r in range(n)]  # fewer elements than members
    empty = [torch.empty(0) for _ in range(n)]

    async def body(nodes: list[Node]) -> None:
        await allreduce_in(nodes, range(n), tensors, "sum", "tiny")
        await allreduce_in(nodes, range(n), empty, "mean", "empty")
        await nodes[2].collective.allreduce([2], tensors[2], "mean", tag="alone")

    run_nodes(n, body)
    assert [t.item() for t in tensors] == [6.0] * n


def test_receiving_reuses_buffers_round_after_round() -> None:
    n = 4

    async def body(nodes: list[Node]) -> list[int]:
        tensors = start_values(n, 50_000)
        counts = []
        for k in range(6):
            await allreduce_in(nodes, range(n), tensors, "mean", f"s/{k}")
            counts.append(sum(node.mailbox.pool.allocated for node in nodes))
        return counts

    counts = run_nodes(n, body, chunk_bytes=16_384)
    assert counts[0] > 0
    assert counts[-1] == counts[1], counts  # steady state: no new receive buffers


class HalfPrecision(Codec):
    """A lossy codec that changes the dtype on the wire (like issue 8's trunc16)."""

    name = "fp16"

    def payload_specs(self, numel: int, dtype: torch.dtype) -> tuple[TensorSpec, ...]:
        return (TensorSpec(torch.float16, (numel,)),)

    def encode(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        return [chunk.to(torch.float16)]

    def decode(self, payload: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        out.copy_(payload[0])


def test_a_lossy_codec_still_leaves_every_member_bit_identical() -> None:
    n = 5
    before = start_values(n, 4099)
    tensors = [t.clone() for t in before]

    async def body(nodes: list[Node]) -> list[int]:
        rings = [RingCollective(node, codec=HalfPrecision(), chunk_bytes=2048) for node in nodes]
        await asyncio.gather(*(rings[r].allreduce(range(n), tensors[r], "mean", tag="fp16") for r in range(n)))
        return [node.transport.stats.sent_bytes for node in nodes]

    sent = run_nodes(n, body)
    for r in range(n):
        assert torch.equal(tensors[r], tensors[0])
    exact = torch.stack(before).mean(0)
    assert not torch.equal(tensors[0], exact)  # it really was lossy
    torch.testing.assert_close(tensors[0], exact, rtol=0, atol=5e-3)
    # 2 (p-1)/p of the tensor per member, at 2 bytes an element instead of 4
    assert sum(sent) == pytest.approx(n * 2 * (n - 1) / n * 4099 * 2, rel=1e-3)


def test_bad_groups_are_refused() -> None:
    with pytest.raises(ConfigError, match="names a rank twice"):
        check_group([0, 1, 1], 0, 4)
    with pytest.raises(ConfigError, match="out of range"):
        check_group([0, 4], 0, 4)
    with pytest.raises(ConfigError, match="not a member"):
        check_group([1, 2], 0, 4)
    with pytest.raises(ConfigError, match="at least one rank"):
        check_group([], 0, 4)

    async def body(nodes: list[Node]) -> None:
        with pytest.raises(ConfigError, match="not a member"):
            await nodes[0].collective.allreduce([1, 2], torch.zeros(4), tag="x")
        with pytest.raises(ConfigError, match="unknown reduce op"):
            await nodes[0].collective.allreduce([0, 1], torch.zeros(4), "max", tag="x")  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="floating-point"):
            await nodes[0].collective.allreduce([0, 1], torch.zeros(4, dtype=torch.int64), tag="x")
        with pytest.raises(ConfigError, match="contiguous"):
            await nodes[0].collective.allreduce([0, 1], torch.zeros(4, 2).t(), tag="x")

    run_nodes(3, body)


def test_a_tag_in_use_is_refused() -> None:
    async def body(nodes: list[Node]) -> None:
        first = asyncio.ensure_future(nodes[0].collective.allreduce([0, 1], torch.zeros(8), tag="same"))
        await asyncio.sleep(0)
        with pytest.raises(ProtocolError, match="already in use"):
            await nodes[0].collective.allreduce([0, 2], torch.zeros(8), tag="same")
        await nodes[1].collective.allreduce([0, 1], torch.zeros(8), tag="same")
        await first

    run_nodes(3, body)


def test_a_silent_member_times_out_naming_group_tag_and_peer() -> None:
    async def body(nodes: list[Node]) -> None:
        # rank 2 never calls; in the ring (0, 1, 2) rank 0 receives from rank 2.
        await asyncio.gather(nodes[0].collective.allreduce((0, 1, 2), torch.zeros(30), tag="stuck/7"),
                             nodes[1].collective.allreduce((0, 1, 2), torch.zeros(30), tag="stuck/7"))

    with pytest.raises(WaitTimeout) as info:
        run_nodes(3, body, timeout_s=5.0, virtual=True)
    message = str(info.value)
    assert "'stuck/7'" in message and "[0, 1, 2]" in message and "from peer 2" in message
    assert info.value.peer == 2


def test_a_member_that_left_fails_the_round_at_once() -> None:
    async def body(nodes: list[Node]) -> None:
        nodes[2].post(Message("bye", 2, 0, 3))
        await nodes[2].flush()
        await nodes[0].collective.allreduce((0, 1, 2), torch.zeros(30), tag="gone")

    with pytest.raises(PeerFailure, match="rank 2 left after iteration 3") as info:
        run_nodes(3, body, timeout_s=60.0, virtual=True)
    assert info.value.peer == 2 and info.value.peer_state == "departed"


def test_members_with_different_sizes_get_a_clear_error() -> None:
    async def body(nodes: list[Node]) -> None:
        await asyncio.gather(nodes[0].collective.allreduce((0, 1), torch.zeros(10), tag="m"),
                             nodes[1].collective.allreduce((0, 1), torch.zeros(12), tag="m"))

    with pytest.raises(ProtocolError, match="same size and dtype"):
        run_nodes(2, body, timeout_s=5.0, virtual=True)


def test_collective_messages_come_from_any_rank_but_updates_only_from_neighbours() -> None:
    graph = Graph.ring(6)
    network = InprocNetwork()
    transport = network.transport(0, frozenset(graph.peers(0)))
    transport.admit_run(6)
    coll = Header("coll", 3, 0, 0, "t", None, (TensorSpec(torch.float32, (2,)),))
    update = Header("update", 3, 0, 0, None, None, ())
    assert transport.check_header(coll) is None
    assert transport.check_header(update) == "not_neighbor"
    assert transport.check_header(Header("coll", 6, 0, 0, "t", None, ())) == "not_neighbor"  # not in the run


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("numel", [1 << 12, 1 << 18])
def test_virtual_time_follows_the_ring_model(p: int, numel: int) -> None:
    """2 (p-1) latency + 2 (p-1)/p n / bandwidth, within 10%."""
    latency, bandwidth = 200e-6, 1.25e9  # 10 Gbit/s

    async def body(nodes: list[Node]) -> float:
        tensors = start_values(p, numel)
        loop = asyncio.get_running_loop()
        start = loop.time()
        await allreduce_in(nodes, range(p), tensors, "mean", "timed")
        return loop.time() - start

    elapsed = run_nodes(p, body, link=LinkModel(latency, bandwidth), virtual=True)
    model = 2 * (p - 1) * latency + 2 * (p - 1) / p * numel * 4 / bandwidth
    assert elapsed == pytest.approx(model, rel=0.10)


def test_a_receive_cancelled_after_its_message_came_leaves_it_for_the_next() -> None:
    """deliver() hands the message to the waiting receive, whose task is cancelled before it runs
    again (a consensus cancels its waits for the next round once this one is complete): the message
    stays for the next receive of its key instead of being lost."""
    from hopnet.runtime.mailbox import COLLECTIVE_KINDS, Mailbox

    async def body() -> None:
        box = Mailbox(COLLECTIVE_KINDS, Clock(5.0))
        waiting = asyncio.ensure_future(box.receive("coll", "t", 1, 0, what="test"))
        await asyncio.sleep(0)  # the receive waits now
        box.deliver(Message("coll", 1, 0, 0, "t", {"view": 7}))
        waiting.cancel()  # before the receive's task resumed with the message
        with pytest.raises(asyncio.CancelledError):
            await waiting
        again = await box.receive("coll", "t", 1, 0, what="test")
        assert again.meta == {"view": 7}

    asyncio.run(body())


def test_mailbox_posted_receives_land_in_place_and_a_failed_round_unposts_them() -> None:
    from hopnet.runtime.mailbox import COLLECTIVE_KINDS, Mailbox

    async def body() -> None:
        box = Mailbox(COLLECTIVE_KINDS, Clock(5.0))
        spec = (TensorSpec(torch.float32, (3,)),)
        result = torch.zeros(6)
        target = [result[3:]]
        assert box.post("coll", "t", 1, 0, target)
        header = Header("coll", 1, 0, 0, "t", None, spec)
        landed = box.buffers_for(header)
        assert landed is target  # the transport writes straight into the result
        landed[0].copy_(torch.tensor([1.0, 2.0, 3.0]))
        box.deliver(Message("coll", 1, 0, 0, "t", None, landed))
        msg = await box.receive("coll", "t", 1, 0, what="test")
        assert box.is_posted(msg, target) and result.tolist() == [0, 0, 0, 1, 2, 3]

        # Arrived first: post() says so, and the payload sits in a pool buffer.
        box.deliver(Message("coll", 1, 0, 1, "t", None, box.buffers_for(Header("coll", 1, 0, 1, "t", None, spec))))
        assert not box.post("coll", "t", 1, 1, [result[:3]])
        early = await box.receive("coll", "t", 1, 1, what="test")
        assert not box.is_posted(early, [result[:3]])
        box.release(early)

        # A failed round: nothing may land in the caller's tensor afterwards.
        assert box.post("coll", "u", 1, 0, [result[:3]])
        box.discard_tag("coll", "u")
        late = box.buffers_for(Header("coll", 1, 0, 0, "u", None, spec))
        assert late[0].data_ptr() != result.data_ptr()  # a pool buffer, not the result

    asyncio.run(body())

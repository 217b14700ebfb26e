"""One set of checks every transport must pass, run on each of them (tests/test_transport_conformance.py).

In the manner of trio's ``testing/_check_streams.py``: a check is an async function that gets
two started and connected ranks (:class:`Ends`) of some transport and asserts what the
:class:`hopnet.transports.base.Transport` contract promises: headers and tensor frames arrive
whole, in order per peer, into the buffers ``buffers_for`` supplies; ``close`` is idempotent;
sending to a peer that is gone is no error. :func:`connected` builds the ends for each kind.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import torch

from hopnet.errors import PeerFailure
from hopnet.rendezvous.store import connect_store, host_store
from hopnet.transports.base import DISCARD, Transport
from hopnet.transports.inproc import InprocNetwork
from hopnet.transports.torchdist import TorchBulkTransport
from hopnet.transports.zmq import ZmqTransport
from hopnet.wire import Header, Message

from support.faults import FaultyTransport

TIMEOUT_S = 30.0
QUIET_S = 0.3
"""How long a check waits to be sure that nothing arrives."""

KINDS = ("inproc", "zmq", "torch", "faulty-zmq")
"""inproc, ZeroMQ, the torch bulk plane (headers over ZeroMQ, tensors over gloo), and the
fault-injecting wrapper around ZeroMQ with no faults set (it must change nothing)."""


class Recorder:
    """A Receiver that keeps what it gets; ``buffers`` decides what ``buffers_for`` returns."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.asked: list[Header] = []
        self.lost: list[PeerFailure] = []
        self.buffers: Callable[[Header], object] = lambda header: None

    def buffers_for(self, header: Header) -> object:
        self.asked.append(header)
        return self.buffers(header)

    def hold(self, header: Header) -> bool:
        return False

    def deliver(self, msg: Message) -> None:
        self.inbox.put_nowait(msg)

    def peer_lost(self, failure: PeerFailure) -> None:
        self.lost.append(failure)

    async def get(self) -> Message:
        return await asyncio.wait_for(self.inbox.get(), TIMEOUT_S)

    async def nothing_more(self) -> None:
        await asyncio.sleep(QUIET_S)
        assert self.inbox.empty(), f"unexpected message: {self.inbox.get_nowait()}"


@dataclass
class Ends:
    """Two ranks, 0 and 1, each the other's only neighbour, started and connected."""

    transports: list[Transport]
    receivers: list[Recorder]


def _build(kind: str, rank: int, network: InprocNetwork, store_endpoint: str | None) -> Transport:
    peers = frozenset({1 - rank})
    if kind == "inproc":
        return network.transport(rank, peers)
    if kind == "zmq":
        return ZmqTransport(rank, peers)
    if kind == "faulty-zmq":
        return FaultyTransport(ZmqTransport(rank, peers))
    if kind == "torch":
        assert store_endpoint is not None
        return TorchBulkTransport(ZmqTransport(rank, peers), connect_store(store_endpoint, 10),
                                  timeout_s=TIMEOUT_S, device="cpu")
    raise ValueError(f"unknown transport kind {kind!r}")


@asynccontextmanager
async def connected(kind: str) -> AsyncIterator[Ends]:
    store = host_store("127.0.0.1") if kind == "torch" else None
    network = InprocNetwork()
    transports = [_build(kind, rank, network, store.endpoint if store else None) for rank in (0, 1)]
    receivers = [Recorder(), Recorder()]
    try:
        addresses = [await t.start(r) for t, r in zip(transports, receivers)]
        for rank, t in enumerate(transports):
            await t.connect({1 - rank: addresses[1 - rank]})
        yield Ends(transports, receivers)
    finally:
        for t in transports:
            await t.close()
        if store is not None:
            store.close()


def _update(src: int, it: int, *tensors: torch.Tensor, meta: dict | None = None) -> Message:
    return Message("update", src, 1 - src, it, meta=meta, tensors=list(tensors))


# ----------------------------------------------------------------------------- the checks
async def check_a_header_arrives_whole(ends: Ends) -> None:
    a, _ = ends.transports
    _, rb = ends.receivers
    await a.send(Message("hello", 0, 1, 7, tag="t1", meta={"lr": 0.5, "ids": [1, 2], "name": "x"}))
    got = await rb.get()
    assert (got.kind, got.src, got.dst, got.iter, got.tag, got.meta, got.tensors) == \
        ("hello", 0, 1, 7, "t1", {"lr": 0.5, "ids": [1, 2], "name": "x"}, [])
    assert rb.asked == []  # buffers_for is asked only for messages with tensors


async def check_tensor_frames_arrive_equal_and_the_sender_may_reuse_them(ends: Ends) -> None:
    a, _ = ends.transports
    _, rb = ends.receivers
    sent = [torch.randn(3, 4), torch.randn(5, dtype=torch.float64), torch.arange(12, dtype=torch.int64).reshape(2, 6),
            torch.randn(1 << 18)]  # 1 MiB
    expected = [t.clone() for t in sent]
    await a.send(_update(0, 3, *sent, meta={"step": 3}))
    for t in sent:
        t.zero_()  # send returned: the caller may write into its tensors again
    got = await rb.get()
    assert (got.kind, got.iter, got.meta) == ("update", 3, {"step": 3})
    assert len(got.tensors) == len(expected)
    for have, want in zip(got.tensors, expected):
        assert have.dtype == want.dtype and have.shape == want.shape and torch.equal(have, want)


async def check_messages_to_one_peer_keep_their_order(ends: Ends) -> None:
    a, _ = ends.transports
    _, rb = ends.receivers
    for it in range(10):  # one after the other, tensors and control alternating
        await a.send(_update(0, it, torch.full((100,), float(it))) if it % 2 else Message("token", 0, 1, it))
    await asyncio.gather(*(a.send(_update(0, it, torch.full((1000,), float(it))) if it % 3 else
                                  Message("token", 0, 1, it)) for it in range(10, 20)))  # all at once
    got = [await rb.get() for _ in range(20)]
    assert [m.iter for m in got] == list(range(20))
    for m in got:
        assert all(torch.equal(t, torch.full_like(t, float(m.iter))) for t in m.tensors)


async def check_both_directions_at_once(ends: Ends) -> None:
    a, b = ends.transports
    ra, rb = ends.receivers
    await asyncio.gather(*(a.send(_update(0, it, torch.full((64,), float(it)))) for it in range(5)),
                         *(b.send(_update(1, it, torch.full((64,), -float(it)))) for it in range(5)))
    assert [(await rb.get()).iter for _ in range(5)] == list(range(5))
    assert [(m := await ra.get()).src == 1 and m.tensors[0][0].item() == -it for it in range(5)] == [True] * 5


async def check_tensors_land_in_the_buffers_the_receiver_supplies(ends: Ends) -> None:
    a, _ = ends.transports
    _, rb = ends.receivers
    slots = [torch.empty(1000), torch.empty(2, 3, dtype=torch.float64)]
    rb.buffers = lambda header: slots
    await a.send(_update(0, 1, torch.full((1000,), 2.0), torch.ones(2, 3, dtype=torch.float64)))
    got = await rb.get()
    (header,) = rb.asked
    assert (header.kind, header.src, header.iter) == ("update", 0, 1)
    assert [(s.shape, s.dtype) for s in header.specs] == [((1000,), torch.float32), ((2, 3), torch.float64)]
    assert got.tensors[0] is slots[0] and got.tensors[1] is slots[1]
    assert torch.equal(slots[0], torch.full((1000,), 2.0)) and torch.equal(slots[1], torch.ones(2, 3, dtype=torch.float64))


async def check_a_discarded_message_is_dropped_and_counted(ends: Ends) -> None:
    a, b = ends.transports
    _, rb = ends.receivers
    rb.buffers = lambda header: DISCARD if header.iter == 1 else None
    await a.send(_update(0, 1, torch.ones(1000)))
    await a.send(_update(0, 2, torch.ones(10)))
    got = await rb.get()
    assert got.iter == 2 and len(rb.asked) == 2
    assert b.stats.dropped["discarded"] == 1
    await rb.nothing_more()


async def check_close_is_idempotent_and_ends_delivery(ends: Ends) -> None:
    a, b = ends.transports
    _, rb = ends.receivers
    await a.send(Message("token", 0, 1, 0))
    assert (await rb.get()).iter == 0
    await b.close()
    await b.close()
    a.forget_peer(1)
    await a.send(Message("token", 0, 1, 1))
    await rb.nothing_more()


async def check_sending_to_a_peer_that_is_gone_is_no_error(ends: Ends) -> None:
    """Once its departure is known (``forget_peer``), sends to it return at once, without an error
    and without delivering anything, tensors or not."""
    a, b = ends.transports
    _, rb = ends.receivers
    await b.close()
    a.forget_peer(1)
    await asyncio.wait_for(a.send(_update(0, 5, torch.ones(1 << 18))), 5.0)
    await asyncio.wait_for(a.send(Message("token", 0, 1, 6)), 5.0)
    await asyncio.wait_for(a.send_express(Message("ack", 0, 1, 7)), 5.0)
    await asyncio.wait_for(a.drain(), 5.0)
    await rb.nothing_more()


CHECKS: tuple[Callable[[Ends], Awaitable[None]], ...] = (
    check_a_header_arrives_whole,
    check_tensor_frames_arrive_equal_and_the_sender_may_reuse_them,
    check_messages_to_one_peer_keep_their_order,
    check_both_directions_at_once,
    check_tensors_land_in_the_buffers_the_receiver_supplies,
    check_a_discarded_message_is_dropped_and_counted,
    check_close_is_idempotent_and_ends_delivery,
    check_sending_to_a_peer_that_is_gone_is_no_error,
)

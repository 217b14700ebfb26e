"""Message numbers per link (hopnet/transports/link_numbers.py): a ZmqTransport numbers what it
sends to each peer within a connection epoch, and a receiving one drops duplicates and old
numbers (``duplicate``), counts and reports gaps (``gap``, a ``link_gap`` record), and takes a new
epoch as a new count. Real sockets on loopback; the misbehaving sender is a raw DEALER (or a
raw payload stream) speaking the wire by hand."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio

from hopnet.rendezvous.store import connect_store, host_store
from hopnet.transports import payload_stream as ps
from hopnet.transports.torchdist import TorchBulkTransport
from hopnet.transports.zmq import ZmqTransport, express_routing_id, routing_id, zmq_endpoint
from hopnet.wire import Message, decode_header, encode_header

from support.transport_checks import Recorder
from support.wait import wait_until_async

TIMEOUT = 10.0
EPOCH = 0x1234_5678_9ABC_DEF0


class Logged(Recorder):
    """A Recorder with the Node's event hook: ``record(event, **fields)``."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, dict[str, Any]]] = []

    def record(self, event: str, **fields: Any) -> None:
        self.records.append((event, fields))


class RawPeer:
    """Rank 0 speaking ZeroMQ by hand to a transport: numbered headers, on its main or express connection."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sockets: dict[bool, zmq.asyncio.Socket] = {}
        for express in (False, True):
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.ROUTING_ID, express_routing_id(0) if express else routing_id(0))
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(zmq_endpoint(address))
            self.sockets[express] = sock

    async def send(self, seq: int, epoch: int = EPOCH, *, express: bool = False, tag: str = "",
                   lane: bytes = b"") -> None:
        msg = Message("token", 0, 1, seq, tag=tag or f"{epoch:x}:{seq}")
        await self.sockets[express].send_multipart([lane + encode_header(msg, epoch, seq)])

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close(0)
        self.ctx.term()


@pytest.fixture
async def receiving() -> AsyncIterator[tuple[ZmqTransport, Logged, RawPeer]]:
    inbox = Logged()
    b = ZmqTransport(1, frozenset({0}), payload_stream=False)
    peer = RawPeer(await b.start(inbox))
    yield b, inbox, peer
    peer.close()
    await b.close()


async def delivered(inbox: Recorder, count: int) -> list[str]:
    return [(await inbox.get()).tag for _ in range(count)]


async def counted(t: ZmqTransport, **want: int) -> None:
    await wait_until_async(lambda: all(t.stats.dropped[k] >= n for k, n in want.items()), TIMEOUT,
                           interval=0.01, what=lambda: f"drops {want} (have {dict(t.stats.dropped)})")


async def test_a_transport_numbers_each_link_from_1_and_a_new_connection_in_a_new_epoch() -> None:
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # the new connection takes over from the old one at once
    port = router.bind_to_random_port("tcp://127.0.0.1")
    a = ZmqTransport(0, frozenset({1}))
    await a.start(Recorder())
    address = f"tcp://127.0.0.1:{port}"
    try:
        await a.connect({1: address})

        async def numbers(count: int) -> list[tuple[bytes, int, int]]:
            got = []
            for _ in range(count):
                frames = await asyncio.wait_for(router.recv_multipart(), TIMEOUT)
                header = decode_header(frames[1])
                got.append((frames[0], header.epoch, header.seq))
            return sorted(got)

        await a.send(Message("token", 0, 1, 0))
        await a.send(Message("update", 0, 1, 1, tensors=[torch.randn(1 << 18)]))  # 1 MiB, zero-copy
        await a.send_latest(Message("update", 0, 1, 2, tensors=[torch.randn(4)]))
        await a.send_express(Message("token", 0, 1, 3))
        await a.send(Message("beat", 0, 1, 4))
        first = await numbers(5)
        epoch = first[0][1]
        assert epoch != 0 and first == [(b"0", epoch, 1), (b"0", epoch, 2), (b"0", epoch, 3), (b"0", epoch, 4),
                                        (b"x0", epoch, 1)]
        a.forget_peer(1)
        a.readmit_peer(1, address)  # a new connection: a new epoch, counted from 1
        await a.send(Message("token", 0, 1, 5))
        (routing, again, seq), = await numbers(1)
        assert routing == b"0" and seq == 1 and again not in (0, epoch)
    finally:
        await a.close()
        router.close(0)
        ctx.term()


async def test_duplicates_and_old_numbers_are_dropped_and_never_delivered_twice(receiving) -> None:
    b, inbox, peer = receiving
    for seq, tag in ((1, "one"), (2, "two"), (2, "two again"), (1, "one again"), (3, "three")):
        await peer.send(seq, tag=tag)
    assert await delivered(inbox, 3) == ["one", "two", "three"]
    await counted(b, duplicate=2)
    await inbox.nothing_more()
    assert b.stats.dropped == {"duplicate": 2} and b.stats.received_messages == 3 and inbox.records == []


async def test_a_gap_is_counted_reported_once_and_the_message_after_it_delivered(receiving, caplog) -> None:
    b, inbox, peer = receiving
    for seq in (1, 4, 5):
        await peer.send(seq, tag=str(seq))
    assert await delivered(inbox, 3) == ["1", "4", "5"]
    assert b.stats.dropped == {"gap": 2}
    assert inbox.records == [("link_gap", {"peer": 0, "first": 2, "last": 3, "missed": 2})]
    assert [r.getMessage() for r in caplog.records if "never arrived" in r.getMessage()] == [
        f"rank 1: messages 2-3 from rank 0 never arrived (link 0->1, connection {EPOCH:016x}): 2 lost"]
    await peer.send(3, tag="late")  # older than one taken: dropped, not delivered out of order
    await peer.send(6, tag="6")
    assert await delivered(inbox, 1) == ["6"]
    assert b.stats.dropped == {"gap": 2, "duplicate": 1} and len(inbox.records) == 1


async def test_a_new_epoch_is_a_new_count_and_an_old_ones_stragglers_keep_their_own(receiving) -> None:
    b, inbox, peer = receiving
    old, new, newer = EPOCH, EPOCH + 1, EPOCH + 2
    sends = [(old, 1, "old 1"), (old, 2, "old 2"), (new, 1, "new 1"), (new, 2, "new 2"), (old, 3, "old 3"),
             (old, 3, "old 3 again"), (new, 2, "new 2 again"), (newer, 2, "newer 2")]
    for epoch, seq, tag in sends:
        await peer.send(seq, epoch, tag=tag)
    assert await delivered(inbox, 6) == ["old 1", "old 2", "new 1", "new 2", "old 3", "newer 2"]
    await counted(b, duplicate=2)
    # A new epoch counts from 1: its message 1 never came.
    assert b.stats.dropped == {"duplicate": 2, "gap": 1}
    assert inbox.records == [("link_gap", {"peer": 0, "first": 1, "last": 1, "missed": 1})]


async def test_the_first_message_from_a_sender_sets_its_count(receiving) -> None:
    """A replacement receiver joins a link whose earlier messages went to its predecessor: no gap."""
    b, inbox, peer = receiving
    await peer.send(500, tag="500")
    await peer.send(501, tag="501")
    assert await delivered(inbox, 2) == ["500", "501"]
    assert not b.stats.dropped and inbox.records == []


async def test_express_messages_are_counted_on_their_own(receiving) -> None:
    b, inbox, peer = receiving
    await peer.send(1, tag="main 1")
    await peer.send(1, express=True, tag="express 1")
    await peer.send(2, tag="main 2")
    await peer.send(3, express=True, tag="express 3")
    await peer.send(3, express=True, tag="express 3 again")
    assert sorted(await delivered(inbox, 4)) == ["express 1", "express 3", "main 1", "main 2"]
    await counted(b, duplicate=1)
    assert b.stats.dropped == {"duplicate": 1, "gap": 1}
    assert inbox.records == [("link_gap", {"peer": 0, "first": 2, "last": 2, "missed": 1, "express": True})]


async def test_a_streamed_duplicate_never_lands_in_a_buffer_and_a_streamed_gap_is_reported() -> None:
    """On a payload stream too: the number is checked before ``buffers_for`` is asked."""
    inbox = Logged()
    b = ZmqTransport(1, frozenset({0}))
    address = await b.start(inbox)
    peer = RawPeer(address)
    _, (host, port) = ps.split_address(address)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(ps.HELLO.pack(ps.MAGIC, ps.VERSION, 0, 99, EPOCH))
        assert await asyncio.wait_for(reader.read(1), TIMEOUT) == ps.ACCEPT
        await peer.send(1, tag="zmq 1", lane=ps.lane_tag(EPOCH, 1, 99, 0))
        payload = torch.arange(ps.MIN_BYTES // 4, dtype=torch.float32)
        for stream_seq, (seq, tag) in enumerate([(2, "streamed 2"), (2, "streamed 2 again"), (4, "streamed 4")], 1):
            header = encode_header(Message("update", 0, 1, seq, tag=tag, tensors=[payload]), EPOCH, seq)
            body = payload.numpy().tobytes()
            writer.write(ps.PREFIX.pack(stream_seq, 1, len(body), len(header)) + header + body)
        got = [await inbox.get() for _ in range(3)]
        assert [m.tag for m in got] == ["zmq 1", "streamed 2", "streamed 4"]
        assert all(torch.equal(m.tensors[0], payload) for m in got[1:])
        assert [h.tag for h in inbox.asked] == ["streamed 2", "streamed 4"]  # never asked for the duplicate
        assert b.stats.dropped == {"duplicate": 1, "gap": 1}
        assert inbox.records == [("link_gap", {"peer": 0, "first": 3, "last": 3, "missed": 1})]
    finally:
        writer.close()
        peer.close()
        await b.close()


async def test_the_torch_planes_control_messages_are_checked_and_gaps_reach_its_receiver() -> None:
    """The torch plane's headers go over its ZeroMQ transport, which numbers and checks them; its
    gap reports pass through it to its own receiver's event hook."""
    store = host_store("127.0.0.1")
    inbox = Logged()
    t = TorchBulkTransport(ZmqTransport(1, frozenset({0})), connect_store(store.endpoint, 10), device="cpu")
    try:
        peer = RawPeer(await t.start(inbox))
        try:
            for seq in (1, 1, 3):
                await peer.send(seq, tag=str(seq))
            assert await delivered(inbox, 2) == ["1", "3"]
            await counted(t.control, duplicate=1)
            assert t.stats.dropped == {"duplicate": 1, "gap": 1}
            assert inbox.records == [("link_gap", {"peer": 0, "first": 2, "last": 2, "missed": 1})]
        finally:
            peer.close()
    finally:
        await t.close()
        store.close()

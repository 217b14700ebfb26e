"""ZmqTransport's payload stream: large tensor messages whole over a TCP stream, in order with ZeroMQ ones."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable

import pytest
import torch
import zmq
import zmq.asyncio

from hopnet.security import CurveKeys
from hopnet.transports import payload_stream as ps
from hopnet.transports.zmq import CHUNK_BYTES, ZmqTransport, zmq_endpoint
from hopnet.wire import Header, Message, encode_header

from support.transport_checks import Recorder
from support.wait import wait_until_async

TIMEOUT = 10.0


class Inbox(Recorder):
    """A Recorder that runs ``on_header`` as each header arrives, before its bytes are read."""

    on_header: Callable[[Header], None] | None = None

    def buffers_for(self, header: Header) -> object:
        if self.on_header is not None:
            self.on_header(header)
        return super().buffers_for(header)


async def started(rank: int, senders: set[int], inbox: Inbox | None = None, **kw) -> ZmqTransport:
    t = ZmqTransport(rank, frozenset(senders), **kw)
    await t.start(inbox or Inbox())
    return t


@pytest.fixture
async def pair():
    a, inbox_b = await started(0, {1}), Inbox()
    b = await started(1, {0}, inbox_b)
    assert b.address is not None and "?data=" in b.address
    await a.connect({1: b.address})
    yield a, b, inbox_b
    await a.close()
    await b.close()


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


async def test_payloads_of_many_sizes_arrive_byte_exact_in_order_with_control_messages(pair):
    a, b, inbox = pair
    m = ps.MIN_BYTES
    sizes = [m - 1, m, m + 1, CHUNK_BYTES - 1, CHUNK_BYTES, CHUNK_BYTES + 1, 3 * CHUNK_BYTES + 5, 64 << 10]
    sent: list[Message] = []
    for i, n in enumerate(sizes):
        tensors = [pattern(n, i)]
        if i % 2:  # several tensors, one of them empty, one bfloat16
            tensors += [torch.empty(0), torch.randn(n // 8).to(torch.bfloat16)]
        sent.append(Message("update", 0, 1, i, tensors=tensors))
        sent.append(Message("token", 0, 1, i, meta={"after": i}))
    for msg in sent:
        await a.send(msg)
    for want in sent:
        got = await inbox.get()
        assert (got.kind, got.iter, got.meta) == (want.kind, want.iter, want.meta)
        assert len(got.tensors) == len(want.tensors)
        for g, w in zip(got.tensors, want.tensors):
            assert g.dtype == w.dtype and torch.equal(g, w)
    totals = [sum(t.numel() * t.element_size() for t in msg.tensors) for msg in sent[::2]]
    assert a.streamed_messages == sum(1 for n in totals if n >= m) and min(totals) < m
    assert not a.stats.dropped and not b.stats.dropped
    assert b.stats.received_messages == len(sent)


async def test_received_straight_into_the_buffers_the_receiver_names(pair):
    a, _b, inbox = pair
    slot = torch.empty(CHUNK_BYTES // 4)
    inbox.buffers = lambda h: [slot]
    src = torch.randn(CHUNK_BYTES // 4)
    await a.send(Message("update", 0, 1, 1, tensors=[src]))
    got = await inbox.get()
    assert got.tensors[0] is slot and got.tensors[0].data_ptr() == slot.data_ptr()
    assert torch.equal(slot, src) and a.streamed_messages == 1


async def test_discarded_and_mismatched_payloads_are_read_past_and_counted(pair):
    a, b, inbox = pair
    inbox.buffers = lambda h: None if h.iter == 3 else ps_discard_or_bad(h)
    src = torch.randn(ps.MIN_BYTES // 2)
    for i in range(4):
        await a.send(Message("update", 0, 1, i, tensors=[src]))
    got = await inbox.get()
    assert got.iter == 3 and torch.equal(got.tensors[0], src)
    assert b.stats.dropped == {"discarded": 2, "bad_buffers": 1}


def ps_discard_or_bad(h: Header) -> object:
    from hopnet.transports.base import DISCARD
    return DISCARD if h.iter < 2 else [torch.empty(3)]


@contextlib.asynccontextmanager
async def three_senders(inbox: Inbox) -> AsyncIterator[tuple[ZmqTransport, list[ZmqTransport]]]:
    """Rank 3 receiving into ``inbox``, and ranks 0, 1, 2 connected to it."""
    recv = await started(3, {0, 1, 2}, inbox)
    senders = [await started(r, {3}) for r in range(3)]
    try:
        for s in senders:
            await s.connect({3: recv.address})
        yield recv, senders
    finally:
        for t in (*senders, recv):
            await t.close()


async def test_several_senders_at_once_keep_each_ones_order():
    inbox = Inbox()
    async with three_senders(inbox) as (recv, senders):
        big = {r: torch.full((ps.MIN_BYTES // 4 + r,), float(r)) for r in range(3)}

        async def run(s: ZmqTransport) -> None:
            for i in range(6):
                if i % 3 == 2:
                    await s.send(Message("token", s.rank, 3, i))
                else:
                    await s.send(Message("update", s.rank, 3, i, tensors=[big[s.rank]]))

        await asyncio.gather(*(run(s) for s in senders))
        seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
        for _ in range(18):
            m = await inbox.get()
            seen[m.src].append(m.iter)
            if m.tensors:
                assert torch.equal(m.tensors[0], big[m.src])
        assert seen == {r: list(range(6)) for r in range(3)}
        assert all(s.streamed_messages == 4 for s in senders)
        assert not recv.stats.dropped


async def test_concurrent_sends_keep_their_order_while_the_stream_opens(pair):
    a, _b, inbox = pair
    big = torch.randn(CHUNK_BYTES // 4)
    msgs = [Message("update", 0, 1, i, tensors=[big]) if i % 2 == 0 else Message("token", 0, 1, i)
            for i in range(8)]
    await asyncio.gather(*(a.send(m) for m in msgs))
    assert [(await inbox.get()).iter for _ in msgs] == list(range(8))


SENDER = """
import asyncio, sys, torch
from hopnet.transports.zmq import ZmqTransport
from hopnet.wire import Message

async def main():
    t = ZmqTransport(0, frozenset({1}))
    await t.start(None)
    await t.connect({1: sys.argv[1]})
    print("ready", flush=True)
    await t.send(Message("update", 0, 1, 7, tensors=[torch.ones(64 << 18)]))  # 64 MiB
    await asyncio.sleep(60)

asyncio.run(main())
"""


async def test_a_sender_killed_mid_payload_is_dropped_and_a_new_one_gets_through():
    inbox = Inbox()
    recv = await started(1, {0}, inbox, handover=True)
    proc = subprocess.Popen([sys.executable, "-c", SENDER, recv.address], stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        killed: list[int] = []

        def kill_now(header: Header) -> None:
            # The header is here and the bytes are on their way: the sender dies mid-payload.
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(TIMEOUT)
            killed.append(header.iter)

        inbox.on_header = kill_now
        await wait_until_async(lambda: recv.stats.dropped, 30, interval=0.01, what="the cut stream's drop")
        assert killed == [7] and recv.stats.dropped == {"stream_closed": 1}
        assert inbox.inbox.empty()
        inbox.on_header = None
        again = await started(0, {1})  # the rank's new process
        try:
            await again.connect({1: recv.address})
            src = torch.randn(CHUNK_BYTES // 4)
            await again.send(Message("update", 0, 1, 8, tensors=[src]))
            got = await inbox.get()
            assert got.iter == 8 and torch.equal(got.tensors[0], src) and again.streamed_messages == 1
        finally:
            await again.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        await recv.close()


async def test_a_stream_from_a_rank_not_among_the_senders_is_refused():
    inbox = Inbox()
    recv = await started(1, {0}, inbox)
    try:
        _, (host, port) = ps.split_address(recv.address)
        with socket.create_connection((host, port), timeout=TIMEOUT) as sock:
            sock.sendall(ps.HELLO.pack(ps.MAGIC, ps.VERSION, 2, 12345, 1))
            sock.setblocking(False)
            closed = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 1), TIMEOUT)
            assert closed == b""  # by the receiver
        assert recv.stats.dropped == {"not_neighbor": 1}
    finally:
        await recv.close()


async def test_a_stream_that_takes_nothing_times_out_and_close_ends_a_pending_send():
    """A peer whose ROUTER and stream never read: send returns after send_timeout, counted."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    held: list[asyncio.StreamWriter] = []

    async def accept_then_read_nothing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(ps.HELLO.size)
        writer.write(ps.ACCEPT)
        held.append(writer)

    listener = await asyncio.start_server(accept_then_read_nothing, "127.0.0.1", 0)
    address = ps.with_data_port(router.getsockopt_string(zmq.LAST_ENDPOINT), listener.sockets[0].getsockname()[1])
    a = await started(0, {1}, send_timeout=0.3)
    try:
        await a.connect({1: address})
        big = torch.randn(32 << 18)  # 32 MiB: more than the kernel's buffers take
        await asyncio.wait_for(a.send(Message("update", 0, 1, 1, tensors=[big])), TIMEOUT)
        assert a.stats.dropped == {"send_timeout": 1} and a.streamed_messages == 0
        pending = asyncio.ensure_future(a.send(Message("update", 0, 1, 2, tensors=[big])))
        await asyncio.sleep(0.1)
        assert a.backlogged(1)
        await a.close()
        await asyncio.wait_for(pending, TIMEOUT)
        assert a.stats.dropped == {"send_timeout": 1, "closed": 1}
    finally:
        await a.close()
        for w in held:
            w.close()
        listener.close()
        router.close()
        ctx.term()


async def test_with_curve_keys_payloads_stay_on_zeromq():
    keys = CurveKeys.generate()
    inbox = Inbox()
    b = await started(1, {0}, inbox, curve=keys)
    a = await started(0, {1}, curve=keys)
    try:
        assert "?data=" not in b.address and not a.payload_stream
        await a.connect({1: b.address})
        src = torch.randn(CHUNK_BYTES // 4)
        await a.send(Message("update", 0, 1, 1, tensors=[src]))
        assert torch.equal((await inbox.get()).tensors[0], src) and a.streamed_messages == 0
    finally:
        await a.close()
        await b.close()


async def test_the_off_switch_and_ipc(monkeypatch, tmp_path):
    inbox = Inbox()
    off = await started(1, {0}, inbox, payload_stream=False)
    monkeypatch.setenv(ps.ENV, "0")
    off_by_env = await started(2, {0}, Inbox())
    monkeypatch.delenv(ps.ENV)
    over_ipc = await started(3, {0}, Inbox(), bind=f"ipc://{tmp_path}/r3.sock")
    await over_ipc.close()
    a = await started(0, {1, 2})
    try:
        assert "?data=" not in off.address and "?data=" not in off_by_env.address and a.payload_stream
        assert over_ipc.address == f"ipc://{tmp_path}/r3.sock"
        await a.connect({1: off.address, 2: off_by_env.address})
        src = torch.randn(CHUNK_BYTES // 4)
        await a.send(Message("update", 0, 1, 1, tensors=[src]))
        assert torch.equal((await inbox.get()).tensors[0], src) and a.streamed_messages == 0
    finally:
        for t in (a, off, off_by_env):
            await t.close()


def test_addresses_with_and_without_a_data_port():
    assert ps.split_address("tcp://127.0.0.1:5555?data=5556") == ("tcp://127.0.0.1:5555", ("127.0.0.1", 5556))
    assert ps.split_address("tcp://[::1]:5555?data=7") == ("tcp://[::1]:5555", ("::1", 7))
    assert ps.split_address("tcp://10.0.0.2:5555") == ("tcp://10.0.0.2:5555", None)
    assert ps.split_address("ipc:///tmp/x.sock") == ("ipc:///tmp/x.sock", None)
    assert ps.split_address("tcp://h:1?data=0")[1] is None


async def test_a_readmitted_peer_at_a_new_address_gets_a_new_stream(pair):
    a, b, inbox = pair
    src = torch.randn(CHUNK_BYTES // 4)
    await a.send(Message("update", 0, 1, 1, tensors=[src]))
    await inbox.get()
    await b.close()  # rank 1's process ends; its replacement listens elsewhere
    inbox2 = Inbox()
    b2 = await started(1, {0}, inbox2)
    try:
        a.forget_peer(1)
        a.readmit_peer(1, b2.address)
        await a.send(Message("update", 0, 1, 2, tensors=[src]))
        got = await inbox2.get()
        assert got.iter == 2 and torch.equal(got.tensors[0], src) and a.streamed_messages == 2
    finally:
        await b2.close()


class RawSender:
    """Rank 0 speaking the wire by hand: a DEALER and a payload stream to a transport."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.ctx = zmq.asyncio.Context()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.ROUTING_ID, b"0")
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(zmq_endpoint(address))
        self.writer: asyncio.StreamWriter | None = None
        self.reader: asyncio.StreamReader | None = None

    async def open(self, token: int = 99, epoch: int = 7, version: int = ps.VERSION) -> bytes:
        _, (host, port) = ps.split_address(self.address)
        self.reader, self.writer = await asyncio.open_connection(host, port)
        self.writer.write(ps.HELLO.pack(ps.MAGIC, version, 0, token, epoch))
        return await asyncio.wait_for(self.reader.read(1), TIMEOUT)

    def streamed(self, msg: Message, seq: int, z_before: int = 0, body: bytes | None = None) -> None:
        header = encode_header(msg)
        data = b"".join(t.numpy().tobytes() for t in msg.tensors)
        nbytes = len(data)
        self.writer.write(ps.PREFIX.pack(seq, z_before, nbytes, len(header)) + header + (data if body is None else body))

    async def zmq(self, msg: Message, zseq: int, token: int = 0, s_last: int = 0, epoch: int = 7) -> None:
        await self.dealer.send_multipart([ps.lane_tag(epoch, zseq, token, s_last) + encode_header(msg)])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.dealer.close()
        self.ctx.term()


@pytest.fixture
async def raw():
    inbox = Inbox()
    recv = await started(1, {0}, inbox)
    sender = RawSender(recv.address)
    yield sender, recv, inbox
    sender.close()
    await recv.close()


def big(i: int) -> Message:
    return Message("update", 0, 1, i, tensors=[torch.full((ps.MIN_BYTES // 4,), float(i))])


async def nothing_yet(inbox: Inbox) -> None:
    await asyncio.sleep(0.2)
    assert inbox.inbox.empty()


async def test_a_streamed_message_waits_for_the_zeromq_message_sent_before_it(raw):
    sender, recv, inbox = raw
    assert await sender.open() == ps.ACCEPT
    sender.streamed(big(2), seq=1, z_before=1)  # its ZeroMQ predecessor (zseq 1) is late
    await sender.writer.drain()
    await nothing_yet(inbox)
    await sender.zmq(Message("token", 0, 1, 1), zseq=1)
    first, second = await inbox.get(), await inbox.get()
    assert (first.kind, first.iter, second.iter) == ("token", 1, 2)
    assert torch.equal(second.tensors[0], big(2).tensors[0]) and not recv.stats.dropped


async def test_a_zeromq_message_waits_for_the_streamed_message_sent_before_it(raw):
    sender, recv, inbox = raw
    assert await sender.open(token=5) == ps.ACCEPT
    await sender.zmq(Message("token", 0, 1, 2), zseq=1, token=5, s_last=1)  # after stream message 1
    await sender.zmq(Message("token", 0, 1, 3), zseq=2, token=5, s_last=1)
    await nothing_yet(inbox)
    sender.streamed(big(1), seq=1)
    assert [(await inbox.get()).iter for _ in range(3)] == [1, 2, 3] and not recv.stats.dropped


async def test_a_zeromq_message_waits_for_a_stream_whose_hello_is_late(raw, monkeypatch):
    sender, _recv, inbox = raw
    await sender.zmq(Message("token", 0, 1, 2), zseq=1, token=5, s_last=1)
    await nothing_yet(inbox)
    assert await sender.open(token=5) == ps.ACCEPT
    sender.streamed(big(1), seq=1)
    assert [(await inbox.get()).iter for _ in range(2)] == [1, 2]
    # a stream that never comes: the message behind it goes on after HELLO_WAIT_S
    monkeypatch.setattr(ps, "HELLO_WAIT_S", 0.2)
    await sender.zmq(Message("token", 0, 1, 3), zseq=2, token=6, s_last=1)
    assert (await inbox.get()).iter == 3


async def test_a_streamed_message_whose_zeromq_predecessor_was_lost_goes_on_after_a_while(raw, monkeypatch):
    sender, recv, inbox = raw
    monkeypatch.setattr(ps, "ORDER_WAIT_S", 0.3)
    assert await sender.open() == ps.ACCEPT
    sender.streamed(big(2), seq=1, z_before=1)  # zseq 1 never comes (the sender dropped it)
    got = await inbox.get()
    assert got.iter == 2 and torch.equal(got.tensors[0], big(2).tensors[0]) and not recv.stats.dropped


async def test_a_stream_that_dies_mid_message_drops_it_and_lets_what_waited_behind_it_through(raw):
    sender, recv, inbox = raw
    slot = torch.zeros(ps.MIN_BYTES // 4)
    inbox.buffers = lambda h: [slot]
    assert await sender.open(token=5) == ps.ACCEPT
    sender.streamed(big(1), seq=1)
    sender.streamed(big(2), seq=2, body=b"\x01" * 100)  # then the sender dies
    await sender.zmq(Message("token", 0, 1, 3), zseq=1, token=5, s_last=2)
    await sender.zmq(Message("token", 0, 1, 4), zseq=2, token=5, s_last=3)  # after one never written
    assert (await inbox.get()).iter == 1
    await nothing_yet(inbox)
    sender.writer.close()
    assert [(await inbox.get()).iter for _ in range(2)] == [3, 4]  # delivered, not dropped
    assert recv.stats.dropped == {"stream_closed": 1}


async def test_a_prefix_or_header_that_does_not_fit_closes_the_stream_before_a_byte_lands(raw):
    sender, recv, inbox = raw
    slot = torch.zeros(ps.MIN_BYTES // 4)
    inbox.buffers = lambda h: [slot]
    for seq, body_bytes in ((5, 0), (1, 4)):  # a sequence number out of step; a byte count not the header's
        assert await sender.open() == ps.ACCEPT
        msg = Message("update", 0, 1, 1, tensors=[slot])
        header = encode_header(msg)
        sender.writer.write(ps.PREFIX.pack(seq, 0, ps.MIN_BYTES + body_bytes, len(header)) + header
                            + b"\xff" * ps.MIN_BYTES)
        try:  # closed by the receiver: a reset, since the rest of the payload was left unread
            assert await asyncio.wait_for(sender.reader.read(), TIMEOUT) == b""
        except ConnectionResetError:
            pass
        sender.writer.close()
    await sender.zmq(Message("token", 0, 1, 2), zseq=1)
    got = await inbox.get()  # a later control message still arrives
    assert got.kind == "token" and recv.stats.dropped == {"stream_desync": 2}
    assert not slot.any()


async def test_a_stream_of_another_wire_version_is_refused_in_one_log_line(raw, caplog):
    sender, recv, _inbox = raw
    with caplog.at_level("WARNING", logger=ps.__name__):
        assert await sender.open(version=ps.VERSION - 1) == b""
    lines = [r.getMessage() for r in caplog.records if "wire version" in r.getMessage()]
    assert len(lines) == 1 and f"version {ps.VERSION - 1}" in lines[0] and recv.stats.dropped == {"wire_version": 1}


async def test_a_refused_stream_sends_over_zeromq_instead(caplog):
    inbox = Inbox()
    b = await started(1, {0}, inbox)

    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(ps.HELLO.size)  # an older receiver: closes without an answer
        writer.close()

    server = await asyncio.start_server(refuse, "127.0.0.1", 0)
    a = await started(0, {1})
    try:
        await a.connect({1: ps.with_data_port(zmq_endpoint(b.address), server.sockets[0].getsockname()[1])})
        src = torch.randn(CHUNK_BYTES // 4)
        with caplog.at_level("WARNING"):
            await a.send(Message("update", 0, 1, 1, tensors=[src]))
            await a.send(Message("token", 0, 1, 2))
        got = await inbox.get()
        assert got.iter == 1 and torch.equal(got.tensors[0], src) and (await inbox.get()).iter == 2
        assert a.streamed_messages == 0 and any("payload stream" in r.getMessage() for r in caplog.records)
    finally:
        await a.close()
        await b.close()
        server.close()


async def test_many_interleavings_of_several_senders_keep_each_ones_order():
    inbox = Inbox()
    async with three_senders(inbox) as (recv, senders):
        plans = {}
        for s in senders:  # control, small (ZeroMQ) and large (stream) messages in a random order
            g = torch.Generator().manual_seed(s.rank)
            plans[s.rank] = torch.randint(0, 3, (60,), generator=g).tolist()
        sizes = {0: 0, 1: 1024, 2: ps.MIN_BYTES + 4}

        async def run(s: ZmqTransport) -> None:
            sends = []
            for i, what in enumerate(plans[s.rank]):
                tensors = [torch.full((sizes[what] // 4,), float(i))] if what else []
                sends.append(s.send(Message("update" if what else "token", s.rank, 3, i, tensors=tensors)))
                if i % 7 == 0:  # sometimes one at a time, sometimes several sends at once
                    await asyncio.gather(*sends)
                    sends = []
            await asyncio.gather(*sends)

        await asyncio.gather(*(run(s) for s in senders))
        seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
        for _ in range(180):
            m = await inbox.get()
            seen[m.src].append(m.iter)
            if m.tensors:
                assert torch.equal(m.tensors[0], torch.full_like(m.tensors[0], float(m.iter)))
        assert seen == {r: list(range(60)) for r in range(3)}
        assert all(s.streamed_messages == plans[s.rank].count(2) for s in senders)
        assert not recv.stats.dropped

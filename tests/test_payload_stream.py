"""ZmqTransport's payload stream: large tensor messages over a TCP stream, headers over ZeroMQ."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
import torch
import zmq
import zmq.asyncio

from hopnet.security import CurveKeys
from hopnet.transports import payload_stream as ps
from hopnet.transports.zmq import CHUNK_BYTES, ZmqTransport, zmq_endpoint
from hopnet.wire import Header, Message, encode_header

from support.transport_checks import Recorder

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


async def test_several_senders_at_once_keep_each_ones_order():
    inbox = Inbox()
    recv = await started(3, {0, 1, 2}, inbox)
    senders = [await started(r, {3}) for r in range(3)]
    try:
        for s in senders:
            await s.connect({3: recv.address})
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
    finally:
        for t in (*senders, recv):
            await t.close()


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
        deadline = time.monotonic() + 30
        while not recv.stats.dropped and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
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
            sock.sendall(ps.HELLO.pack(ps.MAGIC, ps.VERSION, 2, 12345))
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
    listener = socket.create_server(("127.0.0.1", 0))
    address = ps.with_data_port(router.getsockopt_string(zmq.LAST_ENDPOINT), listener.getsockname()[1])
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


async def test_a_prefix_that_does_not_match_its_header_closes_the_stream_before_a_byte_lands():
    inbox = Inbox()
    slot = torch.zeros(ps.MIN_BYTES // 4)
    inbox.buffers = lambda h: [slot]
    recv = await started(1, {0}, inbox)
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, b"0")
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        _, (host, port) = ps.split_address(recv.address)
        dealer.connect(zmq_endpoint(recv.address))
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(ps.HELLO.pack(ps.MAGIC, ps.VERSION, 0, 99))
        header = encode_header(Message("update", 0, 1, 1, tensors=[slot]))
        await dealer.send_multipart([ps.described(99, 0, header)])
        writer.write(ps.PREFIX.pack(5, ps.MIN_BYTES) + b"\xff" * ps.MIN_BYTES)  # sequence 5, not 0
        await writer.drain()
        await dealer.send_multipart([encode_header(Message("token", 0, 1, 2))])
        got = await inbox.get()  # the later control message still arrives
        assert got.kind == "token" and recv.stats.dropped == {"stream_desync": 1}
        assert not slot.any()
        try:  # closed by the receiver: a reset, since the rest of the payload was left unread
            assert await asyncio.wait_for(reader.read(), TIMEOUT) == b""
        except ConnectionResetError:
            pass
        writer.close()
    finally:
        dealer.close()
        ctx.term()
        await recv.close()

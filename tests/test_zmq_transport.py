"""ZmqTransport: round trips over tcp and ipc, chunked zero-copy tensors, malformed input."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from hopnet.errors import ConfigError, HopnetError
from hopnet.transports.base import DISCARD
from hopnet.transports.zmq import (
    CHUNK_BYTES,
    STAGE_BYTES,
    STAGE_INFLIGHT,
    ZmqTransport,
    routing_id,
    zmq_endpoint,
)
from hopnet.wire import Header, Message, decode_header

from support.wait import wait_until_async

TIMEOUT = 5.0


class Recv:
    """A Receiver that records what it gets; ``buffers`` decides what buffers_for returns."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Message] = asyncio.Queue()
        self.headers: list[Header] = []
        self.buffers: object = None
        self.fail_deliver = False

    def buffers_for(self, header: Header):
        self.headers.append(header)
        b = self.buffers
        return b(header) if callable(b) else b

    def deliver(self, msg: Message) -> None:
        if self.fail_deliver:
            self.fail_deliver = False
            raise RuntimeError("receiver bug")
        self.queue.put_nowait(msg)

    async def get(self) -> Message:
        return await asyncio.wait_for(self.queue.get(), TIMEOUT)


POLL_S = 0.005
"""How often a test looks at the stats it waits on."""


def bind_for(kind: str, tmp_path, name: str) -> str:
    return "tcp://127.0.0.1:*" if kind == "tcp" else f"ipc://{tmp_path}/{name}.sock"


@pytest.fixture(params=["tcp", "ipc"])
async def pair(request, tmp_path):
    a = ZmqTransport(0, frozenset({1}), bind=bind_for(request.param, tmp_path, "a"))
    b = ZmqTransport(1, frozenset({0}), bind=bind_for(request.param, tmp_path, "b"))
    ra, rb = Recv(), Recv()
    addr_a = await a.start(ra)
    addr_b = await b.start(rb)
    assert addr_a.startswith(request.param + "://") and not addr_a.endswith("*")
    await a.connect({1: addr_b})
    await b.connect({0: addr_a})
    yield a, b, ra, rb
    await a.close()
    await b.close()


async def test_control_round_trip(pair):
    a, b, ra, rb = pair
    await a.send(Message("hello", 0, 1, 7, tag="t1", meta={"lr": 0.5, "ids": [1, 2]}))
    m = await rb.get()
    assert (m.kind, m.src, m.dst, m.iter, m.tag, m.meta, m.tensors) == ("hello", 0, 1, 7, "t1",
                                                                         {"lr": 0.5, "ids": [1, 2]}, [])
    await b.send(Message("ack", 1, 0, 7))
    m = await ra.get()
    assert (m.kind, m.src, m.iter) == ("ack", 1, 7)
    assert a.stats.sent_messages == 1 and b.stats.received_messages == 1
    assert not a.stats.dropped and not b.stats.dropped
    assert rb.headers == []  # buffers_for is not asked for messages without tensors


async def test_tensor_dtypes_and_shapes(pair):
    a, b, _ra, rb = pair
    tensors = [
        torch.randn(3, 4),
        torch.randn(5, 7).to(torch.bfloat16),
        torch.tensor(-123456789012, dtype=torch.int64),  # 0-d
        torch.empty(0, 3),  # empty
        torch.arange(100_000, dtype=torch.int64).reshape(100, 1000),  # above the copy threshold
        torch.tensor([True, False, True]),
        torch.randn(2, 3).to(torch.float16),
        torch.randn(4, requires_grad=True),
    ]
    await a.send(Message("update", 0, 1, 3, tensors=tensors))
    m = await rb.get()
    assert len(m.tensors) == len(tensors)
    for got, want in zip(m.tensors, tensors):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    assert a.stats.sent_bytes == nbytes and b.stats.received_bytes == nbytes


async def test_large_tensor_chunked_into_preallocated_buffer(pair):
    a, _b, _ra, rb = pair
    src = torch.randint(-2**31, 2**31 - 1, ((40 << 20) // 4,), dtype=torch.int32).view(torch.float32)
    expected = src.clone()
    slot = torch.empty_like(src)
    ptr = slot.data_ptr()
    rb.buffers = [slot]
    await a.send(Message("update", 0, 1, 1, tensors=[src]))
    src.zero_()  # send() returned: the caller may reuse the memory at once
    m = await rb.get()
    assert m.tensors[0] is slot and slot.data_ptr() == ptr
    assert torch.equal(slot.view(torch.int32), expected.view(torch.int32))  # bit-exact
    assert rb.headers[0].specs[0].nbytes == 40 << 20 > 2 * CHUNK_BYTES


async def test_discard_counts_a_drop(pair):
    a, b, _ra, rb = pair
    rb.buffers = DISCARD
    await a.send(Message("update", 0, 1, 1, tensors=[torch.ones(1000)]))
    await wait_until_async(lambda: b.stats.dropped["discarded"] == 1, TIMEOUT, interval=POLL_S, what="the discard")
    rb.buffers = None
    await a.send(Message("update", 0, 1, 2, tensors=[torch.ones(10)]))
    m = await rb.get()
    assert m.iter == 2 and b.stats.received_messages == 1


async def test_bad_buffers_and_receiver_errors_do_not_kill_the_loop(pair):
    a, b, _ra, rb = pair
    rb.buffers = [torch.empty(3)]  # wrong shape for what arrives
    await a.send(Message("update", 0, 1, 1, tensors=[torch.ones(4)]))
    await wait_until_async(lambda: b.stats.dropped["bad_buffers"] == 1, TIMEOUT, interval=POLL_S,
                           what="the bad buffers' drop")
    rb.buffers = None
    rb.fail_deliver = True
    await a.send(Message("token", 0, 1, 2))
    await wait_until_async(lambda: b.stats.dropped["internal_error"] == 1, TIMEOUT, interval=POLL_S,
                           what="the receiver error's drop")
    await a.send(Message("token", 0, 1, 3))
    assert (await rb.get()).iter == 3


def raw_header(kind="update", src=0, dst=1, it=0, specs=()) -> bytes:
    head = {"k": kind, "s": src, "d": dst, "i": it}
    if specs:
        head["x"] = [list(s) for s in specs]
    return msgpack.packb(head, use_bin_type=True)


async def test_malformed_input_is_dropped_by_reason():
    t = ZmqTransport(1, frozenset({0, 2}))
    rec = Recv()
    addr = await t.start(rec)
    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.ROUTING_ID, routing_id(0))
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(zmq_endpoint(addr))
    f32_4 = ("float32", [4])
    cases = [
        ("bad_header", [b"\xc1 not msgpack"]),
        ("bad_header", [msgpack.packb([1, 2, 3])]),
        ("unknown_kind", [raw_header(kind="no_such_kind")]),
        ("bad_dtype", [raw_header(specs=[("complex64", [2])]), b"\0" * 16]),
        ("bad_size", [raw_header(specs=[f32_4]), b"\0" * 12]),  # shape says 16 bytes
        ("truncated", [raw_header(specs=[f32_4, f32_4]), b"\0" * 16]),  # a frame is missing
        ("truncated", [raw_header(specs=[("uint8", [CHUNK_BYTES + 1])]), b"\0" * 8]),  # chunks missing
        ("extra_frames", [raw_header(specs=[f32_4]), b"\0" * 16, b"\0" * 16]),
        ("extra_frames", [raw_header(kind="token"), b"surprise"]),
        ("not_neighbor", [raw_header(src=5)]),
        ("spoofed_src", [raw_header(src=2)]),  # a neighbour, but not the one connected
        ("wrong_dst", [raw_header(dst=7)]),
    ]
    try:
        for i, (reason, parts) in enumerate(cases):
            before = t.stats.dropped[reason]
            await raw.send_multipart(parts)
            await wait_until_async(lambda: t.stats.dropped[reason] == before + 1, TIMEOUT, interval=POLL_S,
                                   what=f"a {reason} drop")
            # the receive loop survived: a valid message still arrives
            await raw.send_multipart([raw_header(specs=[f32_4], it=i), torch.arange(4.0).numpy().tobytes()])
            m = await rec.get()
            assert m.iter == i and torch.equal(m.tensors[0], torch.arange(4.0))
        assert t.stats.dropped_total == len(cases)
        assert t.stats.received_messages == len(cases)
        assert "internal_error" not in t.stats.dropped
    finally:
        raw.close(0)
        ctx.term()
        await t.close()


async def test_queues_until_the_peer_is_up(tmp_path):
    """Messages sent before the peer has bound are delivered once it appears."""
    addr_b = f"ipc://{tmp_path}/late.sock"
    a = ZmqTransport(0, frozenset({1}))
    await a.start(Recv())
    await a.connect({1: addr_b})
    await a.send(Message("hello", 0, 1, 0))
    mid = torch.randn(1 << 18)  # 1 MiB: staged, so send() returns at once
    await a.send(Message("update", 0, 1, 1, tensors=[mid]))
    expected_mid = mid.clone()
    mid.zero_()
    big = torch.randn((STAGE_BYTES // 4) + 1)  # zero-copy
    sending = asyncio.create_task(a.send(Message("update", 0, 1, 2, tensors=[big])))
    await asyncio.sleep(0.1)
    assert not sending.done()  # libzmq still holds the tensor memory
    b = ZmqTransport(1, frozenset({0}), bind=addr_b)
    rb = Recv()
    assert await b.start(rb) == addr_b
    try:
        assert (await rb.get()).kind == "hello"
        assert torch.equal((await rb.get()).tensors[0], expected_mid)
        assert torch.equal((await rb.get()).tensors[0], big)
        await asyncio.wait_for(sending, TIMEOUT)
    finally:
        await a.close()
        await b.close()


async def test_send_latest_keeps_only_the_newest_behind_a_busy_link(tmp_path):
    """While the link is busy, send_latest holds one snapshot per peer (newer ones replace
    it), control messages go ahead of it, and it leaves once the link frees."""
    addr_b = f"ipc://{tmp_path}/slow.sock"
    a = ZmqTransport(0, frozenset({1}))
    await a.start(Recv())
    await a.connect({1: addr_b})  # nobody listens yet: what goes into libzmq stays there
    first = torch.full((1 << 16,), 0.0)  # 256 KiB: staged
    await a.send_latest(Message("update", 0, 1, 0, tensors=[first]))  # link idle: sent at once
    assert a.backlogged(1)
    params = torch.empty(1 << 16)
    for k in (1, 2, 3):
        params.fill_(float(k))
        await a.send_latest(Message("update", 0, 1, k, tensors=[params]))
    params.fill_(-1.0)  # the held copy is a snapshot
    await a.send(Message("token", 0, 1, 3, meta={"c": 1}))
    assert a.stats.dropped["superseded"] == 2
    b = ZmqTransport(1, frozenset({0}), bind=addr_b)
    rb = Recv()
    await b.start(rb)
    try:
        got = [await rb.get() for _ in range(3)]
        assert [(m.kind, m.iter) for m in got] == [("update", 0), ("token", 3), ("update", 3)]
        assert torch.equal(got[2].tensors[0], torch.full((1 << 16,), 3.0))
        await asyncio.wait_for(a.drain(), TIMEOUT)
        await wait_until_async(lambda: not a.backlogged(1), TIMEOUT, interval=POLL_S, what="the backlog to clear")
        await a.send_latest(Message("update", 0, 1, 4, tensors=[params]))  # idle link again: straight out
        assert (await rb.get()).iter == 4
        assert a.stats.dropped["superseded"] == 2 and rb.queue.empty()
    finally:
        await a.close()
        await b.close()


async def test_express_messages_overtake_a_backlog_of_tensors():
    """A token sent with send_express reaches the peer ahead of updates still queued to it,
    and the peer accepts it from the sender's second connection."""
    ctx = zmq.asyncio.Context()
    slow = ctx.socket(zmq.ROUTER)  # a peer that reads nothing until told: the updates back up
    slow.setsockopt(zmq.RCVHWM, 1)
    slow.setsockopt(zmq.LINGER, 0)
    port = slow.bind_to_random_port("tcp://127.0.0.1")
    a = ZmqTransport(0, frozenset({1}))
    await a.start(Recv())
    await a.connect({1: f"tcp://127.0.0.1:{port}"})
    try:
        sends = [asyncio.create_task(a.send(Message("update", 0, 1, k, tensors=[torch.ones(1 << 20)])))
                 for k in range(12)]  # 4 MiB each, zero-copy: far more than the socket buffers hold
        await wait_until_async(lambda: a.backlogged(1), TIMEOUT, interval=POLL_S, what="a backlog to rank 1")
        await asyncio.sleep(0.2)
        await a.send_express(Message("token", 0, 1, 99, meta={"c": 1}))
        order = []
        while len(order) < 13:
            frames = await asyncio.wait_for(slow.recv_multipart(copy=False), TIMEOUT)
            header = decode_header(frames[1].buffer)
            order.append((header.kind, frames[0].bytes))
        # Ahead of most of the 12 updates; a few may already sit in the kernel's socket buffers,
        # and how many depends on the scheduling of the sender's I/O thread.
        assert order.index(("token", b"x0")) < 6, order
        assert [k for k, _ in order].count("update") == 12
        await asyncio.wait_for(asyncio.gather(*sends), TIMEOUT)
    finally:
        await a.close()
        slow.close(0)
        ctx.term()


async def test_a_peer_accepts_express_messages_as_its_own(pair):
    a, b, _ra, rb = pair
    await a.send_express(Message("token", 0, 1, 5, meta={"c": 2}))
    got = await rb.get()
    assert (got.kind, got.src, got.iter, got.meta) == ("token", 0, 5, {"c": 2})
    assert b.stats.dropped_total == 0


async def test_drain_gives_up_on_a_link_that_never_frees(tmp_path):
    a = ZmqTransport(0, frozenset({1}), send_timeout=0.3)
    await a.start(Recv())
    await a.connect({1: f"ipc://{tmp_path}/never.sock"})
    await a.send_latest(Message("update", 0, 1, 0, tensors=[torch.ones(1 << 16)]))
    await a.send_latest(Message("update", 0, 1, 1, tensors=[torch.ones(1 << 16)]))
    await asyncio.wait_for(a.drain(), TIMEOUT)  # bounded by the send timeout, not a hang
    assert a.stats.dropped["send_timeout"] >= 1
    await a.close()


async def test_send_to_a_missing_peer_times_out(tmp_path):
    a = ZmqTransport(0, frozenset({1}), send_timeout=0.2)
    await a.start(Recv())
    await a.connect({1: f"ipc://{tmp_path}/nobody.sock"})
    t0 = time.monotonic()
    await a.send(Message("update", 0, 1, 0, tensors=[torch.ones((STAGE_BYTES // 4) + 1)]))
    assert time.monotonic() - t0 < 10.0  # gave up: no hang
    assert a.stats.dropped["send_timeout"] == 1 and a.stats.sent_messages == 0
    # staged sends return at once while at most STAGE_INFLIGHT of them wait in libzmq
    for i in range(STAGE_INFLIGHT):
        await asyncio.wait_for(a.send(Message("update", 0, 1, 1 + i, tensors=[torch.ones(1 << 18)])), 1.0)
    t0 = time.monotonic()
    await a.send(Message("update", 0, 1, 9, tensors=[torch.ones(1 << 18)]))
    assert 0.15 < time.monotonic() - t0 < 10.0  # waited for the send timeout, then gave up
    assert a.stats.dropped["send_timeout"] == 2
    assert a._peers[1].staged == 0  # the reset released the staged buffers
    await a.send(Message("hello", 0, 1, 1))  # the reset connection still accepts sends
    t0 = time.monotonic()
    await a.close()
    assert time.monotonic() - t0 < 10.0  # gave up: no hang


async def test_forget_peer_releases_pending_sends(tmp_path):
    a = ZmqTransport(0, frozenset({1}))
    await a.start(Recv())
    await a.connect({1: f"ipc://{tmp_path}/gone.sock"})
    sending = asyncio.create_task(a.send(Message("update", 0, 1, 0, tensors=[torch.ones(1 << 21)])))
    await asyncio.sleep(0.05)
    assert not sending.done()
    a.forget_peer(1)
    await asyncio.wait_for(sending, 2.0)  # not the 60 s send timeout
    await a.send(Message("token", 0, 1, 1))
    assert a.stats.dropped["peer_left"] == 1
    await a.close()


async def test_lifecycle_errors(tmp_path):
    with pytest.raises(ConfigError):
        ZmqTransport(0, frozenset(), bind="udp://127.0.0.1:5")
    a = ZmqTransport(0, frozenset({1}))
    await a.start(Recv())
    with pytest.raises(HopnetError):
        await a.send(Message("hello", 0, 1, 0))  # not connected
    with pytest.raises(ConfigError):
        await a.connect({1: "127.0.0.1:80"})
    await a.close()
    await a.close()  # idempotent
    with pytest.raises(HopnetError):
        await a.send(Message("hello", 0, 1, 0))


async def test_concurrent_sends_keep_their_order(pair):
    """Sends started from many tasks at once (as Node.post does) arrive in call order."""
    a, b, _ra, rb = pair
    sizes = [0, 1 << 18, 10, (STAGE_BYTES // 4) + 1000, 1 << 18, 1 << 18, 1 << 18, 0, 3 << 18, 5]
    msgs = []
    for i in range(40):
        n = sizes[i % len(sizes)]
        tensors = [torch.full((n,), float(i))] if n else []
        msgs.append(Message("update" if n else "token", 0, 1, i, tensors=tensors))
    await asyncio.gather(*(asyncio.create_task(a.send(m)) for m in msgs))
    for i in range(40):
        m = await rb.get()
        assert m.iter == i
        assert all(torch.all(t == i) for t in m.tensors)
    assert a.stats.sent_messages == 40 and not b.stats.dropped


def test_default_bind_is_loopback():
    assert ZmqTransport(0, frozenset()).bind == "tcp://127.0.0.1:*"


def test_runs_on_uvloop():
    uvloop = pytest.importorskip("uvloop")

    async def main() -> None:
        a = ZmqTransport(0, frozenset({1}))
        b = ZmqTransport(1, frozenset({0}))
        ra, rb = Recv(), Recv()
        await a.connect({1: await b.start(rb)})
        await b.connect({0: await a.start(ra)})
        try:
            await a.send(Message("hello", 0, 1, 0))
            assert (await rb.get()).kind == "hello"
            x = torch.randn(3 << 20)  # 12 MiB: one frame
            y = torch.randn((CHUNK_BYTES // 4) + 5)  # one chunk and 20 bytes: two frames
            await b.send(Message("update", 1, 0, 1, tensors=[x, y]))
            m = await ra.get()
            assert torch.equal(m.tensors[0], x) and torch.equal(m.tensors[1], y)
        finally:
            await a.close()
            await b.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert isinstance(runner.get_loop(), uvloop.Loop)
        runner.run(main())

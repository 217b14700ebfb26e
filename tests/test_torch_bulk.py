"""The torch bulk plane: headers over ZeroMQ, tensors over gloo (NCCL where CUDA is present)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import torch

from hopnet.errors import PeerFailure
from hopnet.rendezvous.store import connect_store, host_store
from hopnet.transports.base import DISCARD
from hopnet.transports.torchdist import BULK_KEY, TorchBulkTransport
from hopnet.transports.zmq import ZmqTransport
from hopnet.wire import Header, Message

from support.launch import launch_in_process
from support.wait import wait_until_async

TIMEOUT = 30.0


class Recv:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[Message] = asyncio.Queue()
        self.headers: list[Header] = []
        self.buffers: object = None
        self.holding: Callable[[Header], bool] = lambda header: False
        self.lost: list[PeerFailure] = []

    def buffers_for(self, header: Header):
        self.headers.append(header)
        b = self.buffers
        return b(header) if callable(b) else b

    def hold(self, header: Header) -> bool:
        return self.holding(header)

    def deliver(self, msg: Message) -> None:
        self.queue.put_nowait(msg)

    def peer_lost(self, failure: PeerFailure) -> None:
        self.lost.append(failure)

    async def get(self) -> Message:
        return await asyncio.wait_for(self.queue.get(), TIMEOUT)


@pytest.fixture
def store_endpoint():
    hosted = host_store("127.0.0.1")
    yield hosted.endpoint
    hosted.close()


async def _pair(endpoint: str, *, min_bytes: int = 0, device: str = "cpu", timeout_s: float = TIMEOUT):
    transports, receivers, addresses = [], [], {}
    for rank in (0, 1):
        control = ZmqTransport(rank, frozenset({1 - rank}))
        t = TorchBulkTransport(control, connect_store(endpoint, 10), min_bytes=min_bytes,
                               timeout_s=timeout_s, device=device)
        r = Recv()
        addresses[rank] = await t.start(r)
        transports.append(t)
        receivers.append(r)
    for rank, t in enumerate(transports):
        await t.connect({1 - rank: addresses[1 - rank]})
    return transports, receivers


async def test_tensors_land_in_the_receivers_buffers_in_send_order(store_endpoint) -> None:
    (a, b), (_ra, rb) = await _pair(store_endpoint)
    try:
        pool = [torch.zeros(1000) for _ in range(6)]
        handed: list[torch.Tensor] = []

        def slot(header: Header):
            assert BULK_KEY not in (header.meta or {}) and header.specs[0].shape == (1000,)
            handed.append(pool[len(handed)])
            return [handed[-1]]

        rb.buffers = slot
        sends = [a.send(Message("update", 0, 1, k, meta={"c": k}, tensors=[torch.full((1000,), float(k))]))
                 for k in range(6)]
        sends.insert(3, a.send(Message("token", 0, 1, 99, meta={"c": 1})))  # control, in the middle
        await asyncio.gather(*sends)
        got = [await rb.get() for _ in range(7)]
        assert [m.iter for m in got] == [0, 1, 2, 99, 3, 4, 5]  # per-sender order kept across planes
        for m in got:
            if m.kind == "update":
                assert m.meta == {"c": m.iter}
                assert torch.equal(m.tensors[0], torch.full((1000,), float(m.iter)))
        assert all(any(m.tensors[0] is p for p in pool) for m in got if m.kind == "update")
        assert a.bulk_sent == 6 and b.bulk_received == 6
    finally:
        await a.close()
        await b.close()


async def test_discarded_payloads_are_consumed_so_later_ones_still_pair_up(store_endpoint) -> None:
    (a, b), (_ra, rb) = await _pair(store_endpoint)
    try:
        rb.buffers = lambda h: DISCARD if h.iter % 2 == 0 else None
        for k in range(6):
            await a.send(Message("update", 0, 1, k, tensors=[torch.full((50, 4), float(k), dtype=torch.float64)]))
        got = [await rb.get() for _ in range(3)]
        assert [m.iter for m in got] == [1, 3, 5]
        assert all(torch.equal(m.tensors[0], torch.full((50, 4), float(m.iter), dtype=torch.float64)) for m in got)
        assert b.stats.dropped["discarded"] == 3
    finally:
        await a.close()
        await b.close()


async def test_a_held_payload_waits_unread_with_what_its_sender_sent_after_it(store_endpoint) -> None:
    """The receiver holds update 1 back: its sender's send waits (the payload has not moved), the token
    sent after it waits behind it, and a later update does not take its receive. Taken in, all three
    arrive in order, into the receiver's buffers."""
    (a, b), (_ra, rb) = await _pair(store_endpoint)
    try:
        size = 1 << 20  # 4 MiB of float32
        rb.holding = lambda header: header.iter == 1
        rb.buffers = lambda header: [torch.zeros(size)]
        sends = [asyncio.ensure_future(a.send(Message("update", 0, 1, k, tensors=[torch.full((size,), float(k))])))
                 for k in range(2)]
        sends.append(asyncio.ensure_future(a.send(Message("token", 0, 1, 99, meta={"c": 1}))))
        sends.append(asyncio.ensure_future(a.send(Message("update", 0, 1, 2, tensors=[torch.full((size,), 2.0)]))))
        assert (await rb.get()).iter == 0
        await asyncio.sleep(0.3)
        assert not sends[1].done() and not sends[3].done() and rb.queue.empty()
        rb.holding = lambda header: False
        b.take_in_held()
        got = [await rb.get() for _ in range(3)]
        assert [m.iter for m in got] == [1, 99, 2]
        assert torch.equal(got[0].tensors[0], torch.full((size,), 1.0))
        assert torch.equal(got[2].tensors[0], torch.full((size,), 2.0))
        await asyncio.gather(*sends)
    finally:
        await a.close()
        await b.close()


async def test_what_a_forgotten_peer_sent_is_not_held_for_ever(store_endpoint) -> None:
    """A peer written off (dead) while the receiver held its update: the held update is dropped unread,
    and what came behind it is delivered (the node drops it as from a dead peer)."""
    (a, b), (_ra, rb) = await _pair(store_endpoint, timeout_s=5.0)  # the sender's send gives up then
    try:
        rb.holding = lambda header: True
        send = asyncio.ensure_future(a.send(Message("update", 0, 1, 0, tensors=[torch.ones(1000)])))
        token = asyncio.ensure_future(a.send(Message("token", 0, 1, 99, meta={"c": 1})))  # sent after the update
        await token
        await asyncio.sleep(0.3)
        assert rb.queue.empty()
        b.forget_peer(0)
        assert (await rb.get()).iter == 99
        assert b.stats.dropped["discarded"] == 1 and not rb.headers  # never given buffers
        send.cancel()
    finally:
        await a.close()
        await b.close()


async def test_a_beat_is_delivered_at_once_even_behind_a_payload_not_taken_in(store_endpoint) -> None:
    """Beats go over ZeroMQ's express connection and are signs of life, not messages to keep in
    order: one sent after an update the receiver holds arrives at once (a token waits behind the
    update), so a peer whose large payload is still on its way is not taken for silent."""
    (a, b), (_ra, rb) = await _pair(store_endpoint)
    try:
        rb.holding = lambda header: True
        send = asyncio.ensure_future(a.send(Message("update", 0, 1, 0, tensors=[torch.ones(1000)])))
        await asyncio.sleep(0.3)  # its header is out
        await a.send(Message("token", 0, 1, 99, meta={"c": 1}))
        await a.send_express(Message("beat", 0, 1, 0))
        got = await rb.get()
        assert got.kind == "beat" and rb.queue.empty()  # the token still waits behind the held update
        rb.holding = lambda header: False
        b.take_in_held()
        assert [(await rb.get()).iter for _ in range(2)] == [0, 99]
        await send
    finally:
        await a.close()
        await b.close()


async def test_a_send_to_a_peer_declared_dead_ends_at_once_and_close_does_not_wait_for_it(store_endpoint) -> None:
    """The receiver never takes the payload in (as a stopped process would not): the sender's send
    waits inside gloo. Once the sender writes the peer off (its heartbeats declared it dead: no
    bye), the send ends at once, dropped as to a peer that left, and close does not wait for the
    thread still inside gloo's wait (--timeout is 30 s here)."""
    (a, b), (_ra, rb) = await _pair(store_endpoint)
    try:
        rb.holding = lambda header: True
        send = asyncio.ensure_future(a.send(Message("update", 0, 1, 0, tensors=[torch.ones(1000)])))
        await asyncio.sleep(0.3)
        assert not send.done()
        started = time.monotonic()
        a.forget_peer(1)
        await asyncio.wait_for(send, 2.0)
        assert a.stats.dropped["peer_left"] == 1
        await asyncio.wait_for(a.close(), 2.0)
        assert time.monotonic() - started < TIMEOUT / 2
    finally:
        await a.close()
        await b.close()


async def test_a_peer_that_beats_but_owes_an_update_is_stalled_not_dead_on_the_torch_plane(store_endpoint) -> None:
    """The torch plane runs heartbeats too: rank 1 never steps, for longer than the peer timeout, yet
    its node still beats, so rank 0's wait runs into --timeout and names rank 1 stalled, not dead."""
    from hopnet import Graph, ProtocolConfig, WaitTimeout

    from support.cluster import start_workers, train

    def torch_plane(rank: int, graph: Graph) -> TorchBulkTransport:
        control = ZmqTransport(rank, frozenset(graph.peers(rank)))
        return TorchBulkTransport(control, connect_store(store_endpoint, 10), timeout_s=TIMEOUT)

    config = ProtocolConfig(timeout_s=2.0, peer_timeout_s=0.5)
    workers = await start_workers(Graph.ring(2), config, transport_for=torch_plane)
    workers[1].plan(5)  # it starts its loop (its update of iteration 0 goes out), then never steps
    try:
        with pytest.raises(WaitTimeout) as info:
            await train(workers[0], 5)
    finally:
        await asyncio.gather(*(w.close() for w in workers))
    assert (info.value.peer, info.value.peer_state) == (1, "stalled")
    assert workers[0].node.dead == {}


async def test_small_messages_stay_on_zeromq_below_min_bytes(store_endpoint) -> None:
    (a, b), (_ra, rb) = await _pair(store_endpoint, min_bytes=4096)
    try:
        await a.send(Message("update", 0, 1, 0, tensors=[torch.ones(10)]))          # 40 B: zmq frames
        await a.send(Message("update", 0, 1, 1, tensors=[torch.ones(2000)]))        # 8 KB: gloo
        got = [await rb.get() for _ in range(2)]
        assert [m.iter for m in got] == [0, 1]
        assert torch.equal(got[0].tensors[0], torch.ones(10)) and torch.equal(got[1].tensors[0], torch.ones(2000))
        assert a.bulk_sent == 1
    finally:
        await a.close()
        await b.close()


async def test_a_dead_peer_is_a_named_failure_not_a_hang(store_endpoint) -> None:
    (a, b), (_ra, rb) = await _pair(store_endpoint, timeout_s=5.0)
    try:
        await a.send(Message("update", 0, 1, 0, tensors=[torch.ones(100)]))
        await rb.get()
        await b.close()  # the peer's process group goes away
        started = time.monotonic()
        with pytest.raises(PeerFailure, match="rank 1") as info:
            for k in range(1, 50):
                await a.send(Message("update", 0, 1, k, tensors=[torch.ones(1 << 18)]))
        assert info.value.peer == 1
        assert time.monotonic() - started < 60
    finally:
        await a.close()
        await b.close()


async def test_a_peer_still_starting_does_not_hold_up_the_channel_to_a_ready_one(store_endpoint) -> None:
    """Each pair group forms in its own thread; they must not share one store connection,
    whose lock a blocking wait holds (a ring of ranks deadlocked on it until the store timed out)."""
    slow = 40.0
    transports, receivers, addresses = [], [], {}
    for rank in (0, 1, 2):
        control = ZmqTransport(rank, frozenset({0, 1, 2} - {rank}))
        t = TorchBulkTransport(control, connect_store(store_endpoint, slow), timeout_s=slow)
        receivers.append(Recv())
        addresses[rank] = await t.start(receivers[-1])
        transports.append(t)
    a, b, _never = transports
    try:
        await a.connect({2: addresses[2]})  # rank 2 never connects: rank 0's group with it waits in the store
        await asyncio.sleep(0.5)
        await a.connect({1: addresses[1]})
        await b.connect({0: addresses[0]})
        started = time.monotonic()
        await a.send(Message("update", 0, 1, 0, tensors=[torch.arange(100.0)]))
        got = await asyncio.wait_for(receivers[1].queue.get(), 2 * slow)
        # A loop blocked behind the shared connection cannot even time out: measure instead.
        assert time.monotonic() - started < slow / 2, "the channel waited for the other peer's store timeout"
        assert torch.equal(got.tensors[0], torch.arange(100.0))
    finally:
        for t in transports:
            await t.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL refuses two ranks on one GPU)")
async def test_cuda_tensors_travel_over_nccl_without_leaving_the_gpu(store_endpoint) -> None:
    transports, receivers = [], []
    addresses = {}
    for rank in (0, 1):
        t = TorchBulkTransport(ZmqTransport(rank, frozenset({1 - rank})), connect_store(store_endpoint, 10),
                               timeout_s=TIMEOUT, device=f"cuda:{rank}")
        receivers.append(Recv())
        addresses[rank] = await t.start(receivers[-1])
        transports.append(t)
    a, b = transports
    rb = receivers[1]
    try:
        await a.connect({1: addresses[1]})
        await b.connect({0: addresses[0]})
        slot = torch.zeros(1 << 20, device="cuda:1")
        rb.buffers = [slot]
        await a.send(Message("update", 0, 1, 0, tensors=[torch.full((1 << 20,), 3.0, device="cuda:0")]))
        m = await rb.get()
        assert m.tensors[0] is slot and slot.device == torch.device("cuda:1")  # landed in the GPU slot
        assert torch.equal(slot.cpu(), torch.full((1 << 20,), 3.0))
    finally:
        await a.close()
        await b.close()


def test_bulk_option_is_validated_on_the_command_line(tmp_path) -> None:

    from hopnet.config import ProtocolConfig
    from hopnet.errors import ConfigError

    assert ProtocolConfig().bulk == "auto" and ProtocolConfig(bulk="torch").bulk == "torch"
    with pytest.raises(ConfigError, match=r"--bulk must be one of zmq, torch, auto \(got 'nccl'\)"):
        ProtocolConfig(bulk="nccl")
    script = tmp_path / "w.py"
    script.write_text("print('ran')\n")
    proc = launch_in_process(["--bulk", "fast", str(script)])
    assert proc.returncode == 2 and "--bulk" in proc.stderr and "ran" not in proc.stdout


def test_auto_picks_the_plane_by_device_and_size(store_endpoint) -> None:
    from hopnet.bootstrap.plane import AUTO_CPU_MIN_BYTES, make_transport

    def pick(bulk: str, nbytes: int | None, endpoint: str = store_endpoint) -> str:
        t = make_transport(rank=0, peers=frozenset({1}), bind_host="127.0.0.1", bulk=bulk,
                           device=torch.device("cpu"), store_endpoint=endpoint, timeout_s=10,
                           message_bytes=nbytes)
        return type(t).__name__

    assert pick("zmq", 1 << 30) == "ZmqTransport"
    assert pick("torch", 16) == "TorchBulkTransport"
    assert AUTO_CPU_MIN_BYTES is not None
    assert pick("auto", AUTO_CPU_MIN_BYTES - 1) == "ZmqTransport"
    assert pick("auto", AUTO_CPU_MIN_BYTES) == "TorchBulkTransport"
    assert pick("auto", AUTO_CPU_MIN_BYTES, endpoint="") == "ZmqTransport"  # no store: stay on ZeroMQ
    from hopnet.errors import ConfigError
    with pytest.raises(ConfigError, match="needs the run's c10d store"):
        pick("torch", 16, endpoint="")


async def test_a_peer_that_vanishes_is_declared_dead_on_the_torch_plane_too(store_endpoint) -> None:
    """A peer whose process ends without a bye closes its pair connections: the send that finds
    one closed declares that peer dead, long before the wait's timeout (the sender used to fail
    on its own send, naming no peer, or the survivors waited out --timeout)."""
    from hopnet import Graph, ProtocolConfig

    from support.cluster import failure_after_a_peer_vanishes, start_workers

    def torch_plane(rank: int, graph: Graph) -> TorchBulkTransport:
        control = ZmqTransport(rank, frozenset(graph.peers(rank)))
        return TorchBulkTransport(control, connect_store(store_endpoint, 10), timeout_s=TIMEOUT)

    # The heartbeats (the torch plane runs them too) would declare it silent after --peer-timeout:
    # longer than the transport's 2 s grace for a bye here, so it is the transport that finds it gone.
    config = ProtocolConfig(timeout_s=TIMEOUT, peer_timeout_s=10.0)
    workers = await start_workers(Graph.ring(2), config, transport_for=torch_plane)
    error, took = await failure_after_a_peer_vanishes(workers)
    assert took < TIMEOUT / 2
    assert (error.peer, error.peer_state) == (1, "dead")
    assert "peer 1 is gone (dead: " in str(error)  # in the transport's words
    assert "GLHF" not in str(error)  # (gloo's advice is left out)


async def test_the_consensus_reaches_ranks_that_are_not_neighbours_on_the_torch_plane(store_endpoint) -> None:
    """The agreement on the live set sends views to every rank, neighbour or not: the torch plane's
    control plane must take them in from the whole run (ranks 0 and 2 of a ring of 4 never talk
    otherwise). It did not, and a consensus on the torch plane waited out --timeout."""
    from hopnet import Graph, ProtocolConfig

    from support.cluster import close_workers, start_workers, train

    def torch_plane(rank: int, graph: Graph) -> TorchBulkTransport:
        control = ZmqTransport(rank, frozenset(graph.peers(rank)))
        return TorchBulkTransport(control, connect_store(store_endpoint, 10), timeout_s=TIMEOUT)

    workers = await start_workers(Graph.ring(4), ProtocolConfig(timeout_s=TIMEOUT), transport_for=torch_plane,
                                  params=lambda rank: torch.full((8,), float(rank)))
    try:
        await asyncio.gather(*(train(w, 3) for w in workers))
        await asyncio.gather(*(w.node.quiesce() for w in workers))
        before = torch.stack([w.node.protocol.model_tensors()[0].double() for w in workers]).mean(0)
        results = await asyncio.wait_for(asyncio.gather(*(w.consensus() for w in workers)), TIMEOUT)
    finally:
        await close_workers(workers)
    assert all(r.members == (0, 1, 2, 3) for r in results)
    for w in workers:
        assert torch.allclose(w.node.protocol.model_tensors()[0].double(), before, rtol=0, atol=1e-6)


def _fork_pair_member(endpoint: str, rank: int, peer: int, payload: torch.Tensor) -> tuple[int, int]:
    """A child process that forms the gloo pair (rank, peer) through the store, sends ``payload``
    on it once, and then only sleeps: a peer whose process a test kills. (pid, a pipe's read end
    that says when the payload is on its way)."""
    import os

    from hopnet.transports.torchdist import build_pair_group

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        try:
            os.close(read_end)
            pg = build_pair_group(connect_store(endpoint, 10), "gloo", rank, peer, timeout_s=TIMEOUT)
            work = pg.send([payload], 0 if peer < rank else 1, 0)
            os.write(write_end, b"x")
            work.wait()
            time.sleep(TIMEOUT)
        finally:
            os._exit(0)
    os.close(write_end)
    return pid, read_end


def _bulk_header(src: int, dst: int, iteration: int, tensor: torch.Tensor) -> Message:
    from hopnet.transports.torchdist import encode_bulk

    return Message("update", src, dst, iteration, meta={BULK_KEY: encode_bulk("gloo", [tensor])})


def _watch_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("hopnet-watch-")]


@pytest.mark.parametrize("receiving", [True, False], ids=["receiving", "idle"])
async def test_a_killed_peer_is_reported_lost_by_the_receive_side_once(store_endpoint, monkeypatch,
                                                                       receiving: bool) -> None:
    """A peer whose process is SIGKILLed while this side sends it nothing (no send of ours would find
    it gone), waiting for a payload from it or not: the pair's watch (and the pending receive) fail
    with the connection closed, and the receiver hears ``peer_lost`` once, naming the peer dead;
    later sends to it fail at once naming it."""
    import os
    import signal

    import hopnet.transports.torchdist as torchdist

    monkeypatch.setattr(torchdist, "DEPARTURE_GRACE_S", 0.2)
    control = ZmqTransport(0, frozenset({1}))
    a = TorchBulkTransport(control, connect_store(store_endpoint, 10), timeout_s=TIMEOUT)
    ra = Recv()
    await a.start(ra)
    pid, ready = _fork_pair_member(store_endpoint, 1, 0, torch.full((4,), 7.0))
    try:
        await a.connect({1: "tcp://127.0.0.1:9"})  # its control plane is never used
        await asyncio.get_running_loop().run_in_executor(None, os.read, ready, 1)
        a.deliver(_bulk_header(1, 0, 0, torch.zeros(4)))
        first = await ra.get()  # the channel is up, its watch posted
        assert torch.equal(first.tensors[0], torch.full((4,), 7.0))
        if receiving:
            a.deliver(_bulk_header(1, 0, 1, torch.zeros(4)))  # its payload never comes
        os.kill(pid, signal.SIGKILL)
        await wait_until_async(lambda: ra.lost, TIMEOUT, what="the killed peer's loss")
        await asyncio.sleep(0.3)  # a second report would come now
        (lost,) = ra.lost
        assert (lost.peer, lost.peer_state) == (1, "dead") and "rank 1" in str(lost)
        assert ra.queue.empty() and a.stats.dropped["bulk_failed"] == int(receiving)
        with pytest.raises(PeerFailure, match="rank 1") as info:
            await a.send(Message("update", 0, 1, 2, tensors=[torch.ones(8)]))
        assert (info.value.peer, info.value.peer_state) == (1, "dead")
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(ready)
        await a.close()
    assert _watch_threads() == []


async def test_a_peer_that_closes_without_a_bye_is_reported_lost(store_endpoint, monkeypatch) -> None:
    """Closing a transport ends the peer's watch with a notice: with no ``bye`` before it (a crash
    the process survived, ``close(leave=False)``) the peer is reported lost. (After its ``bye``, the
    next test: nothing is reported.)"""
    import hopnet.transports.torchdist as torchdist

    monkeypatch.setattr(torchdist, "DEPARTURE_GRACE_S", 0.2)
    (a, b), (ra, rb) = await _pair(store_endpoint)
    try:
        await a.send(Message("update", 0, 1, 0, tensors=[torch.ones(100)]))  # the channel is up
        await rb.get()
        await b.close()
        await wait_until_async(lambda: ra.lost, TIMEOUT, what="the closed peer's loss")
        (lost,) = ra.lost
        assert (lost.peer, lost.peer_state) == (1, "dead") and "closed" in str(lost)
    finally:
        await a.close()
        await b.close()
    assert _watch_threads() == []  # both closes ended their watches


async def test_a_peer_that_said_bye_is_not_reported_lost_when_it_closes(store_endpoint, monkeypatch) -> None:
    """A peer written off after its ``bye`` (``forget_peer``) closes its transport: the notice that
    ends the watch is no news of a death, on either side."""
    import hopnet.transports.torchdist as torchdist

    monkeypatch.setattr(torchdist, "DEPARTURE_GRACE_S", 0.2)
    (c, d), (rc, rd) = await _pair(store_endpoint)
    try:
        await c.send(Message("update", 0, 1, 0, tensors=[torch.ones(100)]))
        await rd.get()
        c.forget_peer(1)  # as on rank 1's bye
        await d.close()
        await asyncio.sleep(0.5)
        assert rc.lost == [] and rd.lost == []
    finally:
        await c.close()
        await d.close()
    assert _watch_threads() == []  # every close ended its watches


async def test_an_idle_node_learns_of_a_peer_that_vanished_without_a_send(store_endpoint, monkeypatch) -> None:
    """A node that sends nothing (between steps) still learns that its neighbour's transport went
    away without a bye: it declares the neighbour dead, no wait or send involved."""
    from hopnet import Graph, ProtocolConfig

    import hopnet.transports.torchdist as torchdist
    from support.cluster import close_workers, start_workers, train

    monkeypatch.setattr(torchdist, "DEPARTURE_GRACE_S", 0.2)

    def torch_plane(rank: int, graph: Graph) -> TorchBulkTransport:
        control = ZmqTransport(rank, frozenset(graph.peers(rank)))
        return TorchBulkTransport(control, connect_store(store_endpoint, 10), timeout_s=TIMEOUT)

    workers = await start_workers(Graph.ring(2), ProtocolConfig(timeout_s=TIMEOUT), transport_for=torch_plane)
    try:
        await asyncio.wait_for(asyncio.gather(*(train(w, 2) for w in workers)), TIMEOUT)  # the pair is up
        await workers[1].node.close(leave=False)
        node = workers[0].node
        await wait_until_async(lambda: 1 in node.dead, TIMEOUT, what="rank 1 declared dead")
        assert node.peer_state(1) == "dead" and list(node.dead) == [1]
    finally:
        await close_workers(workers)

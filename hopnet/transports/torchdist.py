"""The torch bulk plane: tensors over torch.distributed, everything else over ZeroMQ.

:class:`TorchBulkTransport` composes a :class:`~hopnet.transports.zmq.ZmqTransport`
(the control plane) with point-to-point process groups (the data plane), so protocols
and the Node see one ordinary :class:`~hopnet.transports.base.Transport`.

A message whose tensors hold at least ``min_bytes`` goes as two parts:

- its header over ZeroMQ, with no tensor frames: the tensors' dtypes and shapes, and
  the backend, ride in ``meta[BULK_KEY]`` (never a byte of the tensors, never a host copy);
- its tensors by ``send`` on the pair's process group (gloo for CPU tensors, NCCL for
  CUDA tensors), one op per tensor, issued before the header leaves.

The receiver, when the header arrives, asks its Receiver for buffers (``buffers_for``,
the update pool's next slot) and posts one ``recv`` per tensor into them. Smaller
messages and control messages travel over ZeroMQ as before.

Holding back. A payload moves only once its receive is posted (gloo's sends wait for the
matching receive; no byte is buffered on the receiver before), so the receiver may leave a
payload where it is: when its Receiver's ``hold(header)`` says so, the header waits, with
every later message of the same sender (their receives must be posted in header order), until
``take_in_held()``; the sender's ``send`` waits meanwhile. Hop holds its neighbours' updates of
the next iteration until it has mixed the current one (docs/protocols/hop.md, "Holding the next iteration back").

Ordering. Ops of one pair's process group match in issue order. The sender issues its
sends in the order of its ``send`` calls, under a per-peer lock that also covers handing
the header to ZeroMQ, which keeps per-peer order; the receiver posts its receives in
header order. So payloads and headers pair up on both sides, whatever the protocol
chose not to send. Delivery keeps per-sender order too: a message (bulk or not) waits
behind a bulk message of the same sender whose payload has not landed yet.

Process groups are built from the run's c10d store by the two ranks of the pair alone,
under the key prefix ``hopnet/p2p/{backend}/{low}-{high}``: no call involves any other
rank. They are built in a thread of their own (the constructor blocks until the peer
arrives), started for every neighbour at ``connect``, and on demand for other ranks.

Waiting. gloo's ``Work`` has no future for send/recv, so a thread per peer and
direction waits for each op in order (``wait(timeout)``; CUDA ops are polled with
``is_completed`` until the deadline) and wakes the event loop. Every wait has the
transport's timeout (``--timeout``); a failed or timed out op raises :class:`~hopnet.errors.PeerFailure`
naming the peer (sends), or is logged and counted as ``bulk_failed`` and makes later
sends to that peer fail the same way (receives).

Silent peers. A gloo op's own timeout cannot tell a slow transfer from a dead link, so it stays
at ``--timeout``; the Node's heartbeats tell them apart (``heartbeats`` is true: beats go over
ZeroMQ's express connection, never behind a payload or a channel still forming, and are delivered
at once, never behind a sender's payload still on its way). A neighbour silent for
``--peer-timeout`` is declared dead by the Node, whose ``forget_peer`` then writes it off here:
the sends waiting on it end at once (dropped, as to a peer that left), as does a send waiting for
its channel. gloo cannot cancel a posted op: the waiting threads are abandoned (``close`` does not
wait for them, and they are daemons), and a payload still posted to the peer is read from the
sender's buffer if that peer ever resumes; its neighbours discard whatever it sends then, and
``hopnet launch`` kills a rank declared dead.

Dead peers. Each gloo pair is watched (:mod:`hopnet.transports.pair_watch`): a receive
always posted, which fails when the peer's process ends. That failure, a payload's receive
failing the same way, or a peer's transport closing with no ``bye`` before it, tells the
receiver :meth:`~hopnet.transports.base.Receiver.peer_lost` (once per peer, after
``DEPARTURE_GRACE_S`` for a ``bye`` that may still be on its way over ZeroMQ).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, TypeGuard, TypeVar

import torch
import torch.distributed as dist

from hopnet.errors import ConfigError, HopnetError, PeerFailure
from hopnet.transports.base import DISCARD, Receiver, Rounds, Transport, event_hook
from hopnet.transports.pair_watch import CLOSING, FORGOT, PairWatch, peer_gone
from hopnet.transports.store_clones import StoreClones
from hopnet.transports.zmq import ZmqTransport
from hopnet.wire import DTYPE_NAMES, DecodeError, Header, Message, TensorSpec, decode_specs

log = logging.getLogger(__name__)

BULK_KEY = "_bulk"
"""Meta key of a header whose tensors follow over torch.distributed: ``{"b": backend, "x": specs}``."""

BACKENDS = ("gloo", "nccl")
STORE_PREFIX = "hopnet/p2p"
_CUDA_POLL_S = 0.0002
DEPARTURE_GRACE_S = 2.0
CLOSE_JOIN_S = 5.0
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "*")


def backend_for(device: torch.device) -> str:
    """gloo for CPU tensors, NCCL for CUDA tensors."""
    if device.type == "cpu":
        return "gloo"
    if device.type == "cuda":
        return "nccl"
    raise ConfigError(f"the torch bulk plane moves CPU or CUDA tensors, not {device.type}")


def build_pair_group(store: dist.Store, backend: str, rank: int, peer: int, *, timeout_s: float,
                     host: str = "127.0.0.1", device: torch.device | None = None) -> Any:
    """The process group of the pair (rank, peer), from the store, by the two of them alone.

    NCCL creates its communicator at the first op, and that blocks until the peer's
    first op: done here with one element (lower rank sends), so that it happens in the
    building thread and not in the event loop's first ``send``."""
    low, high = sorted((rank, peer))
    prefixed = dist.PrefixStore(f"{STORE_PREFIX}/{backend}/{low}-{high}", store)
    pair_rank = 0 if rank == low else 1
    pg = build_group(prefixed, backend, pair_rank, 2, timeout_s=timeout_s, host=host)
    if backend == "nccl":
        on = device if device is not None and device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
        probe = torch.zeros(1, device=on)
        work = pg.send([probe], 1, 0) if pair_rank == 0 else pg.recv([probe], 0, 0)
        wait_work(work, on, timeout_s)
    return pg


def build_group(store: dist.Store, backend: str, group_rank: int, group_size: int, *, timeout_s: float,
                host: str = "127.0.0.1") -> Any:
    """A gloo or NCCL process group over ``store`` (already prefixed for this group).

    Blocks until every member has constructed it (or ``timeout_s`` passes): call it off
    the event loop."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, not in torch's stubs
        opts._timeout = timeout
        if host in _WILDCARD_HOSTS:
            opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        else:
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, group_rank, group_size, opts)
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise HopnetError("CUDA tensors need NCCL, and this torch build has none")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, group_rank, group_size, opts)
    raise ConfigError(f"unknown torch backend {backend!r} (choose from {', '.join(BACKENDS)})")


GiveUp = Callable[[], "BaseException | None"]
"""Asked between slices of a wait: an error to end the wait with (a member declared dead), or None."""

_WAIT_SLICE_S = 0.25


def wait_work(work: Any, device: torch.device, timeout_s: float, give_up: GiveUp | None = None) -> None:
    """Block until ``work`` completes; raise TimeoutError after ``timeout_s``. ``give_up`` is asked
    every :data:`_WAIT_SLICE_S` while a CUDA op is polled; a CPU (gloo) op is waited for whole, as
    a timed-out slice would end a point-to-point op (:func:`wait_collective` slices collectives)."""
    if device.type == "cuda":
        # NCCL's wait() only orders the current stream after the op; poll for real completion.
        started = time.monotonic()
        deadline = started + timeout_s
        next_ask = started + _WAIT_SLICE_S
        while not work.is_completed():
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"not completed within {timeout_s:g}s")
            if give_up is not None and now >= next_ask:
                next_ask = now + _WAIT_SLICE_S
                error = give_up()
                if error is not None:
                    raise error
            time.sleep(_CUDA_POLL_S)
        work.wait()
        return
    if not work.wait(timedelta(seconds=timeout_s)):
        raise TimeoutError(f"not completed within {timeout_s:g}s")


def wait_collective(work: Any, device: torch.device, timeout_s: float, give_up: GiveUp | None = None) -> None:
    """:func:`wait_work` for a collective's op (an all-reduce), in slices on the CPU: a thread
    blocked inside gloo's wait runs no Python signal handler, and a trainer's thread waiting for
    its gradient must still see SIGTERM and Ctrl-C. A slice that ends first raises gloo's
    "Operation timed out!" and leaves a collective's op as it was. (Not for point-to-point ops:
    a timed-out wait of gloo's send or receive ends the op with the error.) Between slices
    ``give_up`` is asked whether to stop waiting (a member declared dead: its error is raised,
    the op is left behind)."""
    if device.type == "cuda":
        wait_work(work, device, timeout_s, give_up)
        return
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            if work.wait(timedelta(seconds=max(min(left, _WAIT_SLICE_S), 0.001))) is not False:
                return
        except RuntimeError:
            if work.is_completed():
                work.wait()  # the op's own error, if it failed
                return
        if left <= _WAIT_SLICE_S:
            raise TimeoutError(f"not completed within {timeout_s:g}s")
        if give_up is not None:
            error = give_up()
            if error is not None:
                raise error


def encode_bulk(backend: str, tensors: list[torch.Tensor]) -> dict[str, Any]:
    specs = []
    for t in tensors:
        try:
            name = DTYPE_NAMES[t.dtype]
        except KeyError:
            raise HopnetError(f"cannot send tensors of dtype {t.dtype}") from None
        if not t.is_contiguous():
            raise HopnetError("tensors sent by hopnet must be contiguous")
        specs.append([name, list(t.shape)])
    return {"b": backend, "x": specs}


def decode_bulk(value: Any) -> tuple[str, tuple[TensorSpec, ...]] | None:
    """(backend, specs) of a header's bulk entry, or None if it is malformed."""
    if not isinstance(value, dict) or value.get("b") not in BACKENDS:
        return None
    raw = value.get("x")
    if not isinstance(raw, list) or not raw:
        return None
    try:
        specs = decode_specs(raw)  # the header's own checks: dtype, rank, size bounds
    except DecodeError:
        return None
    return value["b"], specs


class OpWaiter:
    """A thread that waits for one peer's ops of one direction, in order, and reports back."""

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop, timeout_s: float,
                 wait: Callable[[Any, torch.device, float], None] = wait_work) -> None:
        """``wait``: how to wait for one op (:func:`wait_work`, or a collective's sliced wait)."""
        self.loop = loop
        self.timeout_s = timeout_s
        self._wait = wait
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, works: list[Any], device: torch.device, done: Callable[[BaseException | None], None]) -> None:
        self._queue.put((works, device, done))

    def stop(self) -> None:
        self._queue.put(None)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            works, device, done = item
            error: BaseException | None = None
            try:
                for work in works:
                    self._wait(work, device, self.timeout_s)
            except BaseException as exc:  # torch raises RuntimeError / DistError
                error = exc
            try:
                self.loop.call_soon_threadsafe(done, error)
            except RuntimeError:  # the loop is closed: nobody waits any more
                return


class _Inbound:
    """A message from one sender, waiting for its payload (or for the ones before it)."""

    __slots__ = ("backend", "discard", "done", "error", "header", "msg", "staged", "tensors")

    def __init__(self, msg: Message, tensors: list[torch.Tensor], staged: list[torch.Tensor] | None,
                 discard: bool, done: bool, header: Header | None = None, backend: str = "gloo") -> None:
        self.msg = msg
        self.tensors = tensors  # what the recvs land in
        self.staged = staged  # the receiver's buffers, when they sit on another device
        self.discard = discard
        self.done = done
        self.error: BaseException | None = None
        self.header = header  # a bulk message's, for the receiver's hold and buffers_for
        self.backend = backend


class TorchBulkTransport(Transport):
    """ZeroMQ for headers, credits and control; torch.distributed p2p for tensors."""

    carries_cuda = True
    holds_back = True
    heartbeats = True  # over the control plane: see "Silent peers" above

    def __init__(self, control: ZmqTransport, store: dist.Store, *, min_bytes: int = 0,
                 timeout_s: float = 120.0, host: str = "127.0.0.1",
                 device: torch.device | str = "cpu") -> None:
        super().__init__(control.rank, control.allowed_senders)
        if min_bytes < 0:
            raise ConfigError(f"min_bytes must be >= 0, got {min_bytes}")
        if timeout_s <= 0:
            raise ConfigError(f"timeout must be positive, got {timeout_s}")
        self.control = control
        self.stats = control.stats  # one set of counters for both planes
        self.store = store
        self._stores = StoreClones(store)  # the pair groups form in threads of their own
        self.min_bytes = min_bytes
        self.timeout_s = float(timeout_s)
        self.host = host
        self.device = torch.device(device)
        self.bulk_sent = 0
        self.bulk_received = 0
        self._receiver: Receiver | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._channels: dict[tuple[int, str], asyncio.Future[Any]] = {}
        self._send_locks: dict[int, asyncio.Lock] = {}
        self._waiters: dict[tuple[int, str], OpWaiter] = {}
        self._inbox: dict[int, deque[_Inbound]] = {}
        self._unposted: dict[tuple[int, str], deque[_Inbound]] = {}
        self._held: dict[int, deque[_Inbound]] = {}
        """Per sender, bulk messages not taken in yet: the first was held by the receiver, the others
        came behind it."""
        self._take_in_rounds = Rounds()
        self._failed: dict[int, str] = {}
        self._departed: set[int] = set()
        self._said_bye: set[int] = set()  # forgotten after a bye: their ops end as they close
        self._written_off: set[int] = set()  # forgotten without a bye (declared dead): their ops are abandoned
        self._sending: dict[int, set[asyncio.Future[BaseException | None]]] = {}  # by peer: sends on the wire
        self._watches: dict[int, PairWatch] = {}
        self._lost: set[int] = set()  # peers found gone, reported (or being reported) to the receiver
        self._reports: dict[int, asyncio.Task[None]] = {}  # by peer: a loss reported once the bye grace is over
        self._closed = False

    # ---------------------------------------------------------------- lifecycle
    async def start(self, receiver: Receiver) -> str:
        self._loop = asyncio.get_running_loop()
        self._receiver = receiver
        return await self.control.start(self)

    async def connect(self, addresses: Mapping[int, str]) -> None:
        await self.control.connect(addresses)
        backend = backend_for(self.device)
        for peer in addresses:
            if peer != self.rank:
                self._channel(peer, backend)  # build every neighbour's channel now, in the background

    def admit_run(self, world_size: int) -> None:
        super().admit_run(world_size)
        self.control.admit_run(world_size)  # the control plane is what receives them

    def readmit_peer(self, rank: int, address: str | None) -> None:
        self.control.readmit_peer(rank, address)

    def forget_peer(self, rank: int) -> None:
        self._departed.add(rank)
        self._tell(rank, FORGOT)
        self.control.forget_peer(rank)
        if rank not in self._said_bye:
            self._write_off(rank)
        held = self._held.pop(rank, None)
        if held:  # written off with the peer, unread; what came between them is delivered (and dropped)
            for entry in held:
                entry.discard = entry.done = True
            self._deliver_ready(rank)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for peer in self._watches:
            self._tell(peer, CLOSING)  # ends the peer's watch, and makes it end ours
        for task in self._reports.values():
            task.cancel()
        await self.control.close()
        for waiter in self._waiters.values():
            waiter.stop()
        # A thread still inside a torch call when the interpreter exits is killed mid-C++
        # (std::terminate): let the waiters finish while the process is healthy.
        loop = asyncio.get_running_loop()
        for (peer, _), waiter in self._waiters.items():
            if peer not in self._written_off:  # an abandoned one may wait out --timeout
                await loop.run_in_executor(None, waiter.join, CLOSE_JOIN_S)
        self._waiters.clear()
        deadline = loop.time() + CLOSE_JOIN_S
        for watch in self._watches.values():
            if watch.peer in self._written_off:
                continue  # a silent peer answers no notice
            if not await loop.run_in_executor(None, watch.join, max(0.0, deadline - loop.time())):
                log.debug("rank %d: the watch on rank %d did not end by close", self.rank, watch.peer)
        self._watches.clear()
        for (peer, _), fut in self._channels.items():
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                release_group(fut.result(), abandoned=peer in self._written_off)
        self._channels.clear()
        self._inbox.clear()
        self._unposted.clear()
        self._held.clear()
        self._receiver = None

    # ---------------------------------------------------------------- channels
    def _channel(self, peer: int, backend: str) -> asyncio.Future[Any]:
        key = (peer, backend)
        fut = self._channels.get(key)
        if fut is not None:
            return fut
        loop = self._loop or asyncio.get_running_loop()
        fut = loop.create_future()
        self._channels[key] = fut

        def build() -> None:
            try:
                with self._stores.lease() as store:
                    pg: Any = build_pair_group(store, backend, self.rank, peer, timeout_s=self.timeout_s,
                                               host=self.host, device=self.device)
                result: tuple[Any, BaseException | None] = (pg, None)
            except BaseException as exc:  # torch raises several types
                result = (None, exc)
            try:
                loop.call_soon_threadsafe(self._channel_built, key, *result)
            except RuntimeError:
                pass

        threading.Thread(target=build, name=f"hopnet-p2p-{self.rank}-{peer}", daemon=True).start()
        return fut

    def _channel_built(self, key: tuple[int, str], pg: Any, error: BaseException | None) -> None:
        fut = self._channels.get(key)
        if fut is None or fut.done():
            if pg is not None:
                release_group(pg)
            return
        if error is not None:
            fut.set_exception(PeerFailure(f"rank {self.rank}: no {key[1]} channel to rank {key[0]}: "
                                          f"{one_line(error)}", peer=key[0], peer_state="dead"))
            fut.exception()  # retrieved: a failure no one waits for is not an asyncio warning
            self._fail_unposted(key)
        else:
            fut.set_result(pg)
            if key[1] == "gloo" and not self._closed:
                assert self._loop is not None
                try:
                    self._watches[key[0]] = PairWatch(pg, key[0], self._other(key[0]), self._loop,
                                                      self._watch_ended)
                except Exception as exc:  # the pair broke already: its first op will say so
                    log.debug("rank %d: no watch on rank %d: %s", self.rank, key[0], one_line(exc))
            self._post_receives(key)

    def _waiter(self, peer: int, direction: str) -> OpWaiter:
        key = (peer, direction)
        waiter = self._waiters.get(key)
        if waiter is None:
            assert self._loop is not None
            waiter = OpWaiter(f"hopnet-{direction}-{self.rank}-{peer}", self._loop, self.timeout_s)
            self._waiters[key] = waiter
        return waiter

    def _other(self, peer: int) -> int:
        """The peer's rank inside the pair's process group."""
        return 1 if peer > self.rank else 0

    # ---------------------------------------------------------------- sending
    async def send(self, msg: Message) -> None:
        peer = msg.dst
        if not msg.tensors or sum(t.numel() * t.element_size() for t in msg.tensors) < self.min_bytes:
            if self._send_locks.get(peer) is None or not self._send_locks[peer].locked():
                await self.control.send(msg)
                return
            async with self._send_locks[peer]:  # behind a bulk send still queueing its header
                await self.control.send(msg)
            return
        if peer in self._departed:
            self.stats.drop("peer_left")
            return
        report = self._reports.get(peer)
        if report is not None and not report.done():
            # Its channel closed, and its bye may still be on its way: a peer that leaves is not a dead one.
            await asyncio.shield(report)
            if peer in self._departed:
                self.stats.drop("peer_left")
                return
        if peer in self._failed:
            raise PeerFailure(f"rank {self.rank}: bulk channel to rank {peer} failed earlier: "
                              f"{self._failed[peer]}", peer=peer, peer_state="dead")
        devices = {t.device for t in msg.tensors}
        if len(devices) != 1:
            raise HopnetError(f"the tensors of one message must share a device, got {sorted(map(str, devices))}")
        device = devices.pop()
        backend = backend_for(device)
        meta = dict(msg.meta or {})
        meta[BULK_KEY] = encode_bulk(backend, msg.tensors)
        header = Message(msg.kind, msg.src, msg.dst, msg.iter, msg.tag, meta)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[BaseException | None] = loop.create_future()
        lock = self._send_locks.setdefault(peer, asyncio.Lock())
        async with lock:
            pg = await self._await_channel(peer, backend)
            other = self._other(peer)
            try:
                works = [pg.send([t], other, 0) for t in msg.tensors]
            except Exception as exc:
                raise self._peer_error(peer, "send", exc) from None
            self._waiter(peer, "send").add(works, device, settle(done))
            await self.control.send(header)
        sending = self._sending.setdefault(peer, set())
        sending.add(done)
        try:
            error = await done
        finally:
            sending.discard(done)
        if error is not None:
            if await self._departed_meanwhile(peer):
                self.stats.drop("peer_left")  # it left while the payload was on its way: not an error
                return
            raise self._peer_error(peer, "send", error)
        self.bulk_sent += 1
        self.stats.sent_bytes += sum(t.numel() * t.element_size() for t in msg.tensors)

    async def send_express(self, msg: Message) -> None:
        """A control message (a beat) over ZeroMQ's express connection: behind no payload, no
        header waiting for its channel, no per-peer lock."""
        if msg.tensors:
            await self.send(msg)
            return
        await self.control.send_express(msg)

    async def _await_channel(self, peer: int, backend: str) -> Any:
        fut = self._channel(peer, backend)
        if not fut.done():
            try:
                await asyncio.wait_for(asyncio.shield(fut), self.timeout_s + 5.0)
            except asyncio.TimeoutError:
                raise PeerFailure(f"rank {self.rank}: no {backend} channel to rank {peer} after "
                                  f"{self.timeout_s:g}s", peer=peer, peer_state="dead") from None
        return fut.result()

    async def _departed_meanwhile(self, peer: int) -> bool:
        """A peer that leaves closes its channel right after its ``bye``; the ``bye`` (over
        ZeroMQ) may land a moment after our send on the channel failed. Wait for it briefly."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEPARTURE_GRACE_S
        while peer not in self._departed and loop.time() < deadline and not self._closed:
            await asyncio.sleep(0.01)
        return peer in self._departed

    # ---------------------------------------------------------------- dead peers
    def _write_off(self, peer: int) -> None:
        """``peer`` was declared dead (gone silent): nothing here waits on it any longer. Its sends
        end now (dropped, as to a peer that left), and so does a wait for its channel; the
        threads inside gloo's waits are left to their timeout (gloo cannot cancel an op)."""
        self._written_off.add(peer)
        gone = PeerFailure(f"rank {self.rank}: rank {peer} was declared dead", peer=peer, peer_state="dead")
        for done in self._sending.pop(peer, set()):
            if not done.done():
                done.set_result(gone)
        for backend in BACKENDS:
            fut = self._channels.get((peer, backend))
            if fut is not None and not fut.done():
                fut.set_exception(gone)
                fut.exception()  # retrieved: no one may be waiting

    def _tell(self, peer: int, notice: float) -> None:
        watch = self._watches.get(peer)
        if watch is not None:
            watch.tell(notice)

    def _watch_ended(self, peer: int, notice: float | None, error: BaseException | None) -> None:
        """The watch on ``peer``'s pair completed: its notice came, or the pair failed."""
        if self._closed:
            return
        if error is None:
            self._tell(peer, FORGOT)  # its close need not wait for our watch to end
            if notice == CLOSING:
                self._peer_gone(peer, "its transport closed")
        elif peer_gone(error):
            self._peer_gone(peer, one_line(error))
        else:
            log.debug("rank %d: the watch on rank %d ended: %s", self.rank, peer, one_line(error))

    def _peer_gone(self, peer: int, text: str) -> None:
        """``peer``'s end of its pair went away: unless a ``bye`` comes with it, tell the receiver, once."""
        if self._closed or peer in self._departed or peer in self._lost:
            return
        self._lost.add(peer)
        self._failed.setdefault(peer, text)
        task = asyncio.get_running_loop().create_task(self._report_lost(peer, text))
        self._reports[peer] = task

    async def _report_lost(self, peer: int, text: str) -> None:
        if await self._departed_meanwhile(peer):
            return
        receiver = self._receiver
        if receiver is not None and not self._closed:
            receiver.peer_lost(PeerFailure(f"rank {self.rank}: rank {peer} is gone (bulk channel: {text})",
                                           peer=peer, peer_state="dead"))

    def _peer_error(self, peer: int, what: str, error: BaseException) -> PeerFailure:
        text = one_line(error)
        self._failed.setdefault(peer, text)
        return PeerFailure(f"rank {self.rank}: bulk {what} with rank {peer} failed: {text}",
                           peer=peer, peer_state="dead")

    # ---------------------------------------------------------------- receiving (Receiver of the control plane)
    def buffers_for(self, header: Header) -> Any:
        receiver = self._receiver
        return None if receiver is None else receiver.buffers_for(header)

    def hold(self, header: Header) -> bool:
        return False  # the control plane reads every message as it comes

    def peer_lost(self, failure: PeerFailure) -> None:
        receiver = self._receiver
        if receiver is not None:
            receiver.peer_lost(failure)

    def record(self, event: str, **fields: Any) -> None:
        """The control plane's reports (``link_gap``) go to the receiver's event log."""
        hook = event_hook(self._receiver)
        if hook is not None:
            hook(event, **fields)

    def deliver(self, msg: Message) -> None:
        receiver = self._receiver
        if receiver is None:
            return
        inbox = self._inbox.setdefault(msg.src, deque())
        if msg.meta is None or BULK_KEY not in msg.meta:
            if msg.kind == "bye":
                self._said_bye.add(msg.src)
            if inbox and msg.kind != "beat":  # a beat is a sign of life, not a message to keep in order
                inbox.append(_Inbound(msg, [], None, False, done=True))
            else:
                receiver.deliver(msg)
            return
        meta = dict(msg.meta)
        decoded = decode_bulk(meta.pop(BULK_KEY))
        if decoded is None:
            # Its payload cannot be matched any more: the pair's stream is out of step.
            self.stats.drop("bad_bulk_header")
            self._failed.setdefault(msg.src, "malformed bulk header")
            log.warning("rank %d: malformed bulk header from rank %d", self.rank, msg.src)
            return
        backend, specs = decoded
        plain = Message(msg.kind, msg.src, msg.dst, msg.iter, msg.tag, meta or None)
        header = Header(msg.kind, msg.src, msg.dst, msg.iter, msg.tag, meta or None, specs)
        entry = _Inbound(plain, [], None, False, done=False, header=header, backend=backend)
        inbox.append(entry)
        held = self._held.get(msg.src)
        if held:  # behind a held one: its receive cannot be posted before that one's
            held.append(entry)
            return
        if receiver.hold(header):
            self._held[msg.src] = deque([entry])
            return
        self._take_in(entry, receiver)

    def take_in_held(self) -> None:
        self._take_in_rounds.run(self._take_in_held_once)

    def _take_in_held_once(self) -> None:
        for src in list(self._held):
            held = self._held.get(src)
            receiver = self._receiver
            while held and receiver is not None:
                entry = held[0]
                assert entry.header is not None
                if receiver.hold(entry.header):
                    break
                held.popleft()
                self._take_in(entry, receiver)
            if not held and self._held.get(src) is held:
                del self._held[src]

    def _take_in(self, entry: _Inbound, receiver: Receiver) -> None:
        """Give ``entry`` its buffers and post its receives (once the pair's channel is up)."""
        header = entry.header
        assert header is not None
        specs, src, backend = header.specs, header.src, entry.backend
        target = receiver.buffers_for(header)
        device = self._recv_device(backend)
        discard = target is DISCARD
        staged: list[torch.Tensor] | None = None
        if target is None or discard:
            tensors = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in specs]
        elif not _buffers_match(target, specs):
            self.stats.drop("bad_buffers")
            discard = True
            tensors = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in specs]
        elif any(t.device.type != device.type for t in target):
            staged = list(target)  # the receiver's buffers sit elsewhere: land here, copy on arrival
            tensors = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in specs]
        else:
            tensors = list(target)
        entry.tensors, entry.staged, entry.discard = tensors, staged, discard
        self._unposted.setdefault((src, backend), deque()).append(entry)
        fut = self._channel(src, backend)
        if fut.done():
            if fut.exception() is not None:
                self._fail_unposted((src, backend))
            else:
                self._post_receives((src, backend))

    def _recv_device(self, backend: str) -> torch.device:
        if backend == "gloo":
            return torch.device("cpu")
        if self.device.type == "cuda":
            return self.device
        return torch.device("cuda", torch.cuda.current_device())

    def _post_receives(self, key: tuple[int, str]) -> None:
        pending = self._unposted.get(key)
        if not pending:
            return
        src, _ = key
        pg = self._channels[key].result()
        other = self._other(src)
        while pending:
            entry = pending.popleft()
            try:
                works = [pg.recv([t], other, 0) for t in entry.tensors]
            except Exception as exc:
                self._received(src, entry, exc)
                continue
            device = entry.tensors[0].device
            self._waiter(src, "recv").add(works, device, functools.partial(self._received, src, entry))

    def _fail_unposted(self, key: tuple[int, str]) -> None:
        error = self._channels[key].exception()
        pending = self._unposted.get(key)
        while pending:
            self._received(key[0], pending.popleft(), error or HopnetError("no channel"))

    def _received(self, src: int, entry: _Inbound, error: BaseException | None) -> None:
        entry.done = True
        entry.error = error
        self._deliver_ready(src)

    def _deliver_ready(self, src: int) -> None:
        """Deliver ``src``'s messages in order, up to the first whose payload has not landed."""
        inbox = self._inbox.get(src)
        receiver = self._receiver
        while inbox and inbox[0].done:
            head = inbox.popleft()
            if receiver is None:
                continue
            if head.error is not None:
                if src in self._departed:
                    self.stats.drop("peer_left")
                    continue
                self.stats.drop("bulk_failed")
                text = one_line(head.error)
                self._failed.setdefault(src, text)
                log.warning("rank %d: bulk receive from rank %d failed: %s", self.rank, src, text)
                if peer_gone(head.error):
                    self._peer_gone(src, text)
                continue
            if head.discard:
                self.stats.drop("discarded")
                continue
            tensors = head.tensors
            if head.staged is not None:
                for dst, got in zip(head.staged, tensors):
                    dst.copy_(got)
                tensors = head.staged
            msg = head.msg
            if tensors:
                msg.tensors = tensors
                self.bulk_received += 1
                self.stats.received_bytes += sum(t.numel() * t.element_size() for t in tensors)
            receiver.deliver(msg)


def _buffers_match(target: object, specs: tuple[TensorSpec, ...]) -> TypeGuard[Sequence[torch.Tensor]]:
    if not isinstance(target, (list, tuple)) or len(target) != len(specs):
        return False
    return all(isinstance(t, torch.Tensor) and t.dtype == s.dtype and tuple(t.shape) == s.shape
               and t.is_contiguous() for t, s in zip(target, specs))


T = TypeVar("T")


def settle(future: asyncio.Future[T]) -> Callable[[T], None]:
    """A callback that gives ``future`` its result, unless it is done already."""
    def set_once(value: T) -> None:
        if not future.done():
            future.set_result(value)
    return set_once


def release_group(pg: Any, *, abandoned: bool = False) -> None:
    """Release a process group we are done with.

    NCCL communicators are shut down explicitly (they hold device memory); one with an op left
    behind (``abandoned``: a member went silent) is aborted instead, as a shutdown would wait for
    that op. A gloo group is left to its destructor when the last reference goes: ``abort()`` on a
    gloo group whose peer still talks to it killed a worker at exit now and then (std::terminate).
    An abandoned gloo group is never destroyed (:func:`leave_behind`)."""
    if getattr(pg, "name", lambda: "")() != "nccl":
        if abandoned:
            leave_behind(pg)
        return
    try:
        if abandoned:
            pg.abort()
            return
        pg.shutdown()
    except Exception:  # already broken: nothing left to release
        log.debug("NCCL process group shutdown failed", exc_info=True)


def leave_behind(pg: Any) -> None:
    """Keep a gloo group with an op still pending (a silent peer's) alive for the rest of the process.

    gloo cannot cancel an op, and a group's destructor waits for its worker threads, whose op ends
    only at its own timeout (``--timeout``): at the interpreter's exit that was a hang of up to
    --timeout, after the run had already failed. ``abort()`` does not end the op either. One
    reference is taken that nothing gives back, so the destructor never runs; the process's exit
    ends the threads."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))


_SOURCE_LOCATION = re.compile(r"^\[[^\]]*:\d+\]\s*")  # gloo's "[/.../pair.cc:553] "


def one_line(error: BaseException) -> str:
    """``error``'s message in one short line: the first, without gloo's source location and advice."""
    text = str(error).strip().splitlines()
    first = _SOURCE_LOCATION.sub("", text[0]) if text else type(error).__name__
    return first.split(" This is typically caused by")[0][:300]


__all__ = ["BULK_KEY", "GiveUp", "OpWaiter", "TorchBulkTransport", "backend_for", "build_group", "build_pair_group",
           "leave_behind", "one_line", "release_group", "settle", "wait_work"]

"""ZeroMQ transport: one ROUTER per rank to receive, one DEALER per peer to send.

Addresses are ``tcp://HOST:PORT`` or ``ipc:///path``; the default bind address is the
loopback interface, so listening on a real network interface is always an explicit
choice of the caller.

Wire format: each :class:`~hopnet.wire.Message` is one ZeroMQ multipart message::

    [header, chunk, chunk, ...]

``header`` is :func:`hopnet.wire.encode_header`; then, for every tensor in order, its raw
bytes split into ``ceil(nbytes / CHUNK_BYTES)`` frames of at most :data:`CHUNK_BYTES`
(a 0-byte tensor is one empty frame). The header's tensor specs tell the receiver how
many frames of which sizes to expect; anything else is dropped and counted.

Identity: every DEALER's routing id is its rank (ASCII decimal), and the receiver drops
a message whose header ``src`` differs from the connection's routing id
(``spoofed_src``). The routing id is chosen by the connecting peer, so this catches
confused or buggy peers, not an attacker (there is no authentication).

Sending is zero-copy for tensor frames of at least :data:`COPY_THRESHOLD` bytes: libzmq
reads the tensor's memory after ``send_multipart`` has returned, so :meth:`send` waits
until libzmq has released every such frame (the bytes are in the kernel) before it
returns. Smaller frames are copied, and a message without large frames (every control
message) is sent with a single non-blocking call and no completion tracking.

Peers that are not up yet: DEALERs connect with ``IMMEDIATE`` off, so messages queue
(up to :data:`HWM` messages per peer) until the connection is made. Peers that are gone:
a send that cannot complete within ``send_timeout`` seconds (the peer has not taken the
bytes, or the queue is full) is dropped, counted as ``send_timeout`` in
``stats.dropped``, the DEALER to that peer is recreated (its queued messages are
dropped with it, releasing their memory) and :meth:`send` returns. So ``send`` never
blocks forever; messages to a dead peer are lost, as on any network.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import zmq
import zmq.asyncio

from hopnet.errors import ConfigError, HopnetError
from hopnet.transports.base import DISCARD, Receiver, Transport
from hopnet.wire import DecodeError, Header, Message, decode_header, encode_header

log = logging.getLogger(__name__)

CHUNK_BYTES = 16 << 20
"""Largest tensor frame on the wire. Part of the wire format: both ends must agree.

A single libzmq receive of more than ~32 MiB costs an ``mmap`` plus a page fault on
every page (glibc's dynamic mmap threshold tops out at 32 MiB); chunks of at most
16 MiB are served from the reused heap instead. See bench/README.md for measurements.
"""

COPY_THRESHOLD = 64 << 10
"""Tensor frames smaller than this are copied into libzmq instead of sent zero-copy:
a 64 KiB memcpy costs less than tracking when libzmq is done with the memory."""

HWM = 100_000
"""Send and receive high-water marks, in messages per peer. DEALER and ROUTER never drop
inbound or outbound messages at the HWM (they block / apply back-pressure), so this only
bounds how much can queue for a peer that is slow or not up yet."""

LINGER_MS = 200
"""How long ``close`` lets libzmq flush messages that are still queued."""

DEFAULT_SEND_TIMEOUT = 60.0

_DRAIN_BATCH = 256  # messages handled per wake-up before yielding to other tasks


def routing_id(rank: int) -> bytes:
    """The ZeroMQ routing id a rank's DEALERs present to their peers."""
    return str(rank).encode("ascii")


def _check_address(address: str, what: str) -> None:
    if not isinstance(address, str) or not (address.startswith("tcp://") or address.startswith("ipc://")):
        raise ConfigError(f"{what} must be tcp://HOST:PORT or ipc:///path, got {address!r}")


def _byte_view(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor's memory (works for bfloat16)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _frame_count(nbytes: int) -> int:
    return max(1, -(-nbytes // CHUNK_BYTES))


class _SendDone:
    """Completion of one zero-copy send: set once libzmq released every tracked frame.

    Each zero-copy frame is handed to pyzmq as a fresh memoryview made for it alone.
    pyzmq keeps exactly that object alive until libzmq frees the frame (its
    garbage-collector thread drops the reference then), so the memoryview dies when
    libzmq no longer reads those bytes. A weakref callback on each one (run in whichever
    thread drops the last reference) counts down; the last one wakes the event loop.
    This is MessageTracker's information without a thread blocked in ``wait()`` or
    polling.
    """

    __slots__ = ("loop", "future", "_left", "_lock", "_refs", "__weakref__")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future = loop.create_future()
        self._left = 0
        self._lock = threading.Lock()
        self._refs: list[weakref.ref] = []

    def track(self, frame: memoryview) -> None:
        with self._lock:
            self._left += 1
        self._refs.append(weakref.ref(frame, self._released))

    def _released(self, _ref: Any) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            try:
                self.loop.call_soon_threadsafe(self._finish)
            except RuntimeError:  # loop closed: nobody is waiting any more
                pass

    def _finish(self) -> None:
        if not self.future.done():
            self.future.set_result(None)


class _Peer:
    __slots__ = ("rank", "address", "sock", "raw", "busy")

    def __init__(self, rank: int, address: str, sock: zmq.asyncio.Socket) -> None:
        self.rank = rank
        self.address = address
        self.sock = sock
        # A plain socket sharing the same libzmq socket: non-blocking sends without Futures.
        self.raw = zmq.Socket.shadow(sock.underlying)
        self.busy = 0  # sends waiting in zmq.asyncio's queue (keeps per-peer order)


class ZmqTransport(Transport):
    """Transport over ZeroMQ (tcp or ipc). See the module docstring for the design."""

    def __init__(self, rank: int, allowed_senders: frozenset[int], *, bind: str = "tcp://127.0.0.1:*",
                 send_timeout: float = DEFAULT_SEND_TIMEOUT,
                 context: zmq.asyncio.Context | None = None) -> None:
        super().__init__(rank, frozenset(allowed_senders))
        _check_address(bind, "bind address")
        if send_timeout <= 0:
            raise ConfigError(f"send_timeout must be positive, got {send_timeout}")
        self.bind = bind
        self.send_timeout = float(send_timeout)
        self._own_context = context is None
        self._ctx = context
        self._router: zmq.Socket | None = None
        self._router_fd: int | None = None
        self._receiver: Receiver | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._peers: dict[int, _Peer] = {}
        self._departed: set[int] = set()
        self._ids = {s: routing_id(s) for s in self.allowed_senders}
        self._inflight: set[_SendDone] = set()
        self._closed = False
        self.address: str | None = None

    # ---------------------------------------------------------------- lifecycle

    async def start(self, receiver: Receiver) -> str:
        if self._closed:
            raise HopnetError("transport is closed")
        if self._router is not None:
            raise HopnetError("transport already started")
        self._loop = asyncio.get_running_loop()
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        # A plain socket: the loop watches its FD directly (see _on_readable).
        sock = self._ctx.socket(zmq.ROUTER, socket_class=zmq.Socket)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, HWM)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted peer replaces its stale connection
        try:
            sock.bind(self.bind)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise HopnetError(f"rank {self.rank} cannot bind {self.bind}: {exc}") from None
        self._router = sock
        self._receiver = receiver
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._router_fd = sock.getsockopt(zmq.FD)
        self._loop.add_reader(self._router_fd, self._on_readable)
        self._loop.call_soon(self._on_readable)  # the FD is edge-triggered: look once now
        return self.address

    async def connect(self, addresses: Mapping[int, str]) -> None:
        if self._closed:
            raise HopnetError("transport is closed")
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        for rank, address in addresses.items():
            _check_address(address, f"address of rank {rank}")
            old = self._peers.get(rank)
            if old is not None:
                if old.address == address:
                    continue
                old.sock.close(LINGER_MS)
            self._peers[rank] = self._open_peer(rank, address)

    def _open_peer(self, rank: int, address: str) -> _Peer:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, routing_id(self.rank))
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        sock.setsockopt(zmq.SNDHWM, HWM)
        sock.setsockopt(zmq.IMMEDIATE, 0)  # queue until connected
        sock.copy_threshold = COPY_THRESHOLD
        sock.connect(address)
        return _Peer(rank, address, sock)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._router_fd is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._router_fd)
        self._router_fd = None
        for peer in self._peers.values():
            peer.sock.close(LINGER_MS)
        self._peers.clear()
        if self._router is not None:
            self._router.close(0)
            self._router = None
        self._receiver = None
        if self._own_context and self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            # term() waits for the lingering sockets (at most LINGER_MS): keep the loop free.
            await asyncio.get_running_loop().run_in_executor(None, ctx.term)

    # ---------------------------------------------------------------- sending

    def forget_peer(self, rank: int) -> None:
        peer = self._peers.pop(rank, None)
        self._departed.add(rank)
        if peer is not None:
            # Closing without linger discards what is queued for the departed peer, which
            # releases the tensor memory that zero-copy sends to it are waiting on.
            peer.sock.close(0)

    async def send(self, msg: Message) -> None:
        peer = self._peers.get(msg.dst)
        if peer is None:
            if msg.dst in self._departed:
                self.stats.drop("peer_left")
                return
            if self._closed:
                raise HopnetError("transport is closed")
            raise HopnetError(f"rank {self.rank} has no connection to rank {msg.dst}; call connect() first")
        header = encode_header(msg)
        if not msg.tensors:
            # The hot path for control messages: one non-blocking send, no Futures.
            if not peer.busy:
                try:
                    peer.raw.send(header, zmq.NOBLOCK)
                except zmq.Again:
                    pass
                else:
                    self.stats.sent_messages += 1
                    return
            await self._send_queued(peer, [header], 0)
            return
        await self._send_tensors(peer, header, msg.tensors)

    async def _send_tensors(self, peer: _Peer, header: bytes, tensors: list[torch.Tensor]) -> None:
        parts: list[Any] = [header]
        done: _SendDone | None = None
        total = 0
        for t in tensors:
            if t.device.type != "cpu":
                raise HopnetError(f"ZmqTransport sends CPU tensors only, got one on {t.device}")
            nbytes = t.numel() * t.element_size()
            total += nbytes
            if nbytes == 0:
                parts.append(b"")
                continue
            if nbytes < COPY_THRESHOLD:
                parts.append(_byte_view(t))  # pyzmq copies frames under sock.copy_threshold
                continue
            if done is None:
                done = _SendDone(self._loop or asyncio.get_running_loop())
            flat = memoryview(_byte_view(t))
            for off in range(0, nbytes, CHUNK_BYTES):
                chunk = flat[off:off + CHUNK_BYTES]
                if chunk.nbytes >= COPY_THRESHOLD:
                    done.track(chunk)  # else pyzmq copies it during the send call
                parts.append(chunk)
            del flat, chunk
        if done is None:
            # Everything was copied: it is safe to return as soon as libzmq has the message.
            if not peer.busy:
                try:
                    peer.raw.send_multipart(parts, zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    pass
                else:
                    self.stats.sent_messages += 1
                    self.stats.sent_bytes += total
                    return
            await self._send_queued(peer, parts, total)
            return

        self._inflight.add(done)
        try:
            sent = False
            if not peer.busy:
                try:
                    peer.raw.send_multipart(parts, zmq.NOBLOCK, copy=False)
                    sent = True
                except zmq.Again:
                    pass
            if sent:
                del parts  # from now on only libzmq holds the tensor memory
                ok = await self._await_release(peer, done)
            else:
                ok = await self._send_queued(peer, parts, total, count=False)
                del parts
                if ok:
                    ok = await self._await_release(peer, done)
                else:
                    await done.future  # the queued message was discarded: wait for its release
            if ok:
                self.stats.sent_messages += 1
                self.stats.sent_bytes += total
        finally:
            self._inflight.discard(done)

    async def _await_release(self, peer: _Peer, done: _SendDone) -> bool:
        """Wait until libzmq is done with the frames. False if that took too long."""
        fut = done.future
        if fut.done():
            return True
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.send_timeout)
            return True
        except asyncio.TimeoutError:
            log.warning("rank %d: send to rank %d not taken within %.1fs; dropping it and "
                        "resetting the connection", self.rank, peer.rank, self.send_timeout)
            self.stats.drop("send_timeout")
            self._reset_peer(peer)
            await fut  # closing the socket makes libzmq release the queued frames
            return False

    async def _send_queued(self, peer: _Peer, parts: list[Any], total: int, *, count: bool = True) -> bool:
        """Send through zmq.asyncio (waits for room in the queue). False if it timed out."""
        peer.busy += 1
        sock = peer.sock
        try:
            fut = sock.send_multipart(parts, copy=False)
            del parts
            try:
                await asyncio.wait_for(fut, self.send_timeout)
            except asyncio.TimeoutError:
                log.warning("rank %d: queue to rank %d full for %.1fs; dropping a message",
                            self.rank, peer.rank, self.send_timeout)
                self.stats.drop("send_timeout")
                return False
        finally:
            peer.busy -= 1
        if count:
            self.stats.sent_messages += 1
            self.stats.sent_bytes += total
        return True

    def _reset_peer(self, peer: _Peer) -> None:
        """Replace a peer's DEALER, discarding what is queued on it (frees its buffers)."""
        if self._peers.get(peer.rank) is not peer or self._closed:
            return
        peer.sock.close(0)
        self._peers[peer.rank] = self._open_peer(peer.rank, peer.address)

    # ---------------------------------------------------------------- receiving

    def _on_readable(self) -> None:
        """Drain the ROUTER. Called by the loop when the socket's (edge-triggered) FD fires.

        A reader callback instead of a task awaiting zmq.asyncio's recv: no Future and no
        task switch per message, which is most of the cost of a control message.
        """
        sock = self._router
        if sock is None:
            return
        handle = self._handle
        try:
            for _ in range(_DRAIN_BATCH):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    # recv processed libzmq's pending commands, so the FD fires again on
                    # the next message; re-check EVENTS anyway to close any race.
                    if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        return
                    continue
                handle(frames)
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.ETERM, zmq.ENOTSOCK) or sock.closed:
                return
            self.stats.drop("internal_error")
            log.debug("rank %d: receive failed", self.rank, exc_info=True)
        except Exception:
            self.stats.drop("internal_error")
            log.debug("rank %d: receive failed", self.rank, exc_info=True)
        # Batch used up (or an error): let other callbacks run, then continue draining.
        if self._router is sock and self._loop is not None:
            self._loop.call_soon(self._on_readable)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        try:
            self._handle_unsafe(frames)
        except Exception:
            self.stats.drop("internal_error")
            log.debug("rank %d: error handling an inbound message", self.rank, exc_info=True)

    def _handle_unsafe(self, frames: list[zmq.Frame]) -> None:
        stats = self.stats
        if len(frames) < 2:
            stats.drop("truncated")
            return
        try:
            header = decode_header(frames[1].buffer)
        except DecodeError as exc:
            stats.drop(exc.reason)
            return
        reason = self.check_header(header)
        if reason is not None:
            stats.drop(reason)
            return
        if frames[0].bytes != self._ids[header.src]:
            stats.drop("spoofed_src")
            return
        specs = header.specs
        if not specs:
            if len(frames) != 2:
                stats.drop("extra_frames")
                return
            receiver = self._receiver
            if receiver is not None:
                stats.received_messages += 1
                receiver.deliver(Message(header.kind, header.src, header.dst, header.iter,
                                         header.tag, header.meta))
            return

        # Validate every frame against the specs before asking for buffers.
        expected = 0
        sizes = []
        for spec in specs:
            nbytes = spec.nbytes
            sizes.append(nbytes)
            expected += _frame_count(nbytes)
        got = len(frames) - 2
        if got != expected:
            stats.drop("truncated" if got < expected else "extra_frames")
            return
        i = 2
        for nbytes in sizes:
            if nbytes <= CHUNK_BYTES:
                if len(frames[i]) != nbytes:
                    stats.drop("bad_size")
                    return
                i += 1
                continue
            for off in range(0, nbytes, CHUNK_BYTES):
                if len(frames[i]) != min(CHUNK_BYTES, nbytes - off):
                    stats.drop("bad_size")
                    return
                i += 1

        receiver = self._receiver
        if receiver is None:
            return
        target = receiver.buffers_for(header)
        if target is DISCARD:
            stats.drop("discarded")
            return
        if target is None:
            tensors = [_new_tensor(spec.dtype, spec.shape, frames, i)
                       for spec, i in zip(specs, _first_frames(sizes))]
        else:
            if not _buffers_match(target, specs):
                stats.drop("bad_buffers")
                log.debug("rank %d: buffers_for returned tensors that do not match %s", self.rank, specs)
                return
            tensors = target
            i = 2
            for t, nbytes in zip(tensors, sizes):
                if nbytes == 0:
                    i += 1
                    continue
                dst = _byte_view(t)
                for off in range(0, nbytes, CHUNK_BYTES):
                    frame = frames[i]
                    i += 1
                    dst[off:off + len(frame)] = np.frombuffer(frame, dtype=np.uint8)
        stats.received_messages += 1
        stats.received_bytes += sum(sizes)
        receiver.deliver(Message(header.kind, header.src, header.dst, header.iter,
                                 header.tag, header.meta, tensors))


def _first_frames(sizes: list[int]) -> list[int]:
    out, i = [], 2
    for nbytes in sizes:
        out.append(i)
        i += _frame_count(nbytes)
    return out


def _buffers_match(target: Any, specs: tuple) -> bool:
    if not isinstance(target, (list, tuple)) or len(target) != len(specs):
        return False
    for t, spec in zip(target, specs):
        if (not isinstance(t, torch.Tensor) or t.dtype != spec.dtype or tuple(t.shape) != spec.shape
                or t.device.type != "cpu" or not t.is_contiguous()):
            return False
    return True


def _new_tensor(dtype: torch.dtype, shape: tuple[int, ...], frames: list[zmq.Frame], first: int) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return t
    dst = _byte_view(t)
    off = 0
    i = first
    while off < nbytes:
        frame = frames[i]
        n = len(frame)
        dst[off:off + n] = np.frombuffer(frame, dtype=np.uint8)
        off += n
        i += 1
    return t


__all__ = ["CHUNK_BYTES", "COPY_THRESHOLD", "ZmqTransport", "routing_id"]

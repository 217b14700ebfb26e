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
confused or buggy peers among the run's members, not an attacker.

Security: given the run's CURVE keys (``curve=``, see :mod:`hopnet.security`), the ROUTER
is a CURVE server that admits only holders of the run key and every DEALER a CURVE
client: traffic is encrypted, and a process without the key gets no message in. Its
refused connection attempts are counted in ``stats.dropped`` as ``unauthenticated``
(a lower bound: see :class:`~hopnet.security.HandshakeWatch`). Without keys the sockets are
plain: fine on loopback, and what ``hopnet launch --insecure`` asks for elsewhere.

Sending (:meth:`ZmqTransport.send` returns once the caller may modify the tensors):

- no frame of :data:`COPY_THRESHOLD` bytes or more (every control message): libzmq copies
  the frames in one non-blocking call; no Futures, no completion tracking;
- at most :data:`STAGE_BYTES` of tensors: copied into a pooled staging buffer that libzmq
  sends from, so the next message can queue while this one is written;
- larger: zero-copy from the tensors' memory, and ``send`` waits until libzmq has
  released every frame (written it to the kernel).

Before all of these: a message with at least ``payload_stream.MIN_BYTES`` of tensors, to a
peer whose address names a data port (``tcp://HOST:PORT?data=DPORT``), goes whole (header
and tensor bytes) over a plain TCP stream to that peer, which receives the bytes straight
into its buffers; the ZeroMQ messages to such a peer carry a lane tag that keeps the order
across the two channels (:mod:`hopnet.transports.payload_stream`: wire, order, failures).
Off with CURVE keys, ``ipc://``, ``payload_stream=False`` or ``HOPNET_ZMQ_PAYLOAD_STREAM=0``.

Messages to one peer leave in the order of the ``send`` calls, also when ``send`` is
called from several tasks at once.

Links slower than the sender (:meth:`ZmqTransport.send_latest`): while anything with
tensors to a peer is still in libzmq, a ``send_latest`` message is not queued behind it
but copied aside, one per peer, a newer one replacing it, and handed to libzmq when the
earlier messages have left. A sender that outruns its link then keeps one update waiting
instead of a growing backlog, and what it sends is its newest. Later ``send`` calls (a
token, a beat) do not wait behind the held message.

Receiving: the event loop watches the ROUTER's file descriptor and a reader callback
drains it, validates each message, asks the receiver for buffers and copies the frames
into them (or into new tensors), then calls ``deliver``. No exception escapes it.

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
import ctypes
import logging
import os
import platform
import secrets
import sys
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeGuard, cast

import numpy as np
import torch
import zmq
import zmq.asyncio

from hopnet.errors import ConfigError, HopnetError
from hopnet.security import CurveKeys, HandshakeWatch, is_loopback, make_curve_client, make_curve_server
from hopnet.transports import payload_stream as ps
from hopnet.transports.base import DISCARD, Receiver, Transport
from hopnet.wire import DecodeError, Header, Message, TensorSpec, decode_header, encode_header

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
"""Largest tensor frame on the wire (1 MiB). Part of the wire format: both ends must agree.

libzmq receives every frame into a buffer it allocates. One frame per large tensor is
slow: above ~32 MiB glibc maps fresh pages for each (a page fault per 4 KiB, which on
the reference VM costs more than the copy). Frames of at most a few MiB come from the
reused heap; 1 MiB measured best there (bench/README.md: 16, 4, 2, 1 and 0.5 MiB were
compared, 1 MiB was as fast or faster for 16 and 64 MiB tensors, and the receiver's
copy into the destination tensor is cheapest from small, reused buffers).
"""

COPY_THRESHOLD = 64 << 10
"""Tensor frames smaller than this are copied into libzmq instead of sent zero-copy:
a 64 KiB memcpy costs less than tracking when libzmq is done with the memory."""

STAGE_BYTES = 1 << 20
"""Messages with at most this many tensor bytes (and a frame of at least
:data:`COPY_THRESHOLD`) are copied into a pooled staging buffer and
:meth:`ZmqTransport.send` returns without waiting for libzmq (see ``_send_staged``);
larger ones are sent zero-copy from the tensors. Measured on the reference VM: staging
made 1 MiB messages ~25% faster and 2-4 MiB ones no faster or slower."""

STAGE_INFLIGHT = 2
"""``send`` of a staged message returns once at most this many staged messages to the
peer are still in libzmq (back-pressure on a sender that outruns the link)."""

STAGE_MAX_INFLIGHT = 8
"""Past this many staged messages in libzmq for one peer (only reached with many
concurrent senders), messages are sent zero-copy instead: bounds staging memory."""

STAGE_POOL_BYTES = 32 << 20
"""Most bytes of idle staging buffers a transport keeps for reuse."""

HWM = 100_000
"""Send high-water mark, in messages per peer. A DEALER never drops outbound messages at the HWM
(it blocks), so this only bounds how much can queue for a peer that is slow or not up yet."""

RCVHWM = 8
"""Messages the ROUTER takes in ahead of the reader, per connection. libzmq reads a peer's messages
off the socket into its own frames as fast as they come, whatever the reader does with them: past
this many it stops reading that connection, and the peer's messages wait on its side (its ``send``
waits, up to ``send_timeout``). So a receiver holds at most this many messages per peer that it has
not handled: with Hop's streamed updates (chunks of ``--stream-mib``) a few MiB per in-neighbour,
where the whole update piled up before (bench/README.md, "Memory (issue 18)")."""

MAX_FRAME_BYTES = 64 << 20
"""Largest frame the ROUTER accepts (libzmq disconnects a peer that sends a bigger one):
far above any legitimate frame (tensor frames are at most CHUNK_BYTES, headers are small),
it only keeps a confused peer from making this process allocate without bound."""

LINGER_MS = 200
"""How long ``close`` lets libzmq flush messages that are still queued."""

DEFAULT_SEND_TIMEOUT = 60.0

_DRAIN_BATCH = 256  # messages handled per wake-up before yielding to other tasks


_malloc_tuned: bool | None = None


def tune_malloc() -> bool:
    """Stop glibc from handing large message buffers back to the kernel after every use.

    libzmq allocates a fresh buffer for every frame it receives. With glibc's defaults a
    large buffer is ``mmap``-ed, or the heap top is trimmed after ``free``, so the next
    message faults its pages in again: receiving 64 MiB messages faulted on 0.24-0.44 of
    all 4 KiB pages on the reference VM, and throughput dropped by a quarter (see
    bench/README.md, "Transport"). Fixing ``M_MMAP_THRESHOLD`` at 32 MiB and
    ``M_TRIM_THRESHOLD`` at 512 MiB keeps those buffers in the heap for reuse. This is
    process-wide (it also makes PyTorch's CPU allocations reuse memory instead of
    faulting it in again) and is what ``MALLOC_MMAP_THRESHOLD_`` /
    ``MALLOC_TRIM_THRESHOLD_`` would do; the cost is up to that much freed memory kept
    by the process. Done once per process by :meth:`ZmqTransport.start` unless
    ``tune_malloc=False`` or ``HOPNET_TUNE_MALLOC=0``. Returns whether it is in effect.
    """
    global _malloc_tuned
    if _malloc_tuned is not None:
        return _malloc_tuned
    _malloc_tuned = False
    if sys.platform != "linux" or os.environ.get("HOPNET_TUNE_MALLOC", "1") == "0":
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    _malloc_tuned = bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 512 << 20))
    log.debug("glibc malloc tuned for message buffers: %s", _malloc_tuned)
    return _malloc_tuned


def routing_id(rank: int) -> bytes:
    """The ZeroMQ routing id a rank's DEALERs present to their peers."""
    return str(rank).encode("ascii")


def express_routing_id(rank: int) -> bytes:
    """The routing id of a rank's express DEALER (:meth:`ZmqTransport.send_express`)."""
    return b"x" + routing_id(rank)


def zmq_endpoint(address: str) -> str:
    """The ZeroMQ endpoint of a transport's address (without its ``?data=PORT``), for a
    plain ZeroMQ socket that talks to the transport's ROUTER."""
    return ps.split_address(address)[0]


def _check_address(address: str, what: str) -> None:
    if not isinstance(address, str) or not address.startswith(("tcp://", "ipc://")):
        raise ConfigError(f"{what} must be tcp://HOST:PORT or ipc:///path, got {address!r}")
    if "?" in address and ps.split_address(address)[1] is None:
        raise ConfigError(f"{what} must be tcp://HOST:PORT, optionally ?data=PORT, got {address!r}")


def _byte_view(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor's memory (works for bfloat16)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


_WaitTimeout = asyncio.TimeoutError  # not the builtin TimeoutError before Python 3.11

_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)


def _send_now(sock: zmq.Socket, parts: list[Any]) -> None:
    """``send_multipart(parts, NOBLOCK, copy=False)`` minus pyzmq's per-call checks.

    Raises ``zmq.Again`` only on the first part: libzmq counts the high-water mark in
    whole messages, so once a message's first part is accepted the rest are too.
    """
    send = sock.send
    last = len(parts) - 1
    for i, part in enumerate(parts):
        send(part, _NOBLOCK_MORE if i < last else _NOBLOCK, copy=False)


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

    __slots__ = ("__weakref__", "_left", "_lock", "_refs", "future", "loop")

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
        self._refs.clear()  # all dead by now; breaks the done <-> callback cycle
        if not self.future.done():
            self.future.set_result(None)


class _BufferPool:
    """Reusable uint8 buffers by size (rounded up to 64 KiB), so staging copies land in
    memory that is already mapped and warm instead of fresh pages."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held = 0
        self._free: dict[int, list[np.ndarray]] = {}

    @staticmethod
    def _round(n: int) -> int:
        return -(-n // (64 << 10)) * (64 << 10)

    def take(self, n: int) -> np.ndarray:
        size = self._round(n)
        free = self._free.get(size)
        if free:
            self.held -= size
            return free.pop()
        return np.empty(size, dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        size = buf.nbytes
        if self.held + size > self.max_bytes:
            return
        self.held += size
        self._free.setdefault(size, []).append(buf)


class _Peer:
    __slots__ = ("address", "busy", "data", "endpoint", "epoch", "express", "express_raw", "gate", "held", "rank",
                 "raw", "sending_held", "sock", "stage_waiters", "staged", "stream", "stream_retry_at", "streaming",
                 "zero_copy", "zseq")

    def __init__(self, rank: int, address: str, sock: zmq.asyncio.Socket, streams: bool) -> None:
        self.rank = rank
        self.address = address
        self.endpoint, self.data = ps.split_address(address)  # data: the payload stream's (host, port)
        if not streams:
            self.data = None
        self.sock = sock
        # A plain socket sharing the same libzmq socket: non-blocking sends without Futures.
        self.raw: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        self.raw.copy_threshold = COPY_THRESHOLD
        self.busy = 0  # sends waiting in zmq.asyncio's queue (keeps per-peer order)
        self.staged = 0  # staged messages libzmq still holds
        self.zero_copy = 0  # zero-copy messages libzmq still holds
        self.held: Message | None = None  # the newest send_latest message, waiting for a free link
        self.sending_held = False  # it is on its way into libzmq: newer ones wait behind it
        self.express: zmq.asyncio.Socket | None = None  # a second connection, for send_express
        self.express_raw: zmq.Socket | None = None
        self.stage_waiters: list[asyncio.Future] = []
        self.stream: ps.OutStream | None = None  # payloads of large messages (payload_stream.py)
        self.stream_retry_at = 0.0  # after a failed open: when to try again
        self.streaming = 0  # streamed messages whose bytes are not all in the kernel yet
        self.gate: asyncio.Future[None] | None = None  # set while the stream opens: sends wait behind it
        self.epoch = secrets.randbits(64) or 1  # names this connection in lane tags and stream hellos
        self.zseq = 0  # lane sequence number of the last ZeroMQ message sent to a peer with a stream

    def tagged(self, header: bytes) -> bytes:
        """The first frame of a ZeroMQ message: with its lane tag if the peer has a stream."""
        if self.data is None:
            return header
        self.zseq += 1
        stream = self.stream
        if stream is None:
            return ps.lane_tag(self.epoch, self.zseq, 0, 0) + header
        return ps.lane_tag(self.epoch, self.zseq, stream.token, stream.seq) + header

    def open_express(self, sock: zmq.asyncio.Socket) -> None:
        self.express = sock
        self.express_raw = zmq.Socket.shadow(sock.underlying)

    def close(self, linger_ms: int, reason: str = "closed") -> None:
        self.sock.close(linger_ms)
        if self.express is not None:
            self.express.close(linger_ms)
        if self.stream is not None:
            self.stream.abort(reason)

    @property
    def backlogged(self) -> bool:
        return bool(self.busy or self.staged or self.zero_copy or self.streaming or self.held is not None
                    or self.sending_held)


class ZmqTransport(Transport):
    """Transport over ZeroMQ (tcp or ipc). See the module docstring for the design."""

    heartbeats = True

    def __init__(self, rank: int, allowed_senders: frozenset[int], *, bind: str = "tcp://127.0.0.1:*",
                 send_timeout: float = DEFAULT_SEND_TIMEOUT,
                 context: zmq.asyncio.Context | None = None, tune_malloc: bool = True,
                 curve: CurveKeys | None = None, handover: bool = False,
                 payload_stream: bool | None = None) -> None:
        """``handover``: a peer may come back as a new process (``hopnet launch --max-restarts``): a
        connection presenting a connected peer's routing id then takes over from the old one.
        ``payload_stream``: send the tensors of large messages over a TCP stream of their own
        (:mod:`hopnet.transports.payload_stream`); ``None`` (default) means on unless
        ``HOPNET_ZMQ_PAYLOAD_STREAM=0``. Always off with ``curve`` keys and ``ipc://`` addresses."""
        super().__init__(rank, frozenset(allowed_senders))
        _check_address(bind, "bind address")
        if send_timeout <= 0:
            raise ConfigError(f"send_timeout must be positive, got {send_timeout}")
        self.bind = bind
        self.send_timeout = float(send_timeout)
        self._tune_malloc = tune_malloc
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
        self._held_sends: set[asyncio.Task[None]] = set()
        self._stage_pool = _BufferPool(STAGE_POOL_BYTES)
        self._closed = False
        self._curve = curve
        self._handover = handover
        self._handshakes: HandshakeWatch | None = None
        self._handshakes_fd: int | None = None
        self.address: str | None = None
        self.payload_stream = ps.enabled(payload_stream) and curve is None
        """Whether large messages' tensors may go over payload streams (to peers that advertise one)."""
        self.streamed_messages = 0
        """Messages sent with their tensors over a payload stream (also in ``stats.sent_messages``)."""
        self._inbox: ps.StreamInbox | None = None

    # ---------------------------------------------------------------- lifecycle

    async def start(self, receiver: Receiver) -> str:
        if self._closed:
            raise HopnetError("transport is closed")
        if self._router is not None:
            raise HopnetError("transport already started")
        self._loop = asyncio.get_running_loop()
        if self._tune_malloc:
            tune_malloc()
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        # A plain socket: the loop watches its FD directly (see _on_readable).
        # pyzmq's stubs tie an asyncio Context to asyncio sockets; socket_class overrides it
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.ROUTER, socket_class=zmq.Socket)  # type: ignore[arg-type, assignment]
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        # ROUTER_HANDOVER stays off unless peers may be replaced: a second connection presenting
        # a connected peer's routing id is ignored rather than allowed to cut off the real peer's
        # pipe. A replacement must get through even while its dead predecessor's pipe lingers.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1 if self._handover else 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # a peer sending more is disconnected
        if self._curve is not None:
            make_curve_server(sock, self._curve)
            self._handshakes = HandshakeWatch(sock)
        elif not is_loopback(self.bind):  # info: `hopnet launch --insecure` already warned, once
            log.info("rank %d: %s is not loopback and the transport has no CURVE keys: "
                        "anyone who can reach it can send to this rank", self.rank, self.bind)
        try:
            sock.bind(self.bind)
        except zmq.ZMQError as exc:
            if self._handshakes is not None:
                self._handshakes.close()
                self._handshakes = None
            sock.close(0)
            raise HopnetError(f"rank {self.rank} cannot bind {self.bind}: {exc}") from None
        self._router = sock
        self._receiver = receiver
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.payload_stream and self.address.startswith("tcp://"):
            self._open_inbox()
        self._router_fd = sock.fileno()  # zmq.FD, the edge-triggered descriptor
        self._loop.add_reader(self._router_fd, self._on_readable)
        self._loop.call_soon(self._on_readable)  # the FD is edge-triggered: look once now
        if self._handshakes is not None:
            self._handshakes_fd = self._handshakes.fd
            self._loop.add_reader(self._handshakes_fd, self._on_handshake_events)
            self._loop.call_soon(self._on_handshake_events)
        return self.address

    def _open_inbox(self) -> None:
        """Listen for payload streams next to the ROUTER and advertise the port in the address."""
        assert self.address is not None and self._loop is not None
        _, host_port = ps.split_address(ps.with_data_port(self.address, 1))
        assert host_port is not None
        try:
            self._inbox = ps.StreamInbox(self._loop, host_port[0], admits=self._admits_stream,
                                         check=self._check_streamed, prepare=self._stream_targets,
                                         finish=self._stream_received, handle=self._handle_now,
                                         drop=self.stats.drop)
        except OSError as exc:
            log.warning("rank %d: cannot listen for payload streams on %s (%s); tensors go over ZeroMQ",
                        self.rank, host_port[0], exc)
            return
        self.address = ps.with_data_port(self.address, self._inbox.port)

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
                old.close(LINGER_MS)
            self._peers[rank] = self._open_peer(rank, address)

    def _open_peer(self, rank: int, address: str) -> _Peer:
        return _Peer(rank, address, self._open_dealer(ps.split_address(address)[0], routing_id(self.rank)),
                     self.payload_stream)

    def _open_dealer(self, address: str, identity: bytes) -> zmq.asyncio.Socket:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, identity)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        sock.setsockopt(zmq.SNDHWM, HWM)
        sock.setsockopt(zmq.IMMEDIATE, 0)  # queue until connected
        sock.copy_threshold = COPY_THRESHOLD
        if self._curve is not None:
            make_curve_client(sock, self._curve)
        sock.connect(address)
        return sock

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._router_fd is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._router_fd)
        self._router_fd = None
        if self._handshakes is not None:
            self._on_handshake_events()  # count what is pending before it goes
            if self._handshakes_fd is not None and self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._handshakes_fd)
            self._handshakes.close()
            self._handshakes = self._handshakes_fd = None
        for peer in self._peers.values():
            self._drop_held(peer, "closed")
            peer.close(LINGER_MS)
        self._peers.clear()
        for task in list(self._held_sends):
            task.cancel()
        if self._inbox is not None:
            self._inbox.close()
            self._inbox = None
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
        """See :meth:`Transport.forget_peer`: later sends to ``rank`` count ``peer_left``."""
        peer = self._peers.pop(rank, None)
        self._departed.add(rank)
        if peer is not None:
            self._drop_held(peer, "peer_left")
            # Closing without linger discards what is queued for the departed peer, which
            # releases the tensor memory that zero-copy sends to it are waiting on.
            peer.close(0, "peer_left")

    def readmit_peer(self, rank: int, address: str | None) -> None:
        """See :meth:`Transport.readmit_peer`."""
        self._departed.discard(rank)
        if address is not None and not self._closed and self._ctx is not None:
            _check_address(address, f"address of rank {rank}")
            old = self._peers.pop(rank, None)
            if old is not None:
                old.close(0)
            self._peers[rank] = self._open_peer(rank, address)

    def backlogged(self, rank: int) -> bool:
        """Whether a message with tensors to ``rank`` has not left this process yet."""
        peer = self._peers.get(rank)
        return peer is not None and peer.backlogged

    async def send_express(self, msg: Message) -> None:
        """See :meth:`Transport.send_express`: a control message on a connection of its own
        (opened at the first use), so it waits behind no tensor bytes, in libzmq or in the
        kernel's socket buffer."""
        peer = self._peers.get(msg.dst)
        if peer is None or msg.tensors:
            await self.send(msg)
            return
        if peer.express is None:
            peer.open_express(self._open_dealer(peer.endpoint, express_routing_id(self.rank)))
        assert peer.express is not None and peer.express_raw is not None
        header = encode_header(msg)
        try:
            peer.express_raw.send(header, zmq.NOBLOCK)
        except zmq.Again:  # HWM messages already wait (a peer not up yet): queue behind them
            sent = peer.express.send(header)
            try:
                await asyncio.wait_for(sent, self.send_timeout)
            except _WaitTimeout:
                self.stats.drop("send_timeout")
                return
        self.stats.sent_messages += 1

    async def send_latest(self, msg: Message) -> None:
        """See :meth:`Transport.send_latest`. The held copy is a snapshot of the tensors taken
        now; a message that replaces a held one is copied into the held one's tensors."""
        peer = self._peers.get(msg.dst)
        if peer is None or not msg.tensors or not peer.backlogged:
            await self.send(msg)
            return
        held = peer.held
        if held is not None and _same_layout(held.tensors, msg.tensors):
            for mine, theirs in zip(held.tensors, msg.tensors):
                mine.copy_(theirs)
            snapshot = held.tensors
        else:
            snapshot = [t.detach().clone() for t in msg.tensors]
        if held is not None:
            self.stats.drop("superseded")
        peer.held = Message(msg.kind, msg.src, msg.dst, msg.iter, msg.tag, msg.meta, snapshot)
        self._send_held_if_free(peer)  # the link may have freed while we copied

    async def drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.send_timeout
        while not self._closed and (self._held_sends or any(p.held is not None for p in self._peers.values())):
            if self._held_sends:
                await asyncio.wait(list(self._held_sends), timeout=max(0.0, deadline - loop.time()))
            else:
                await asyncio.sleep(0.005)  # a held message leaves when its link frees (_send_held_if_free)
            if loop.time() >= deadline:
                for peer in self._peers.values():
                    self._drop_held(peer, "send_timeout")
                return

    def _send_held_if_free(self, peer: _Peer) -> None:
        """Send the peer's held message once nothing else to it is still in libzmq."""
        held = peer.held
        if (held is None or peer.busy or peer.staged or peer.zero_copy or peer.streaming or peer.sending_held
                or self._closed):
            return
        if self._peers.get(peer.rank) is not peer:
            self._drop_held(peer, self._lost_reason(peer.rank))
            return
        peer.held = None
        peer.sending_held = True
        task = (self._loop or asyncio.get_running_loop()).create_task(self._send_held(peer, held))
        self._held_sends.add(task)
        task.add_done_callback(self._held_sends.discard)

    async def _send_held(self, peer: _Peer, msg: Message) -> None:
        try:
            await self.send(msg)
        except HopnetError as exc:  # closed or forgotten meanwhile: lost, as any queued message
            self.stats.drop(self._lost_reason(msg.dst))
            log.debug("rank %d: held message to rank %d not sent: %s", self.rank, msg.dst, exc)
        finally:
            peer.sending_held = False
            self._send_held_if_free(peer)

    def _drop_held(self, peer: _Peer, reason: str) -> None:
        if peer.held is not None:
            peer.held = None
            self.stats.drop(reason)

    async def send(self, msg: Message) -> None:
        peer = self._peers.get(msg.dst)
        while peer is not None and peer.gate is not None:  # a payload stream to it is opening
            await asyncio.shield(peer.gate)
            peer = self._peers.get(msg.dst)
        if peer is None:
            if msg.dst in self._departed:
                self.stats.drop("peer_left")
                return
            if self._closed:
                raise HopnetError("transport is closed")
            raise HopnetError(f"rank {self.rank} has no connection to rank {msg.dst}; call connect() first")
        if not msg.tensors:
            header = peer.tagged(encode_header(msg))
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
        await self._send_tensors(peer, encode_header(msg), msg.tensors)

    async def _send_tensors(self, peer: _Peer, header: bytes, tensors: list[torch.Tensor]) -> None:
        sizes = []
        for t in tensors:
            if t.device.type != "cpu":
                raise HopnetError(f"ZmqTransport sends CPU tensors only, got one on {t.device}")
            sizes.append(t.numel() * t.element_size())
        total = sum(sizes)
        if total >= ps.MIN_BYTES and peer.data is not None and self.payload_stream:
            if await self._send_streamed(peer, header, tensors, sizes, total):
                return
        header = peer.tagged(header)  # no await from here until the message is in libzmq's queue
        if max(sizes) < COPY_THRESHOLD:
            # pyzmq copies every frame (all under sock.copy_threshold): done once libzmq has it.
            parts: list[Any] = [header]
            parts.extend(_byte_view(t) if n else b"" for t, n in zip(tensors, sizes))
            await self._send_copied(peer, parts, total)
        elif total <= STAGE_BYTES:
            await self._send_staged(peer, header, tensors, sizes, total)
        else:
            await self._send_zero_copy(peer, header, tensors, sizes, total)

    async def _send_streamed(self, peer: _Peer, header: bytes, tensors: list[torch.Tensor],
                             sizes: list[int], total: int) -> bool:
        """The whole message over the peer's payload stream (opened now if need be). False if
        there is no stream to the peer: the caller sends over ZeroMQ."""
        stream = peer.stream
        if stream is None or stream.closed:
            stream = await self._open_stream(peer)
            if stream is None:
                return False
        done = stream.write(header, [_byte_view(t).data for t, n in zip(tensors, sizes) if n], total, peer.zseq)
        peer.streaming += 1
        try:
            reason = await self._await_stream(peer, stream, done)
        finally:
            peer.streaming -= 1
            self._send_held_if_free(peer)
        if reason is None:
            self.stats.sent_messages += 1
            self.stats.sent_bytes += total
            self.streamed_messages += 1
        else:
            self.stats.drop(reason)
        return True

    async def _open_stream(self, peer: _Peer) -> ps.OutStream | None:
        loop = self._loop or asyncio.get_running_loop()
        if peer.data is None or loop.time() < peer.stream_retry_at:
            return None
        gate = peer.gate = loop.create_future()
        stream: ps.OutStream | None = None
        try:
            host, port = peer.data
            stream = await ps.OutStream.open(loop, host, port, self.rank, peer.epoch,
                                             min(ps.CONNECT_TIMEOUT_S, self.send_timeout))
        except (OSError, _WaitTimeout) as exc:
            peer.stream_retry_at = loop.time() + ps.RETRY_S
            log.warning("rank %d: cannot open a payload stream to rank %d at %s:%d (%s); its tensors go "
                        "over ZeroMQ for %.0fs", self.rank, peer.rank, *peer.data, exc or "timed out", ps.RETRY_S)
        finally:
            peer.gate = None
            gate.set_result(None)
        if stream is not None and (self._closed or self._peers.get(peer.rank) is not peer):
            stream.abort("closed")
            return None
        peer.stream = stream
        return stream

    async def _await_stream(self, peer: _Peer, stream: ps.OutStream, done: asyncio.Future[str | None]) -> str | None:
        """Wait until the payload is in the kernel; None, or why it was dropped."""
        if done.done():
            return done.result()
        try:
            return await asyncio.wait_for(asyncio.shield(done), self.send_timeout)
        except _WaitTimeout:
            log.warning("rank %d: payload stream to rank %d took nothing for %.1fs; closing it", self.rank,
                        peer.rank, self.send_timeout)
            stream.abort("send_timeout")
            return "send_timeout"
        except asyncio.CancelledError:
            stream.abort("cancelled")  # the caller owns the tensors again: never write from them later
            raise

    async def _send_copied(self, peer: _Peer, parts: list[Any], total: int) -> None:
        if not peer.busy:
            try:
                _send_now(peer.raw, parts)
            except zmq.Again:
                pass
            else:
                self.stats.sent_messages += 1
                self.stats.sent_bytes += total
                return
        await self._send_queued(peer, parts, total)

    async def _send_staged(self, peer: _Peer, header: bytes, tensors: list[torch.Tensor],
                           sizes: list[int], total: int) -> None:
        """Copy the tensors into a pooled buffer, hand that to libzmq and return early.

        For small messages the wait until libzmq releases a zero-copy frame (written to
        the kernel, then pyzmq's gc thread wakes the loop) would leave the link idle
        between messages; a memcpy is cheaper. The staged message is queued at once (so
        order is kept), then ``send`` waits only while more than STAGE_INFLIGHT staged
        messages to this peer are still in libzmq: the link always has the next message
        ready. Past STAGE_MAX_INFLIGHT (many concurrent senders) messages go zero-copy,
        which bounds the staging memory.
        """
        if peer.staged >= STAGE_MAX_INFLIGHT:
            await self._send_zero_copy(peer, header, tensors, sizes, total)
            return
        buf = self._stage_pool.take(total)
        done = _SendDone(self._loop or asyncio.get_running_loop())
        parts: list[Any] = [header]
        view = buf.data
        off = 0
        for t, n in zip(tensors, sizes):
            if n < COPY_THRESHOLD:
                parts.append(_byte_view(t) if n else b"")  # pyzmq copies it anyway
                continue
            buf[off:off + n] = _byte_view(t)
            for c in range(off, off + n, CHUNK_BYTES):
                frame = view[c:min(c + CHUNK_BYTES, off + n)]
                if frame.nbytes >= COPY_THRESHOLD:
                    done.track(frame)  # else pyzmq copies it during the send call
                parts.append(frame)
            off += n
        del view, frame
        peer.staged += 1
        self._inflight.add(done)  # the weakref callbacks need `done` alive
        done.future.add_done_callback(lambda _f: self._unstage(peer, buf, done))
        await self._send_copied(peer, parts, total)
        del parts  # only libzmq may keep the frames alive now, or they are never released
        if peer.staged > STAGE_INFLIGHT:
            await self._wait_staged(peer)

    def _unstage(self, peer: _Peer, buf: np.ndarray, done: _SendDone) -> None:
        self._inflight.discard(done)
        peer.staged -= 1
        self._stage_pool.give(buf)
        if peer.stage_waiters:
            waiters, peer.stage_waiters = peer.stage_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)
        self._send_held_if_free(peer)

    async def _wait_staged(self, peer: _Peer) -> None:
        """Wait until at most STAGE_INFLIGHT staged messages to ``peer`` are in libzmq."""
        loop = self._loop or asyncio.get_running_loop()
        deadline = loop.time() + self.send_timeout
        while peer.staged > STAGE_INFLIGHT and self._peers.get(peer.rank) is peer:
            fut = loop.create_future()
            peer.stage_waiters.append(fut)
            try:
                await asyncio.wait_for(fut, max(0.0, deadline - loop.time()))
            except _WaitTimeout:
                if self._peers.get(peer.rank) is not peer:
                    return
                log.warning("rank %d: sends to rank %d not taken within %.1fs; dropping what "
                            "is queued and resetting the connection", self.rank, peer.rank,
                            self.send_timeout)
                self.stats.drop("send_timeout")
                self._reset_peer(peer)
                return

    async def _send_zero_copy(self, peer: _Peer, header: bytes, tensors: list[torch.Tensor],
                              sizes: list[int], total: int) -> None:
        parts: list[Any] = [header]
        done = _SendDone(self._loop or asyncio.get_running_loop())
        for t, n in zip(tensors, sizes):
            if n < COPY_THRESHOLD:
                parts.append(_byte_view(t) if n else b"")  # pyzmq copies it
                continue
            flat = _byte_view(t).data
            for off in range(0, n, CHUNK_BYTES):
                chunk = flat[off:off + CHUNK_BYTES]
                if chunk.nbytes >= COPY_THRESHOLD:
                    done.track(chunk)  # else pyzmq copies it during the send call
                parts.append(chunk)
            del flat, chunk
        self._inflight.add(done)
        peer.zero_copy += 1
        try:
            sent = False
            if not peer.busy:
                try:
                    _send_now(peer.raw, parts)
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
            peer.zero_copy -= 1
            self._send_held_if_free(peer)

    async def _await_release(self, peer: _Peer, done: _SendDone) -> bool:
        """Wait until libzmq is done with the frames. False if that took too long."""
        fut = done.future
        if fut.done():
            return True
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.send_timeout)
            return True
        except _WaitTimeout:
            log.warning("rank %d: send to rank %d not taken within %.1fs; dropping it and "
                        "resetting the connection", self.rank, peer.rank, self.send_timeout)
            self.stats.drop("send_timeout")
            self._reset_peer(peer)
            await fut  # closing the socket makes libzmq release the queued frames
            return False

    async def _send_queued(self, peer: _Peer, parts: list[Any], total: int, *, count: bool = True) -> bool:
        """Send through zmq.asyncio, which waits for room in the queue. False if the message
        was dropped instead (timed out, or the socket was closed meanwhile)."""
        peer.busy += 1
        try:
            fut = asyncio.ensure_future(peer.sock.send_multipart(parts, copy=False))  # zmq.asyncio's Future
            del parts
            try:
                done, _ = await asyncio.wait((fut,), timeout=self.send_timeout)
            except asyncio.CancelledError:
                fut.cancel()  # never send it later, from memory the caller owns again
                raise
            if not done:
                fut.cancel()
                log.warning("rank %d: queue to rank %d full for %.1fs; dropping a message",
                            self.rank, peer.rank, self.send_timeout)
                self.stats.drop("send_timeout")
                return False
            if fut.cancelled():  # zmq.asyncio cancels queued sends when the socket closes
                self.stats.drop(self._lost_reason(peer.rank))
                return False
            fut.result()
        finally:
            peer.busy -= 1
            self._send_held_if_free(peer)
        if count:
            self.stats.sent_messages += 1
            self.stats.sent_bytes += total
        return True

    def _lost_reason(self, rank: int) -> str:
        if rank in self._departed:
            return "peer_left"
        return "closed" if self._closed else "send_timeout"

    def _reset_peer(self, peer: _Peer) -> None:
        """Replace a peer's DEALER, discarding what is queued on it (frees its buffers)."""
        if self._peers.get(peer.rank) is not peer or self._closed:
            return
        self._drop_held(peer, "send_timeout")
        peer.close(0, "send_timeout")  # the stream too: headers queued in the DEALER are gone
        self._peers[peer.rank] = self._open_peer(peer.rank, peer.address)

    # ---------------------------------------------------------------- receiving

    def _on_handshake_events(self) -> None:
        """Count connections refused at the CURVE handshake (a process without the run key)."""
        watch = self._handshakes
        if watch is None:
            return
        refused = watch.poll()
        if refused:
            self.stats.dropped["unauthenticated"] += refused
            log.debug("rank %d: refused %d connection attempt(s) without the run key", self.rank, refused)

    def _on_readable(self) -> None:
        """Drain the ROUTER. Called by the loop when the socket's (edge-triggered) FD fires.

        A reader callback instead of a task awaiting zmq.asyncio's recv: no Future and no
        task switch per message, which is most of the cost of a control message.
        """
        sock = self._router
        if sock is None:
            return
        handle = self._handle
        get = cast(Callable[[int], int], sock.get)  # EVENTS is an int option
        try:
            for _ in range(_DRAIN_BATCH):
                # Reading EVENTS makes libzmq process its pending commands and re-arms the
                # edge-triggered FD; cheaper than a receive that fails with EAGAIN.
                if not get(_EVENTS) & _POLLIN:
                    return
                try:
                    frames = sock.recv_multipart(_NOBLOCK, copy=False)
                except zmq.Again:
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
            checked = self._checked(frames)
            if checked is None:
                return
            inbox = self._inbox
            if inbox is not None and frames[0].bytes[:1] != b"x":  # express messages overtake by contract
                # A sender's messages keep their order with its streamed ones (its lane).
                inbox.arrived(checked[0].src, checked, ps.read_tag(frames[1].buffer))
                return
            self._take(*checked)
        except Exception:
            self.stats.drop("internal_error")
            log.debug("rank %d: error handling an inbound message", self.rank, exc_info=True)

    def _handle_now(self, checked: tuple[Header, list[zmq.Frame]]) -> None:
        """Handle a message whose turn in its sender's lane has come."""
        try:
            self._take(*checked)
        except Exception:
            self.stats.drop("internal_error")
            log.debug("rank %d: error handling an inbound message", self.rank, exc_info=True)

    def _checked(self, frames: list[zmq.Frame]) -> tuple[Header, list[zmq.Frame]] | None:
        """``(header, frames)`` of a message from whom it says, or None: dropped and counted. A
        dropped message takes no place in its sender's lane (a streamed message sent after it
        may wait ``payload_stream.ORDER_WAIT_S``): what a working sender sends is not dropped here."""
        stats = self.stats
        if len(frames) < 2:
            stats.drop("truncated")
            return None
        first = frames[1].buffer
        if ps.is_tagged(first):  # its place in the sender's lane: for the inbox
            first = first[ps.LANE.size:]
        try:
            header = decode_header(first)
        except DecodeError as exc:
            stats.drop(exc.reason)
            return None
        reason = self.check_header(header)
        if reason is not None:
            stats.drop(reason)
            return None
        expected_id = self._ids.get(header.src)
        if expected_id is None:
            expected_id = self._ids[header.src] = routing_id(header.src)
        sender_id = frames[0].bytes
        if sender_id != expected_id and sender_id != b"x" + expected_id:
            stats.drop("spoofed_src")
            return None
        return header, frames

    def _take(self, header: Header, frames: list[zmq.Frame]) -> None:
        """Validate a checked message's frames, receive its tensors and deliver it."""
        stats = self.stats
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
            tensors = list(target)
            i = 2
            for t, nbytes in zip(tensors, sizes):
                if nbytes == 0:
                    i += 1
                    continue
                dst = _byte_view(t)
                for off in range(0, nbytes, CHUNK_BYTES):
                    frame = frames[i]
                    i += 1
                    dst[off:off + len(frame)] = np.frombuffer(frame.buffer, dtype=np.uint8)
        stats.received_messages += 1
        stats.received_bytes += sum(sizes)
        receiver.deliver(Message(header.kind, header.src, header.dst, header.iter,
                                 header.tag, header.meta, tensors))

    # ------------------------------------------------------- receiving: payload streams

    def _check_streamed(self, header: Header, rank: int) -> str | None:
        """A streamed message's header (from ``rank``'s stream): a drop reason, or None."""
        reason = self.check_header(header)
        if reason is None and header.src != rank:
            reason = "spoofed_src"
        return reason

    def _admits_stream(self, rank: int) -> bool:
        """Whether a payload stream's hello from ``rank`` is accepted: from any rank this one
        takes messages from (its senders, or every rank of the run once ``admit_run``)."""
        size = self.world_size
        return rank in self.allowed_senders or (size is not None and 0 <= rank < size and rank != self.rank)

    def _stream_targets(self, header: Header) -> ps.Prepared:
        receiver = self._receiver
        if receiver is None:
            return [], "closed"
        try:
            target = receiver.buffers_for(header)
        except Exception:
            log.debug("rank %d: buffers_for failed", self.rank, exc_info=True)
            return [], "internal_error"
        if target is DISCARD:
            return [], "discarded"
        if target is None:
            return [torch.empty(spec.shape, dtype=spec.dtype) for spec in header.specs], None
        if not _buffers_match(target, header.specs):
            log.debug("rank %d: buffers_for returned tensors that do not match %s", self.rank, header.specs)
            return [], "bad_buffers"
        return list(target), None

    def _stream_received(self, header: Header, tensors: list[torch.Tensor]) -> None:
        receiver = self._receiver
        if receiver is None:
            return
        self.stats.received_messages += 1
        self.stats.received_bytes += _stream_nbytes(header.specs)
        try:
            receiver.deliver(Message(header.kind, header.src, header.dst, header.iter, header.tag, header.meta,
                                     tensors))
        except Exception:
            self.stats.drop("internal_error")
            log.debug("rank %d: error delivering a streamed message", self.rank, exc_info=True)


def _stream_nbytes(specs: tuple[TensorSpec, ...]) -> int:
    return sum(spec.nbytes for spec in specs)


def _same_layout(mine: list[torch.Tensor], theirs: list[torch.Tensor]) -> bool:
    return len(mine) == len(theirs) and all(
        a.dtype == b.dtype and a.shape == b.shape for a, b in zip(mine, theirs))


def _first_frames(sizes: list[int]) -> list[int]:
    out, i = [], 2
    for nbytes in sizes:
        out.append(i)
        i += _frame_count(nbytes)
    return out


def _buffers_match(target: object, specs: tuple[TensorSpec, ...]) -> TypeGuard[Sequence[torch.Tensor]]:
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
        dst[off:off + n] = np.frombuffer(frame.buffer, dtype=np.uint8)
        off += n
        i += 1
    return t


__all__ = ["CHUNK_BYTES", "COPY_THRESHOLD", "STAGE_BYTES", "ZmqTransport", "routing_id", "tune_malloc", "zmq_endpoint"]

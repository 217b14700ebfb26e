"""Tensor payloads of :class:`~hopnet.transports.zmq.ZmqTransport` over a plain TCP stream.

libzmq receives every frame into a buffer of its own, so a tensor received over ZeroMQ is
copied twice, and each message crosses libzmq's I/O threads on both sides: at 1 MiB that
held the transport near 0.6x a plain socket (bench/README.md, "Transport"). Here the
bytes of large tensor messages go over one TCP connection per ordered pair of ranks
(sender -> receiver), written with ``sendmsg`` straight from the tensors and read with
``recv_into`` straight into the tensors the receiver's ``buffers_for`` returns, both on
the event loop thread. Everything else stays on ZeroMQ: control messages, small tensor
messages, and the header of every message, streamed or not.

Wire (both ends must run this version):

- The receiver listens on a second port next to its ROUTER (same host) and advertises it
  in its address: ``tcp://HOST:PORT?data=DPORT`` (:func:`with_data_port`). A peer known
  by a plain ``tcp://HOST:PORT`` (an address built by hand) gets everything over ZeroMQ.
- The sender opens the stream at its first large message to that peer and writes a hello
  (:data:`HELLO`: magic, version, its rank, a random 64-bit token naming this stream).
  The receiver accepts it only from a rank it would accept messages from (``not_neighbor``
  otherwise), and a new stream from a rank replaces that rank's old one.
- A streamed message is one ZeroMQ frame: a descriptor (:data:`DESCRIPTOR`) naming the
  stream's token and the message's sequence number on it, then the header. Its first byte,
  0xC1, is one msgpack never uses, so it cannot be taken for a header alone. On
  the stream the message is a prefix (:data:`PREFIX`: sequence number, byte count), then
  the tensors' raw bytes back to back.

Order: a receiver handles one sender's ZeroMQ messages in arrival order. While a streamed
message of a sender waits for its bytes, that sender's later messages (control ones too)
wait behind it in a :class:`_Lane`; other senders' messages do not (express messages,
which may overtake by contract, neither). The sender writes payloads in the order their
headers go to ZeroMQ, and per-peer order across concurrent ``send`` calls holds as for
ZeroMQ messages.

Failures: a stream that closes or breaks mid-payload drops the message being read
(``stream_closed``) and every later one announced on it, and the sender's next large
message opens a new stream. A prefix that does not match its header (a bug) closes the
stream the same way (``stream_desync``). A sender whose writes are not taken within
``send_timeout`` closes the stream and counts ``send_timeout``, as ZeroMQ sends do. A
stream that cannot be opened (a firewall) is not tried again for :data:`RETRY_S`; the
messages go over ZeroMQ meanwhile.

Off: with CURVE keys (the stream would be plaintext), for ``ipc://`` addresses, with
``payload_stream=False`` or ``HOPNET_ZMQ_PAYLOAD_STREAM=0``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hopnet.wire import Header

log = logging.getLogger(__name__)

ENV = "HOPNET_ZMQ_PAYLOAD_STREAM"

MIN_BYTES = 64 << 10
"""Smallest message (tensor bytes in total) sent over the stream; smaller ones go over
ZeroMQ. Chosen by bench/transport.py (bench/README.md, "Issue 18: tensor payloads over a
TCP stream")."""

CONNECT_TIMEOUT_S = 5.0
"""How long a sender waits for the stream to connect before using ZeroMQ instead."""

RETRY_S = 30.0
"""After a stream could not be opened, how long the sender uses ZeroMQ before trying again."""

HELLO_WAIT_S = 30.0
"""How long a streamed message's header waits for its stream's hello before it is dropped.
The sender writes the hello before it sends the header, so only a stream that died at once
(or a confused peer) leaves a header waiting that long."""

HELLO = struct.Struct("<4sHxxIQ")  # magic, version, sender rank, token
DESCRIPTOR = struct.Struct("<BxxxQQ")  # 0xC1, token, sequence number
PREFIX = struct.Struct("<QQ")  # sequence number, byte count
MAGIC = b"HNPS"
VERSION = 1
DESCRIPTOR_BYTE = 0xC1

_SCRATCH_BYTES = 1 << 20  # where the bytes of a discarded message are read to
_DEAD_TOKENS = 16  # closed streams remembered per sender (their late headers are dropped)


def enabled(flag: bool | None) -> bool:
    """The constructor's choice, else the environment's (on unless ``HOPNET_ZMQ_PAYLOAD_STREAM=0``)."""
    if flag is not None:
        return flag
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def with_data_port(address: str, port: int) -> str:
    return f"{address}?data={port}"


def split_address(address: str) -> tuple[str, tuple[str, int] | None]:
    """``(ZeroMQ endpoint, (host, data port) or None)`` of an address from :func:`with_data_port`."""
    endpoint, sep, query = address.partition("?")
    if not sep or not endpoint.startswith("tcp://") or not query.startswith("data="):
        return endpoint, None
    try:
        port = int(query[5:])
    except ValueError:
        return endpoint, None
    if not 0 < port < 65536:
        return endpoint, None
    hostport = endpoint[len("tcp://"):]
    host = hostport.rpartition(":")[0]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return endpoint, (host, port)


def described(token: int, seq: int, header: bytes) -> bytes:
    """The ZeroMQ frame of a streamed message: its descriptor, then its header."""
    return DESCRIPTOR.pack(DESCRIPTOR_BYTE, token, seq) + header


def is_described(frame: memoryview | bytes) -> bool:
    return len(frame) > DESCRIPTOR.size and frame[0] == DESCRIPTOR_BYTE


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


# ------------------------------------------------------------------------ sending


class _Job:
    __slots__ = ("bufs", "future")

    def __init__(self, bufs: list[memoryview], future: asyncio.Future[str | None]) -> None:
        self.bufs = bufs
        self.future = future

    def advance(self, n: int) -> bool:
        """Account for ``n`` bytes written; True when all are."""
        bufs = self.bufs
        while n:
            first = bufs[0]
            if n >= first.nbytes:
                n -= first.nbytes
                bufs.pop(0)
            else:
                bufs[0] = first[n:]
                n = 0
        while bufs and not bufs[0].nbytes:
            bufs.pop(0)
        return not bufs


class OutStream:
    """The sender's end of one stream: writes queued payloads in order, from the event loop.

    :meth:`write` returns a Future that resolves to ``None`` once every byte is in the
    kernel (the caller may reuse the tensors), or to a drop reason if the stream was
    closed first (:meth:`abort`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, token: int) -> None:
        self.loop = loop
        self.token = token
        self.closed = False
        self._sock = sock
        self._fd = sock.fileno()
        self._seq = 0
        self._jobs: deque[_Job] = deque()
        self._watching = False

    @classmethod
    async def open(cls, loop: asyncio.AbstractEventLoop, host: str, port: int, rank: int,
                   timeout: float) -> OutStream:
        """Connect and write the hello. Raises OSError or asyncio.TimeoutError."""
        sock = socket.socket(_family(host), socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await asyncio.wait_for(loop.sock_connect(sock, (host, port)), timeout)
            token = secrets.randbits(64)
            sock.send(HELLO.pack(MAGIC, VERSION, rank, token))  # a fresh socket takes 20 bytes whole
        except BaseException:
            sock.close()
            raise
        return cls(loop, sock, token)

    def write(self, buffers: list[memoryview], nbytes: int) -> tuple[int, asyncio.Future[str | None]]:
        """Queue one message (its tensors' bytes); returns its sequence number and Future."""
        seq = self._seq
        self._seq += 1
        fut: asyncio.Future[str | None] = self.loop.create_future()
        if self.closed:
            fut.set_result("stream_closed")
            return seq, fut
        self._jobs.append(_Job([memoryview(PREFIX.pack(seq, nbytes)), *buffers], fut))
        if len(self._jobs) == 1:
            self._pump()
        return seq, fut

    def _pump(self) -> None:
        jobs = self._jobs
        sock = self._sock
        while jobs:
            job = jobs[0]
            try:
                n = sock.sendmsg(job.bufs)
            except (BlockingIOError, InterruptedError):
                self._watch(True)
                return
            except OSError as exc:
                log.debug("payload stream write failed: %s", exc)
                self.abort("stream_closed")
                return
            if not job.advance(n):
                self._watch(True)  # the kernel's buffer is full: wait until it has room
                return
            jobs.popleft()
            if not job.future.done():
                job.future.set_result(None)
        self._watch(False)

    def _watch(self, on: bool) -> None:
        if on != self._watching and not self.closed:
            if on:
                self.loop.add_writer(self._fd, self._pump)
            else:
                self.loop.remove_writer(self._fd)
            self._watching = on

    def abort(self, reason: str) -> None:
        """Close the stream; every queued message resolves to ``reason``. Idempotent."""
        if self.closed:
            return
        self._watch(False)
        self.closed = True
        jobs, self._jobs = self._jobs, deque()
        for job in jobs:
            if not job.future.done():
                job.future.set_result(reason)
        self._sock.close()


# ---------------------------------------------------------------------- receiving


@dataclass(slots=True)
class Pending:
    """A streamed message whose header came over ZeroMQ: its bytes come from stream ``token``."""

    header: Header
    token: int
    seq: int
    nbytes: int


@dataclass(slots=True)
class _Lane:
    """One sender's inbound order: the streamed message being received, what waits behind it."""

    current: Pending | None = None
    reading: bool = False  # current's bytes are being read
    timer: asyncio.TimerHandle | None = None  # current waits for its stream's hello until then
    waiting: deque[Any] = field(default_factory=deque)  # ZeroMQ messages (frame lists), in order
    dead: deque[int] = field(default_factory=lambda: deque(maxlen=_DEAD_TOKENS))

    @property
    def busy(self) -> bool:
        return self.current is not None or bool(self.waiting)


Prepared = tuple[list[torch.Tensor], str | None]
"""What :class:`StreamInbox`'s ``prepare`` returns for a header: the tensors to read the
bytes into, and ``None`` to deliver them or a drop reason (read, then dropped)."""


class StreamInbox:
    """The receiver's side: the listening socket, one stream per sender, and per-sender order.

    The transport calls :meth:`busy` / :meth:`defer` for each ZeroMQ message (a sender's
    message waits while that sender's lane is busy) and :meth:`begin` for a streamed one.
    The inbox calls back ``prepare(header)`` when a message's bytes are about to be read,
    ``finish(header, tensors)`` when they are, ``handle(frames)`` for each waiting ZeroMQ
    message once its turn comes, ``admits(rank)`` for a stream's hello, and ``drop(reason)``.
    None of them may raise.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, host: str, *, admits: Callable[[int], bool],
                 prepare: Callable[[Header], Prepared], finish: Callable[[Header, list[torch.Tensor]], None],
                 handle: Callable[[Any], None], drop: Callable[[str], None]) -> None:
        self.loop = loop
        self._admits, self._prepare, self._finish, self._handle, self._drop = admits, prepare, finish, handle, drop
        listener = socket.socket(_family(host), socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, 0))
            listener.listen(128)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self.port: int = listener.getsockname()[1]
        self._listener: socket.socket | None = listener
        self._streams: dict[int, _InStream] = {}  # by sender rank, once its hello is read
        self._unnamed: set[_InStream] = set()  # accepted, hello not read yet
        self._lanes: dict[int, _Lane] = {}
        self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
        loop.add_reader(listener.fileno(), self._accept)

    # ------------------------------------------------------------ called by the transport

    def busy(self, rank: int) -> bool:
        lane = self._lanes.get(rank)
        return lane is not None and lane.busy

    def defer(self, rank: int, frames: Any) -> None:
        self._lanes[rank].waiting.append(frames)

    def begin(self, rank: int, item: Pending) -> None:
        """A streamed message's header arrived (``rank``'s lane is free): receive its bytes."""
        lane = self._lanes.setdefault(rank, _Lane())
        lane.current = item
        lane.reading = False
        self._start(rank, lane)

    def close(self) -> None:
        if self._listener is not None:
            if not self.loop.is_closed():
                self.loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
        for stream in [*self._streams.values(), *self._unnamed]:
            stream.close()
        for lane in self._lanes.values():
            if lane.timer is not None:
                lane.timer.cancel()
        self._streams.clear()
        self._unnamed.clear()
        self._lanes.clear()

    # ------------------------------------------------------------------- internals

    def _accept(self) -> None:
        listener = self._listener
        while listener is not None:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                log.debug("payload stream accept failed", exc_info=True)
                return
            sock.setblocking(False)
            stream = _InStream(self, sock)
            self._unnamed.add(stream)
            stream.read_hello()

    def _named(self, stream: _InStream, rank: int) -> None:
        """A stream's hello was read."""
        self._unnamed.discard(stream)
        if not self._admits(rank):
            self._drop("not_neighbor")
            log.debug("payload stream from rank %d refused: not a sender of this rank", rank)
            stream.close()
            return
        old = self._streams.get(rank)
        self._streams[rank] = stream
        lane = self._lanes.setdefault(rank, _Lane())
        if old is not None:  # the sender replaced it (a reset, or a new process of the same rank)
            self._lost(rank, old, "stream_closed")
        if lane.current is not None:
            self._start(rank, lane)

    def _start(self, rank: int, lane: _Lane) -> None:
        """Receive the lane's current message if its stream is here; drop it if that is gone."""
        item = lane.current
        if item is None or lane.reading:
            return
        stream = self._streams.get(rank)
        if stream is not None and stream.token == item.token and not stream.closed:
            lane.reading = True
            if lane.timer is not None:
                lane.timer.cancel()
                lane.timer = None
            tensors, reason = self._prepare(item.header)
            stream.read(item, tensors, reason, self._scratch)
        elif item.token in lane.dead:  # its stream closed: those bytes never come
            self._drop("stream_closed")
            self._next(rank, lane)
        elif lane.timer is None:  # its stream's hello is not read yet: _named starts it
            lane.timer = self.loop.call_later(HELLO_WAIT_S, self._give_up, rank, lane, item)

    def _give_up(self, rank: int, lane: _Lane, item: Pending) -> None:
        lane.timer = None
        if lane.current is item and not lane.reading and self._lanes.get(rank) is lane:
            self._drop("stream_closed")
            self._next(rank, lane)

    def _next(self, rank: int, lane: _Lane) -> None:
        """The current message is done with: handle what waited, up to the next streamed one."""
        lane.current = None
        lane.reading = False
        if lane.timer is not None:
            lane.timer.cancel()
            lane.timer = None
        while lane.current is None and lane.waiting:
            self._handle(lane.waiting.popleft())  # may call begin(), which sets lane.current

    def _received(self, stream: _InStream, item: Pending, tensors: list[torch.Tensor], reason: str | None) -> None:
        rank = stream.rank
        lane = self._lanes.get(rank)
        if lane is None or lane.current is not item:
            return
        if reason is None:
            self._finish(item.header, tensors)
        else:
            self._drop(reason)
        self._next(rank, lane)

    def _lost(self, rank: int, stream: _InStream, reason: str) -> None:
        """``stream`` closed or broke: drop what it was receiving and what was announced on it."""
        stream.close()
        if self._streams.get(rank) is stream:
            del self._streams[rank]
        lane = self._lanes.get(rank)
        if lane is None:
            return
        lane.dead.append(stream.token)
        item = lane.current
        if item is not None and item.token == stream.token:
            self._drop(reason)
            self._next(rank, lane)


class _InStream:
    """One accepted connection: reads its hello, then the messages the inbox asks for."""

    def __init__(self, inbox: StreamInbox, sock: socket.socket) -> None:
        self.inbox = inbox
        self.sock = sock
        self.fd = sock.fileno()
        self.rank = -1
        self.token = 0
        self.closed = False
        self._watching = False
        self._views: deque[memoryview] = deque()  # where the next bytes go, in order
        self._hello = bytearray(HELLO.size)
        self._prefix = bytearray(PREFIX.size)
        self._at_prefix = False  # the first view is the prefix: check it before the body
        self._item: Pending | None = None
        self._tensors: list[torch.Tensor] = []
        self._reason: str | None = None
        self._in_callback = False

    def read_hello(self) -> None:
        self._views.append(memoryview(self._hello))
        self._on_readable()

    def read(self, item: Pending, tensors: list[torch.Tensor], reason: str | None, scratch: memoryview) -> None:
        self._item, self._tensors, self._reason = item, tensors, reason
        views = self._views
        views.append(memoryview(self._prefix))
        self._at_prefix = True
        if reason is None:
            for t in tensors:
                if t.numel():
                    views.append(t.detach().reshape(-1).view(torch.uint8).numpy().data)
        else:  # read the bytes to keep the stream in step, then drop them
            left = item.nbytes
            while left:
                n = min(left, scratch.nbytes)
                views.append(scratch[:n])
                left -= n
        if not self._in_callback:
            self._on_readable()  # the bytes are often here already

    def _watch(self, on: bool) -> None:
        if on != self._watching and not self.closed:
            loop = self.inbox.loop
            if on:
                loop.add_reader(self.fd, self._on_readable)
            else:
                loop.remove_reader(self.fd)
            self._watching = on

    def _on_readable(self) -> None:
        self._in_callback = True
        try:
            self._read()
        except Exception:
            log.debug("payload stream from rank %d failed", self.rank, exc_info=True)
            self._fail("internal_error")
        finally:
            self._in_callback = False

    def _read(self) -> None:
        views = self._views
        sock = self.sock
        while views and not self.closed:
            view = views[0]
            try:
                n = sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                self._watch(True)
                return
            except OSError:
                self._fail("stream_closed")
                return
            if not n:
                self._fail("stream_closed")
                return
            if n < view.nbytes:
                views[0] = view[n:]
                continue
            views.popleft()
            if self._at_prefix:
                self._at_prefix = False
                if not self._prefix_matches():
                    self._fail("stream_desync")
                    return
            if not views:
                self._completed()
        if not views:
            self._watch(False)  # idle: a later message's bytes wait in the kernel

    def _prefix_matches(self) -> bool:
        item = self._item
        seq, nbytes = PREFIX.unpack(self._prefix)
        return item is not None and seq == item.seq and nbytes == item.nbytes

    def _completed(self) -> None:
        if self._item is None:  # the hello
            magic, version, rank, token = HELLO.unpack(self._hello)
            if magic != MAGIC or version != VERSION:
                self.inbox._drop("bad_header")
                self._fail("bad_header")
                return
            self.rank, self.token = rank, token
            self.inbox._named(self, rank)
            return
        item, tensors, reason = self._item, self._tensors, self._reason
        self._item, self._tensors = None, []
        self.inbox._received(self, item, tensors, reason)

    def _fail(self, reason: str) -> None:
        if self.closed:
            return
        if self.rank < 0:  # before the hello: nothing was announced on it
            self.close()
            self.inbox._unnamed.discard(self)
            return
        self._item = None
        self._views.clear()
        self.inbox._lost(self.rank, self, reason)

    def close(self) -> None:
        if self.closed:
            return
        self._watch(False)
        self.closed = True
        self._views.clear()
        self.sock.close()

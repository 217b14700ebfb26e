"""Tensor messages of :class:`~hopnet.transports.zmq.ZmqTransport` over a plain TCP stream.

libzmq receives every frame into a buffer of its own, so a tensor received over ZeroMQ is
copied twice, and each message crosses libzmq's I/O threads on both sides: at 1 MiB that
held the transport near 0.6x a plain socket (docs/performance/index.md, "Transport: throughput and latency"). Here large
tensor messages go whole (header and tensor bytes) over one TCP connection per ordered
pair of ranks (sender -> receiver), written with ``sendmsg`` straight from the tensors and
read with ``recv_into`` straight into the tensors the receiver's ``buffers_for`` returns,
both on the event loop thread. Control messages and small tensor messages stay on ZeroMQ.

Wire (both ends must run this version, :data:`VERSION`):

- The receiver listens on a second port next to its ROUTER (same host) and advertises it
  in its address: ``tcp://HOST:PORT?data=DPORT`` (:func:`with_data_port`). A peer known
  by a plain ``tcp://HOST:PORT`` (an address built by hand) gets everything over ZeroMQ.
- The sender opens the stream at its first large message to that peer and writes a hello
  (:data:`HELLO`: magic, version, its rank, a random 64-bit token naming this stream, and
  the epoch of its connection to the peer, below). The receiver answers one byte
  (:data:`ACCEPT`) if it takes the stream: from a rank it accepts messages from, speaking
  this version. Otherwise it closes the stream (``not_neighbor``, or one log line naming
  both versions) and the sender sends over ZeroMQ for :data:`RETRY_S`. A new stream from
  a rank replaces that rank's old one.
- A streamed message is, on the stream only: a prefix (:data:`PREFIX`: its sequence number
  on the stream, counted from 1; ``z_before``, below; the tensor byte count; the header's
  length), the msgpack header, then the tensors' raw bytes back to back.
- Every ZeroMQ message (but express ones) to a peer that advertises a stream starts its
  first frame with a lane tag (:data:`LANE`: 0xC1, a byte msgpack never uses, then the
  epoch, its ZeroMQ sequence number ``zseq`` counted from 1, the token of the sender's
  current stream to that peer (0: none) and ``s_last``, the sequence number of the last
  message written on that stream before it; once that stream was closed mid-way, of the last
  message whose bytes all reached the kernel: the rest never comes). The epoch is a random
  64-bit number per sender-side connection (a DEALER and the streams opened with it), also
  the epoch of the messages' numbers (:mod:`hopnet.transports.link_numbers`); ``z_before`` is
  the ``zseq`` of the last ZeroMQ message sent with that epoch before the streamed message.

Order (per sender, the order of its ``send`` calls, across both channels): a ZeroMQ
message is handled once its stream has finished message ``s_last`` (delivered or
dropped), and after the sender's earlier ZeroMQ messages (they wait in a :class:`_Lane`);
a streamed message is read past its header (``buffers_for`` is asked) only once the
receiver has handled the sender's ZeroMQ message ``z_before`` of its epoch: until then the
stream is not read. A sender that sends only streamed messages costs no ZeroMQ message;
one that interleaves control messages costs no extra round trip, only the lane tag.
Express messages (which may overtake by contract) carry no tag and wait for nothing.
Order holds within one epoch: a sender's reset connection, or its new process, starts a
new one (what was queued on the old one was dropped anyway).

Failures: a stream that closes or breaks mid-message drops that message (``stream_closed``)
and, since its bytes never come, every later one on it; ZeroMQ messages waiting behind
them are then handled (delivered), as ZeroMQ messages behind a lost one would be. A ZeroMQ
message whose stream's hello never arrives waits :data:`HELLO_WAIT_S`, then is handled; a
streamed message whose ZeroMQ predecessor never arrives (the sender dropped it:
``send_timeout``) waits :data:`ORDER_WAIT_S`, then is read and delivered. A prefix or
header that does not fit (a bug) closes the stream (``stream_desync``); a header that the
receiver refuses (``bad_header``, ``not_neighbor``, ``spoofed_src``...) is read past and
counted. A sender whose writes are not taken within ``send_timeout`` closes the stream and
counts ``send_timeout``, as ZeroMQ sends do. A stream that cannot be opened (a firewall, a
refusal) is not tried again for :data:`RETRY_S`; the messages go over ZeroMQ meanwhile.

Off: with CURVE keys (the stream would be plaintext), for ``ipc://`` addresses, with
``payload_stream=False`` or ``HOPNET_ZMQ_PAYLOAD_STREAM=0``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import select
import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from hopnet.wire import DecodeError, Header, decode_header

log = logging.getLogger(__name__)

ENV = "HOPNET_ZMQ_PAYLOAD_STREAM"

MIN_BYTES = 64 << 10
"""Smallest message (tensor bytes in total) sent over the stream; smaller ones go over
ZeroMQ. Chosen by bench/transport.py (docs/performance/archive.md, "Tensor payloads over a
TCP stream")."""

CONNECT_TIMEOUT_S = 5.0
"""How long a sender waits for the stream to connect and be accepted before using ZeroMQ instead."""

RETRY_S = 30.0
"""After a stream could not be opened, how long the sender uses ZeroMQ before trying again."""

HELLO_WAIT_S = 30.0
"""How long a ZeroMQ message waits for the hello of the stream it comes after. The sender
has its stream accepted before it tags a message with it, so only a stream that died at
once (or a confused peer) leaves a message waiting that long."""

ORDER_WAIT_S = 30.0
"""How long a streamed message waits for the ZeroMQ message it comes after; only one the
sender dropped (``send_timeout``) never comes."""

SPIN_S = 0.002
"""How long a stream's reader, mid-message, waits for more bytes in ``poll`` before it
yields to the event loop: the loop's round per partial read cost more than the wait at
1 MiB (docs/performance/archive.md, "The header on the stream too"). Bounds how long one
read holds the loop; 0 turns it off."""

MAX_HEADER_BYTES = 16 << 20
"""Longest header a stream's prefix may announce; more is a desync (the stream is closed)."""

HELLO = struct.Struct("<4sHxxIQQ")  # magic, version, sender rank, token, epoch
PREFIX = struct.Struct("<QQQI")  # sequence number, z_before, tensor byte count, header length
LANE = struct.Struct("<B3xQQQQ")  # 0xC1, epoch, zseq, stream token, s_last
MAGIC = b"HNPS"
VERSION = 2
ACCEPT = b"\x01"
TAG_BYTE = 0xC1

_SCRATCH_BYTES = 1 << 20  # where the bytes of a discarded message are read to
_DEAD_TOKENS = 16  # closed streams remembered per sender (ZeroMQ messages after them wait for nothing)
_EPOCHS = 8  # epochs whose handled ZeroMQ sequence numbers a lane remembers


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


class Tag(NamedTuple):
    """A ZeroMQ message's place in its sender's lane (:data:`LANE`)."""

    epoch: int
    zseq: int
    token: int
    s_last: int


def lane_tag(epoch: int, zseq: int, token: int, s_last: int) -> bytes:
    return LANE.pack(TAG_BYTE, epoch, zseq, token, s_last)


def is_tagged(frame: memoryview | bytes) -> bool:
    return len(frame) > LANE.size and frame[0] == TAG_BYTE


def read_tag(frame: memoryview | bytes) -> Tag | None:
    if not is_tagged(frame):
        return None
    _, epoch, zseq, token, s_last = LANE.unpack_from(frame)
    return Tag(epoch, zseq, token, s_last)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


# ------------------------------------------------------------------------ sending


class _Job:
    __slots__ = ("bufs", "future", "seq")

    def __init__(self, bufs: list[memoryview], future: asyncio.Future[str | None], seq: int) -> None:
        self.bufs = bufs
        self.future = future
        self.seq = seq

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
    """The sender's end of one stream: writes queued messages in order, from the event loop.

    :meth:`write` returns a Future that resolves to ``None`` once every byte is in the
    kernel (the caller may reuse the tensors), or to a drop reason if the stream was
    closed first (:meth:`abort`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, token: int) -> None:
        self.loop = loop
        self.token = token
        self.closed = False
        self.seq = 0
        """Sequence number of the last message written (0: none yet)."""
        self.written = 0
        """Sequence number of the last message whose bytes are all in the kernel."""
        self._sock = sock
        self._fd = sock.fileno()
        self._jobs: deque[_Job] = deque()
        self._watching = False

    @classmethod
    async def open(cls, loop: asyncio.AbstractEventLoop, host: str, port: int, rank: int, epoch: int,
                   timeout: float) -> OutStream:
        """Connect, write the hello and wait for the receiver's :data:`ACCEPT`.
        Raises OSError (refused) or asyncio.TimeoutError."""
        sock = socket.socket(_family(host), socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            deadline = loop.time() + timeout
            await asyncio.wait_for(loop.sock_connect(sock, (host, port)), timeout)
            token = secrets.randbits(64) or 1
            sock.send(HELLO.pack(MAGIC, VERSION, rank, token, epoch))  # a fresh socket takes 28 bytes whole
            answer = await asyncio.wait_for(loop.sock_recv(sock, 1), max(0.0, deadline - loop.time()))
            if answer != ACCEPT:
                raise ConnectionRefusedError("refused by the receiver (another wire version, or not its sender)")
        except BaseException:
            sock.close()
            raise
        return cls(loop, sock, token)

    def write(self, header: bytes, buffers: list[memoryview], nbytes: int, z_before: int,
              ) -> asyncio.Future[str | None]:
        """Queue one message (its header and its tensors' bytes); returns its Future."""
        self.seq += 1
        fut: asyncio.Future[str | None] = self.loop.create_future()
        if self.closed:
            fut.set_result("stream_closed")
            return fut
        head = PREFIX.pack(self.seq, z_before, nbytes, len(header)) + header
        self._jobs.append(_Job([memoryview(head), *buffers], fut, self.seq))
        if len(self._jobs) == 1:
            self._pump()
        return fut

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
            self.written = job.seq
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
class _Waiting:
    """A ZeroMQ message that waits for its turn: the transport's item, and its tag (None: untagged)."""

    item: Any
    tag: Tag | None


@dataclass(slots=True)
class _Lane:
    """One sender's inbound order: its stream, its ZeroMQ messages that wait, what was handled."""

    stream: _InStream | None = None
    waiting: deque[_Waiting] = field(default_factory=deque)
    dead: deque[int] = field(default_factory=lambda: deque(maxlen=_DEAD_TOKENS))
    zseen: dict[int, int] = field(default_factory=dict)  # epoch -> highest zseq handled
    hello_timer: asyncio.TimerHandle | None = None  # the first waiting message's stream is unknown until then
    pumping: bool = False
    again: bool = False

    def seen(self, epoch: int, zseq: int) -> None:
        zseen = self.zseen
        if zseq > zseen.get(epoch, 0):
            if epoch not in zseen and len(zseen) >= _EPOCHS:
                del zseen[next(iter(zseen))]
            zseen[epoch] = zseq


Prepared = tuple[list[torch.Tensor], str | None]
"""What :class:`StreamInbox`'s ``prepare`` returns for a header: the tensors to read the
bytes into, and ``None`` to deliver them or a drop reason (read, then dropped)."""


class StreamInbox:
    """The receiver's side: the listening socket, one stream per sender, and per-sender order.

    The transport passes every checked ZeroMQ message of a sender (but express ones) to
    :meth:`arrived`, which hands it back through ``handle(item)`` now or once its turn
    comes. For streamed messages the inbox calls ``check(header, rank)`` (a drop reason or
    None) when the header is read, ``prepare(header)`` when its bytes are about to be read,
    ``finish(header, tensors)`` when they are; ``admits(rank)`` for a stream's hello, and
    ``drop(reason)``. None of them may raise.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, host: str, *, admits: Callable[[int], bool],
                 check: Callable[[Header, int], str | None], prepare: Callable[[Header], Prepared],
                 finish: Callable[[Header, list[torch.Tensor]], None], handle: Callable[[Any], None],
                 drop: Callable[[str], None]) -> None:
        self.loop = loop
        self._admits, self._check, self._prepare = admits, check, prepare
        self._finish, self._handle, self._drop = finish, handle, drop
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
        self._unnamed: set[_InStream] = set()  # accepted, hello not read yet
        self._lanes: dict[int, _Lane] = {}
        self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
        loop.add_reader(listener.fileno(), self._accept)

    # ------------------------------------------------------------ called by the transport

    def arrived(self, rank: int, item: Any, tag: Tag | None) -> None:
        """A ZeroMQ message from ``rank`` (``item``, with its lane ``tag``): handled now, or
        once what it comes after is."""
        lane = self._lanes.get(rank)
        if lane is None:
            if tag is None:
                self._handle(item)
                return
            lane = self._lanes[rank] = _Lane()
        if lane.waiting or not self._zready(lane, tag):
            lane.waiting.append(_Waiting(item, tag))
            return
        self._handle(item)
        if tag is not None:
            lane.seen(tag.epoch, tag.zseq)
            stream = lane.stream
            if stream is not None and stream.held:
                self._pump(lane)

    def close(self) -> None:
        if self._listener is not None:
            if not self.loop.is_closed():
                self.loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
        for stream in [*(lane.stream for lane in self._lanes.values() if lane.stream), *self._unnamed]:
            stream.close()
        for lane in self._lanes.values():
            if lane.hello_timer is not None:
                lane.hello_timer.cancel()
        self._unnamed.clear()
        self._lanes.clear()

    # ------------------------------------------------------------------- order

    def _zready(self, lane: _Lane, tag: Tag | None) -> bool:
        """Whether a ZeroMQ message's stream predecessor is done with."""
        if tag is None or not tag.token or not tag.s_last:
            return True
        stream = lane.stream
        if stream is not None and stream.token == tag.token:
            return stream.done >= tag.s_last
        if tag.token in lane.dead:
            return True
        if lane.hello_timer is None:  # its stream's hello is not read yet
            lane.hello_timer = self.loop.call_later(HELLO_WAIT_S, self._hello_overdue, lane, tag.token)
        return False

    def _hello_overdue(self, lane: _Lane, token: int) -> None:
        lane.hello_timer = None
        stream = lane.stream
        if stream is None or stream.token != token:
            log.debug("payload stream %x never arrived; the messages behind it go on", token)
            lane.dead.append(token)
        self._pump(lane)

    def ready(self, stream: _InStream) -> bool:
        """Whether a streamed message whose header was read may be received now."""
        lane = self._lanes.get(stream.rank)
        return lane is None or stream.forced or lane.zseen.get(stream.epoch, 0) >= stream.z_before

    def _pump(self, lane: _Lane) -> None:
        """Handle what waited and may go now, on both channels; again while anything moves."""
        if lane.pumping:
            lane.again = True
            return
        lane.pumping = True
        try:
            while True:
                lane.again = False
                waiting = lane.waiting
                while waiting and self._zready(lane, waiting[0].tag):
                    item = waiting.popleft()
                    self._handle(item.item)
                    if item.tag is not None:
                        lane.seen(item.tag.epoch, item.tag.zseq)
                if not waiting and lane.hello_timer is not None:
                    lane.hello_timer.cancel()
                    lane.hello_timer = None
                stream = lane.stream
                if stream is not None and stream.held and self.ready(stream):
                    stream.release()
                if not lane.again:
                    return
        finally:
            lane.pumping = False

    # ------------------------------------------------------------------- streams

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
            stream.start()

    def _named(self, stream: _InStream, version: int, rank: int) -> bool:
        """A stream's hello was read: take the stream (True), or close it."""
        self._unnamed.discard(stream)
        if version != VERSION:
            log.warning("payload stream from rank %d refused: it speaks wire version %d, this process %d "
                        "(run the same hopnet everywhere); its tensors go over ZeroMQ", rank, version, VERSION)
            self._drop("wire_version")
            stream.close()
            return False
        if not self._admits(rank):
            self._drop("not_neighbor")
            log.debug("payload stream from rank %d refused: not a sender of this rank", rank)
            stream.close()
            return False
        try:
            stream.sock.send(ACCEPT)
        except OSError:
            stream.close()
            return False
        lane = self._lanes.setdefault(rank, _Lane())
        old, lane.stream = lane.stream, stream
        if old is not None:  # the sender replaced it (a reset, or a new process of the same rank)
            self._lost(old, "stream_closed")
        self._pump(lane)  # ZeroMQ messages may have waited for this stream's hello
        return True

    def _done(self, stream: _InStream, header: Header | None, tensors: list[torch.Tensor],
              reason: str | None) -> None:
        """A streamed message was read (delivered, or dropped with ``reason``)."""
        if reason is None and header is not None:
            self._finish(header, tensors)
        elif reason is not None:
            self._drop(reason)
        lane = self._lanes.get(stream.rank)
        if lane is not None and lane.waiting:
            self._pump(lane)

    def _lost(self, stream: _InStream, reason: str) -> None:
        """``stream`` closed or broke: drop the message it was reading; what waited behind goes on."""
        partial = stream.mid_message
        stream.close()
        if partial:
            self._drop(reason)
        lane = self._lanes.get(stream.rank)
        if lane is None:
            return
        lane.dead.append(stream.token)
        if lane.stream is stream:
            lane.stream = None
        self._pump(lane)


_HELLO, _PREFIX, _HEADER, _HELD, _BODY = range(5)


class _InStream:
    """One accepted connection: reads its hello, then message after message, in order."""

    def __init__(self, inbox: StreamInbox, sock: socket.socket) -> None:
        self.inbox = inbox
        self.sock = sock
        self.fd = sock.fileno()
        self.rank = -1
        self.token = 0
        self.epoch = 0
        self.closed = False
        self.done = 0  # sequence number of the last message finished with
        self.z_before = 0  # of the message whose header was read
        self.forced = False  # that message stopped waiting for its ZeroMQ predecessor (ORDER_WAIT_S)
        self._phase = _HELLO
        self._watching = False
        self._views: deque[memoryview] = deque()  # where the next bytes go, in order
        self._fixed = bytearray(max(HELLO.size, PREFIX.size))
        self._started = False  # bytes of the current message (from its prefix) were read
        self._header: Header | None = None
        self._reason: str | None = None  # the current message is read past, then dropped for this
        self._nbytes = 0
        self._head = bytearray()
        self._tensors: list[torch.Tensor] = []
        self._timer: asyncio.TimerHandle | None = None
        self._in_callback = False
        self._poller = select.poll()
        self._poller.register(self.fd, select.POLLIN)

    @property
    def held(self) -> bool:
        return self._phase == _HELD and not self.closed

    @property
    def mid_message(self) -> bool:
        return self._phase != _HELLO and (self._started or self._phase != _PREFIX)

    def start(self) -> None:
        self._expect(_HELLO, memoryview(self._fixed)[:HELLO.size])
        self._on_readable()

    def release(self) -> None:
        """The held message's turn has come: receive its bytes."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._body()
        if not self._in_callback:
            self._on_readable()

    def _expect(self, phase: int, view: memoryview) -> None:
        self._phase = phase
        self._views.append(view)

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
        spin_until = 0.0
        while not self.closed:
            if not views:  # held: nothing more is read until the message's turn
                self._watch(False)
                return
            view = views[0]
            try:
                n = sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                if self._phase == _BODY and SPIN_S > 0:
                    # Mid-body, the rest is usually a few µs away: wait for it here (bounded)
                    # rather than through the event loop, whose round costs more than the wait.
                    now = time.monotonic()
                    if spin_until == 0.0:
                        spin_until = now + SPIN_S
                    if now < spin_until and self._poller.poll(max(1, int((spin_until - now) * 1000))):
                        continue
                self._watch(True)
                return
            except OSError:
                self._fail("stream_closed")
                return
            if not n:
                self._fail("stream_closed")
                return
            self._started = True
            if n < view.nbytes:
                views[0] = view[n:]
                continue
            views.popleft()
            if not views:
                self._step()

    def _step(self) -> None:
        """The current phase's bytes are all read: on to the next."""
        phase = self._phase
        if phase == _PREFIX:
            seq, self.z_before, nbytes, hlen = PREFIX.unpack_from(self._fixed)
            if seq != self.done + 1 or hlen > MAX_HEADER_BYTES or not hlen:
                self._fail("stream_desync")
                return
            self._nbytes = nbytes
            self._head = bytearray(hlen)
            self._expect(_HEADER, memoryview(self._head))
        elif phase == _HEADER:
            self._parse()
        elif phase == _BODY:
            self._finish()
        else:  # the hello
            magic, version, rank, token, epoch = HELLO.unpack_from(self._fixed)
            if magic != MAGIC:
                self.inbox._drop("bad_header")
                self._fail("bad_header")
                return
            self.rank, self.token, self.epoch = rank, token, epoch
            if self.inbox._named(self, version, rank):
                self._next_message()

    def _parse(self) -> None:
        """The header is read: check it, then receive the bytes now or once its turn comes."""
        self._header, self._reason = None, None
        try:
            header = decode_header(memoryview(self._head))
        except DecodeError as exc:
            self._reason = exc.reason
        else:
            if not header.specs or sum(spec.nbytes for spec in header.specs) != self._nbytes:
                self._fail("stream_desync")
                return
            self._header = header
            self._reason = self.inbox._check(header, self.rank)
        self.forced = False
        if self.inbox.ready(self):
            self._body()
            return
        self._phase = _HELD
        self._timer = self.inbox.loop.call_later(ORDER_WAIT_S, self._overdue)

    def _overdue(self) -> None:
        self._timer = None
        if self.held:
            log.debug("rank %d's stream: the ZeroMQ message before this one never came; receiving it", self.rank)
            self.forced = True
            self.release()

    def _body(self) -> None:
        """Ask for the tensors (or a scratch area) and read the message's bytes into them."""
        header, reason = self._header, self._reason
        tensors: list[torch.Tensor] = []
        if reason is None and header is not None:
            tensors, reason = self.inbox._prepare(header)
        self._tensors, self._reason = tensors, reason
        self._phase = _BODY
        views = self._views
        if reason is None:
            for t in tensors:
                if t.numel():
                    views.append(t.detach().reshape(-1).view(torch.uint8).numpy().data)
        else:  # read the bytes to keep the stream in step, then drop them
            scratch = self.inbox._scratch
            left = self._nbytes
            while left:
                n = min(left, scratch.nbytes)
                views.append(scratch[:n])
                left -= n
        if not views:
            self._finish()

    def _finish(self) -> None:
        header, tensors, reason = self._header, self._tensors, self._reason
        self._header, self._tensors, self._reason = None, [], None
        self.done += 1
        self._next_message()
        self.inbox._done(self, header, tensors, reason)

    def _next_message(self) -> None:
        self._started = False
        self._expect(_PREFIX, memoryview(self._fixed)[:PREFIX.size])

    def _fail(self, reason: str) -> None:
        if self.closed:
            return
        if self.rank < 0 or self._phase == _HELLO:  # before the hello: nothing of a message was read
            self.close()
            self.inbox._unnamed.discard(self)
            return
        self.inbox._lost(self, reason)

    def close(self) -> None:
        if self.closed:
            return
        self._watch(False)
        self.closed = True
        self._views.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.sock.close()

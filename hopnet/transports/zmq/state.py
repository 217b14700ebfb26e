"""What every part of ZmqTransport shares: its state, its peers' connections, and the few steps on
them that sending, receiving and the lifecycle all take."""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from hopnet.errors import ConfigError
from hopnet.security import CurveKeys, HandshakeWatch, make_curve_client
from hopnet.transports import payload_stream as ps
from hopnet.transports.base import EventHook, Receiver, Transport
from hopnet.transports.link_numbers import LinkNumbers, key_source
from hopnet.transports.zmq import limits
from hopnet.transports.zmq.addresses import check_address, routing_id
from hopnet.transports.zmq.peer import Peer
from hopnet.transports.zmq.send_memory import BufferPool, SendDone

log = logging.getLogger(__name__)

WaitTimeout = asyncio.TimeoutError  # not the builtin TimeoutError before Python 3.11


class ZmqState(Transport):
    """The transport's state; the parts of :class:`~hopnet.transports.zmq.ZmqTransport` build on it."""

    def __init__(self, rank: int, allowed_senders: frozenset[int], *, bind: str = "tcp://127.0.0.1:*",
                 send_timeout: float = limits.DEFAULT_SEND_TIMEOUT,
                 context: zmq.asyncio.Context | None = None, tune_malloc: bool = True,
                 curve: CurveKeys | None = None, handover: bool = False,
                 payload_stream: bool | None = None) -> None:
        """``handover``: a peer may come back as a new process (``hopnet launch --max-restarts``).
        Kept for callers: a connection presenting a connected peer's routing id now always takes
        over from the old one (a sender's reset connection must get through too).
        ``payload_stream``: send the tensors of large messages over a TCP stream of their own
        (:mod:`hopnet.transports.payload_stream`); ``None`` (default) means on unless
        ``HOPNET_ZMQ_PAYLOAD_STREAM=0``. Always off with ``curve`` keys and ``ipc://`` addresses."""
        super().__init__(rank, frozenset(allowed_senders))
        check_address(bind, "bind address")
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
        self._peers: dict[int, Peer] = {}
        self._departed: set[int] = set()
        self._ids = {s: routing_id(s) for s in self.allowed_senders}
        self._inflight: set[SendDone] = set()
        self._held_sends: set[asyncio.Task[None]] = set()
        self._stage_pool = BufferPool(limits.STAGE_POOL_BYTES)
        self._closed = False
        self._curve = curve
        self._handshakes: HandshakeWatch | None = None
        self._handshakes_fd: int | None = None
        self.address: str | None = None
        self.payload_stream = ps.enabled(payload_stream) and curve is None
        """Whether large messages' tensors may go over payload streams (to peers that advertise one)."""
        self.streamed_messages = 0
        """Messages sent with their tensors over a payload stream (also in ``stats.sent_messages``)."""
        self._inbox: ps.StreamInbox | None = None
        self._numbers = LinkNumbers(self.stats, self._gap_found)
        self._record: EventHook | None = None  # the receiver's event log, for link_gap records

    def _gap_found(self, key: int, epoch: int, first: int, last: int) -> None:
        """Messages ``first..last`` of a sender's link never came (:mod:`hopnet.transports.link_numbers`):
        one warning, and a ``link_gap`` record in the receiver's event log."""
        src, express = key_source(key)
        missed = last - first + 1
        numbers = str(first) if first == last else f"{first}-{last}"
        log.warning("rank %d: %s %s from rank %d never arrived (link %d->%d%s, connection %016x): %d lost",
                    self.rank, "message" if missed == 1 else "messages", numbers, src, src, self.rank,
                    ", express" if express else "", epoch, missed)
        record = self._record
        if record is not None:
            fields: dict[str, object] = {"peer": src, "first": first, "last": last, "missed": missed}
            if express:
                fields["express"] = True
            try:
                record("link_gap", **fields)
            except Exception:  # a report must not break the receive path
                log.debug("rank %d: link_gap record failed", self.rank, exc_info=True)

    def _open_peer(self, rank: int, address: str) -> Peer:
        return Peer(rank, address, self._open_dealer(ps.split_address(address)[0], routing_id(self.rank)),
                     self.payload_stream)

    def _open_dealer(self, address: str, identity: bytes) -> zmq.asyncio.Socket:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, identity)
        sock.setsockopt(zmq.LINGER, limits.LINGER_MS)
        sock.setsockopt(zmq.SNDHWM, limits.HWM)
        sock.setsockopt(zmq.IMMEDIATE, 0)  # queue until connected
        sock.copy_threshold = limits.COPY_THRESHOLD
        if self._curve is not None:
            make_curve_client(sock, self._curve)
        sock.connect(address)
        return sock

    def backlogged(self, rank: int) -> bool:
        """Whether a message with tensors to ``rank`` has not left this process yet."""
        peer = self._peers.get(rank)
        return peer is not None and peer.backlogged

    def _lost_reason(self, rank: int) -> str:
        if rank in self._departed:
            return "peer_left"
        return "closed" if self._closed else "send_timeout"

    def _drop_held(self, peer: Peer, reason: str) -> None:
        if peer.held is not None:
            peer.held = None
            self.stats.drop(reason)

    def _reset_peer(self, peer: Peer) -> None:
        """Replace a peer's DEALER, discarding what is queued on it (frees its buffers)."""
        if self._peers.get(peer.rank) is not peer or self._closed:
            return
        self._drop_held(peer, "send_timeout")
        peer.close(0, "send_timeout")  # the stream too: headers queued in the DEALER are gone
        self._peers[peer.rank] = self._open_peer(peer.rank, peer.address)

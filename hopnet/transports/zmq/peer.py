"""One peer's connection and what is in flight to it: its DEALER (and express DEALER), its payload
stream, the counts of messages libzmq still holds, the held ``send_latest`` message, and the lane
numbers that order its ZeroMQ messages with its streamed ones, and the numbers of its messages
(:mod:`hopnet.transports.link_numbers`)."""

from __future__ import annotations

import asyncio
import secrets

import zmq
import zmq.asyncio

from hopnet.transports import payload_stream as ps
from hopnet.transports.zmq import limits
from hopnet.wire import Message


class Peer:
    """A connection to one peer, with the state of the sends to it."""

    __slots__ = ("address", "busy", "data", "endpoint", "epoch", "express", "express_raw", "gate", "held",
                 "numbered", "rank", "raw", "sending_held", "sock", "stage_waiters", "staged", "stream",
                 "stream_retry_at", "streaming", "xnumbered", "zero_copy", "zseq")

    def __init__(self, rank: int, address: str, sock: zmq.asyncio.Socket, streams: bool) -> None:
        self.rank = rank
        self.address = address
        self.endpoint, self.data = ps.split_address(address)  # data: the payload stream's (host, port)
        if not streams:
            self.data = None
        self.sock = sock
        # A plain socket sharing the same libzmq socket: non-blocking sends without Futures.
        self.raw: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        self.raw.copy_threshold = limits.COPY_THRESHOLD
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
        # The last message number given in this epoch, in the order of the sends (both channels:
        # ZeroMQ and the stream), and that of the express connection, counted on its own.
        self.numbered = 0
        self.xnumbered = 0

    def tagged(self, header: bytes) -> bytes:
        """The first frame of a ZeroMQ message: with its lane tag if the peer has a stream."""
        if self.data is None:
            return header
        self.zseq += 1
        stream = self.stream
        if stream is None:
            return ps.lane_tag(self.epoch, self.zseq, 0, 0) + header
        # After the stream was closed mid-way (send_timeout), its messages that never reached the kernel
        # will never come: wait only for those that did.
        return ps.lane_tag(self.epoch, self.zseq, stream.token, stream.written if stream.closed else stream.seq) + header

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

"""The :class:`ZmqTransport` class: its lifecycle (start, connect, close) and its peers coming and
going; sending and receiving are its parts (see :mod:`hopnet.transports.zmq`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import zmq
import zmq.asyncio

from hopnet.errors import HopnetError
from hopnet.security import HandshakeWatch, is_loopback, make_curve_server
from hopnet.transports import payload_stream as ps
from hopnet.transports.base import Receiver, event_hook
from hopnet.transports.zmq import limits
from hopnet.transports.zmq.addresses import check_address
from hopnet.transports.zmq.malloc import tune_malloc
from hopnet.transports.zmq.receiving import ZmqReceiving
from hopnet.transports.zmq.sending import ZmqSending

log = logging.getLogger(__name__)


class ZmqTransport(ZmqSending, ZmqReceiving):
    """Transport over ZeroMQ (tcp or ipc). See the module docstring of :mod:`hopnet.transports.zmq`
    for the design; the constructor's arguments are :class:`~hopnet.transports.zmq.state.ZmqState`'s."""

    heartbeats = True

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
        sock.setsockopt(zmq.RCVHWM, limits.RCVHWM)
        # ROUTER_HANDOVER: a peer's new connection takes over its routing id from the old one, which
        # may linger half-open: its process died (a replacement, --max-restarts), or its DEALER was
        # reset after send_timeout while the link was cut and the close never reached this host
        # (without handover, every later message of that peer was ignored, seen in
        # tests/test_large_transfer_cut.py). The cost: a confused member presenting another's
        # routing id cuts off the real one's pipe (which reconnects), rather than being ignored.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, limits.MAX_FRAME_BYTES)  # a peer sending more is disconnected
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
        self._record = event_hook(receiver)
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
            check_address(address, f"address of rank {rank}")
            old = self._peers.get(rank)
            if old is not None:
                if old.address == address:
                    continue
                old.close(limits.LINGER_MS)
            self._peers[rank] = self._open_peer(rank, address)

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
            peer.close(limits.LINGER_MS)
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
        self._record = None
        if self._own_context and self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            # term() waits for the lingering sockets (at most LINGER_MS): keep the loop free.
            await asyncio.get_running_loop().run_in_executor(None, ctx.term)

    def forget_peer(self, rank: int) -> None:
        """See :meth:`Transport.forget_peer`: later sends to ``rank`` count ``peer_left``."""
        peer = self._peers.pop(rank, None)
        self._departed.add(rank)
        if peer is not None:
            self._drop_held(peer, "peer_left")
            # A short linger, not none: the departed peer's process is exiting, and libzmq aborts the
            # whole process (an assertion in session_base.cpp's clean_pipes) when its connection drops
            # while a socket closed without linger cuts a message that is half on the wire. Within
            # the linger what is queued for the peer is dropped all the same, and the tensor memory
            # that zero-copy sends to it wait on released.
            peer.close(limits.LINGER_MS, "peer_left")

    def readmit_peer(self, rank: int, address: str | None) -> None:
        """See :meth:`Transport.readmit_peer`."""
        self._departed.discard(rank)
        if address is not None and not self._closed and self._ctx is not None:
            check_address(address, f"address of rank {rank}")
            old = self._peers.pop(rank, None)
            if old is not None:
                old.close(0)
            self._peers[rank] = self._open_peer(rank, address)

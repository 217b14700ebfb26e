"""The control channel of an elastic run: one ZeroMQ socket per worker that lives as long as
the process, across every view (the training transport is rebuilt at each view change).

It carries the membership's messages, the reports of a view change
(:mod:`hopnet.elastic.switch`) and a joiner's state. Every message names its sender's rank
and control address, so a member learns a joiner's address from its first message. Frames:
a msgpack header, then an optional payload (a joiner's state)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from hopnet.security import CurveKeys, make_curve_client, make_curve_server

log = logging.getLogger(__name__)

Handler = Callable[[int, dict[str, Any], bytes | None], None]
"""Called on the event loop with the sender's rank, the header and the payload, if any."""

_MAX_FRAME = 1 << 34  # a joiner's state is one frame: the model and optimizer, however large


class ControlChannel:
    """A ROUTER this worker receives on, and a DEALER to each rank it sends to."""

    def __init__(self, rank: int, bind_host: str, curve: CurveKeys | None = None) -> None:
        self.rank = rank
        self._bind_host = bind_host
        self._curve = curve
        self._ctx = zmq.asyncio.Context()
        self._router: zmq.asyncio.Socket | None = None
        self._dealers: dict[int, tuple[str, zmq.asyncio.Socket]] = {}
        self.addresses: dict[int, str] = {}
        """Every rank's control address this worker knows (from the rendezvous, or from a message)."""
        self.address = ""
        self._reader: asyncio.Task[None] | None = None
        self._handler: Handler | None = None

    def open(self) -> str:
        """Bind; returns the address others send to."""
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME)
        if self._curve is not None:
            make_curve_server(sock, self._curve)
        sock.bind(f"tcp://{self._bind_host}:0")
        self._router = sock
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.address

    def serve(self, handler: Handler) -> None:
        """Start handing each arriving message to ``handler`` (on the running loop)."""
        self._handler = handler
        self._reader = asyncio.get_running_loop().create_task(self._read(), name=f"rank{self.rank}-control")

    def learn(self, addresses: Mapping[int, str]) -> None:
        for rank, address in addresses.items():
            if rank != self.rank and address:
                self.addresses[int(rank)] = address

    async def _read(self) -> None:
        assert self._router is not None and self._handler is not None
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) < 2:
                continue
            try:
                header = msgpack.unpackb(frames[1])
                sender = int(header["f"])
                address = header.get("a")
            except Exception:  # noqa: BLE001 - a malformed message is dropped, never fatal
                log.warning("rank %d: dropped a malformed control message", self.rank)
                continue
            if isinstance(address, str) and address and sender != self.rank:
                self.addresses[sender] = address
            payload = frames[2] if len(frames) > 2 else None
            try:
                self._handler(sender, header, payload)
            except Exception:  # noqa: BLE001 - one bad message must not stop the channel
                log.exception("rank %d: control message from rank %d", self.rank, sender)

    def send(self, to: int, header: dict[str, Any], payload: bytes | memoryview | None = None) -> bool:
        """Send to rank ``to``; False when its address is unknown (nothing is sent)."""
        address = self.addresses.get(to)
        if address is None:
            return False
        held = self._dealers.get(to)
        if held is None or held[0] != address:
            if held is not None:
                held[1].close(0)
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.setsockopt(zmq.SNDHWM, 10_000)
            sock.setsockopt(zmq.IMMEDIATE, 0)
            if self._curve is not None:
                make_curve_client(sock, self._curve)
            sock.connect(address)
            held = (address, sock)
            self._dealers[to] = held
        frames: list[Any] = [msgpack.packb({**header, "f": self.rank, "a": self.address})]
        if payload is not None:
            frames.append(payload)
        try:
            held[1].send_multipart(frames, flags=zmq.NOBLOCK, copy=payload is None)
        except zmq.Again:
            log.warning("rank %d: control message to rank %d dropped (its queue is full)", self.rank, to)
            return False
        return True

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        await asyncio.sleep(0.05)  # let the last messages leave (their sockets linger)
        for _, sock in self._dealers.values():
            sock.close(500)
        if self._router is not None:
            self._router.close(0)
        self._ctx.term()

"""The coordinator as a ZeroMQ service: one ROUTER socket, one state machine, one thread.

:func:`serve` runs until told to stop (SIGTERM in the process `hopnet launch` starts,
see :mod:`hopnet.bootstrap.coordinator_main`). Each inbound ``[routing id, payload]`` is decoded
(:mod:`hopnet.coordinator.wire`), handed to the :class:`~hopnet.coordinator.host.CoordinatorHost`
and what it returns is sent at once. A frame that is not a coordinator message is dropped
and counted, never fatal. A message for a worker whose connection the ROUTER does not
know yet waits in a backlog until it shows up (a group can name a worker that has not
said ``hello`` yet), in the order it was sent.

With the run's CurveZMQ key (``curve=``, see :mod:`hopnet.security`) only holders of the
key can connect; refused connection attempts are counted in the summary
(``refused_handshakes``).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import defaultdict, deque
from pathlib import Path
from typing import Any

import zmq

from hopnet.coordinator.base import Coordinator, Send
from hopnet.coordinator.host import CoordinatorHost
from hopnet.coordinator.wire import HELLO, MAX_MESSAGE_BYTES, BadFrame, decode, encode, rank_of, routing_id
from hopnet.runtime.events import JsonlEventLog
from hopnet.security import CurveKeys, secure_server

LOG_NAME = "coordinator.jsonl"
POLL_S = 0.2
"""Longest the loop sleeps without looking at the time (liveness checks, the stop flag)."""


class CoordinatorServer:
    """A bound ROUTER serving one :class:`Coordinator`; :meth:`run` until :meth:`stop`."""

    def __init__(self, machine: Coordinator, *, bind_host: str = "127.0.0.1", port: int = 0,
                 peer_timeout_s: float | None = None, run_dir: str | Path | None = None,
                 curve: CurveKeys | None = None, restarts: bool = False) -> None:
        """``restarts``: workers may be replaced by new processes (``--max-restarts``): a replacement's
        connection takes over its rank's routing id, and its ``hello`` brings the rank back."""
        self.machine = machine
        self._t0 = time.monotonic()
        self.events = JsonlEventLog(Path(run_dir) / LOG_NAME) if run_dir is not None else None
        self.host = CoordinatorHost(machine, now=self._t0, peer_timeout_s=peer_timeout_s, record=self._record)
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to an unknown worker raises: keep it for later
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + 64)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1 if restarts else 0)
        self._handshakes = secure_server(sock, curve)
        try:
            sock.bind(f"tcp://{bind_host}:{port or '*'}")
        except zmq.ZMQError as exc:
            if self._handshakes is not None:
                self._handshakes.close()
            sock.close(0)
            self._ctx.term()
            raise OSError(f"the coordinator cannot bind tcp://{bind_host}:{port or '*'}: {exc}") from None
        self.sock = sock
        self.address: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._backlog: dict[int, deque[bytes]] = defaultdict(deque)
        self._stop = threading.Event()
        self.bad_frames = 0
        self._record("start", coordinator=machine.name, address=self.address, world_size=machine.world_size,
                     pid=os.getpid(),
                     peer_timeout_s=peer_timeout_s)

    # ------------------------------------------------------------------ running
    def stop(self) -> None:
        """Ask :meth:`run` to return (thread- and signal-safe)."""
        self._stop.set()

    def run(self) -> dict[str, Any]:
        """Serve until :meth:`stop`; write the ``stop`` record and return the summary."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        if self._handshakes is not None:
            poller.register(self._handshakes.socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                wait_s = min(POLL_S, max(0.0, self.host.next_check(now) - now))
                try:
                    ready = dict(poller.poll(int(wait_s * 1000)))
                except zmq.ZMQError as exc:
                    if exc.errno == errno.EINTR:
                        continue
                    raise
                if self._handshakes is not None:
                    self._handshakes.poll()
                if ready:
                    self._drain()
                self._send(self.host.check(time.monotonic()))
                if self.events is not None:
                    self.events.flush()
        finally:
            summary = self.summary()
            self._record("stop", **summary)
            self.close()
        return summary

    def _drain(self) -> None:
        for _ in range(1024):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_frames(frames)

    def _on_frames(self, frames: list[bytes]) -> None:
        try:
            if len(frames) != 2:
                raise BadFrame(f"{len(frames)} frames")
            sender = rank_of(frames[0], self.machine.world_size)
            message = decode(frames[1])
        except BadFrame:
            self.bad_frames += 1
            self.host.drop("bad_frame")
            return
        if message.get("t") == HELLO and message.get("restart"):
            self._backlog.pop(sender, None)  # meant for the process this one replaces
        backlog = self._backlog.get(sender)
        if backlog:
            self._flush(sender)  # it is connected now: what waited for it goes first
        self._send(self.host.handle(sender, message, time.monotonic()))

    def _send(self, sends: list[Send]) -> None:
        for send in sends:
            self._backlog[send.to].append(encode(send.message))
            self._flush(send.to)

    def _flush(self, rank: int) -> None:
        queue = self._backlog[rank]
        identity = routing_id(rank)
        while queue:
            try:
                self.sock.send_multipart([identity, queue[0]], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                    return  # not connected yet (or its queue is full): sent when it next speaks
                raise
            queue.popleft()

    # ------------------------------------------------------------------ records
    def _record(self, event: str, **fields: Any) -> None:
        if self.events is None:
            return
        now = time.monotonic()
        self.events.write({"event": event, "rank": None, "role": "coordinator",
                           "t": round(now - self._t0, 6), "mono": now, **fields})
        if event in ("worker_dead", "stop", "start"):
            self.events.flush()

    def summary(self) -> dict[str, Any]:
        summary = self.host.summary()
        summary["backlogged"] = sum(len(q) for q in self._backlog.values())
        if self._handshakes is not None:
            self._handshakes.poll()
            summary["refused_handshakes"] = self._handshakes.refused
        return summary

    def close(self) -> None:
        if not self.sock.closed:
            if self._handshakes is not None:
                self._handshakes.close()
            self.sock.close(0)
            self._ctx.term()
        if self.events is not None:
            self.events.close()


ADDRESS_PREFIX = "HOPNET_COORDINATOR="
"""The first line the coordinator process prints: its address, for the launcher."""

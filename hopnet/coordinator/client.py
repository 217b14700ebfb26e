"""The worker's side of the coordinator: :class:`CoordinatorClient`, ``node.coordinator``.

A protocol calls :meth:`CoordinatorClient.send` (never blocks) and awaits
:meth:`CoordinatorClient.receive` (the next message for this worker, in the order the
coordinator sent them). The client hides how messages travel: a :class:`CoordinatorLink`
moves them, over ZeroMQ under ``hopnet launch`` (:class:`ZmqLink`, a DEALER to the
coordinator's ROUTER) or in process on the simulator's virtual loop
(:class:`hopnet.coordinator.sim.SimLink`).

What the client handles itself (see :mod:`hopnet.coordinator.wire`): it says ``hello``
first; ``pong`` answers are only signs of life; ``peer_dead`` notices are passed to the
node (``node.peer_dead``), so a collective waiting on a dead worker fails at once, naming
it; ``peer_failed`` notices (a worker that left failing) fail such waits too. Every other message, ``bye_ok`` included, is returned by :meth:`receive`.

A dead coordinator: on a link whose far end can die (ZeroMQ), the client sends a ``beat``
when nothing else went out for a beat interval, and while :meth:`receive` waits it
``ping``s a coordinator that has been silent for one. One silent for ``peer_timeout_s``
while a receive waits fails that receive with :class:`CoordinatorLost`, naming the
coordinator and its address. A wait that gets other messages but not the one wanted
still ends, with :class:`~hopnet.errors.WaitTimeout`, after ``--timeout``.
"""

from __future__ import annotations

import abc
import asyncio
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from hopnet.coordinator.variables import COORDINATOR_ENV, COORDINATOR_NAME_ENV
from hopnet.coordinator.wire import (BEAT, EXPELLED, HELLO, PEER_DEAD, PEER_FAILED, PING, PONG, BadFrame, decode,
                                     encode, routing_id)
from hopnet.errors import HopnetError, PeerFailure, WaitTimeout
from hopnet.runtime.liveness import beat_interval_for
from hopnet.runtime.services import NodeServices

if TYPE_CHECKING:
    from hopnet.security import CurveKeys



class CoordinatorLost(PeerFailure):
    """The coordinator stopped answering (its process died or hangs) while a worker waited on it."""

    def __init__(self, message: str, *, iteration: int | None = None) -> None:
        super().__init__(message, peer=None, peer_state="dead", iteration=iteration)


Deliver = Callable[[dict[str, Any]], None]


class CoordinatorLink(abc.ABC):
    """Moves decoded messages between one worker and the coordinator, in order."""

    can_die: bool = False
    """Whether the coordinator at the far end can die unannounced (watch it with pings)."""
    address: str = "in-process"

    @abc.abstractmethod
    def start(self, deliver: Deliver) -> None:
        """Begin receiving; ``deliver`` is called on the event loop with each message, in order."""

    @abc.abstractmethod
    def send(self, message: Mapping[str, Any]) -> None:
        """Queue ``message`` for the coordinator; never blocks."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop receiving and release the socket. Idempotent."""


class CoordinatorClient:
    """One worker's handle on the run's coordinator (``node.coordinator``)."""

    def __init__(self, link: CoordinatorLink, *, name: str = "coordinator",
                 peer_timeout_s: float | None = None) -> None:
        self.link = link
        self.name = name
        self.peer_timeout_s = peer_timeout_s if link.can_die else None
        self.node: NodeServices | None = None
        self.rank = -1
        self.received = 0
        self.sent = 0
        self.pings = 0
        self._inbox: deque[dict[str, Any]] = deque()
        self._waiter: asyncio.Future[dict[str, Any]] | None = None
        self._wait_began = 0.0
        self._last_heard = 0.0
        self._last_sent = 0.0
        self._lost: HopnetError | None = None  # every receive raises it (CoordinatorLost, or expelled)
        self._watch: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def label(self) -> str:
        """``the coordinator (NAME) at ADDRESS``: how errors name it."""
        return f"the coordinator ({self.name}) at {self.link.address}"

    # ------------------------------------------------------------------ lifecycle (the Node calls these)
    def bind(self, node: NodeServices) -> None:
        self.node = node
        self.rank = node.rank

    async def start(self) -> None:
        now = self._now()
        self._last_heard = self._last_sent = now
        self.link.start(self._deliver)
        restart = self.node.restart if self.node is not None else 0
        self.send({"t": HELLO, "restart": restart} if restart else {"t": HELLO})
        if self.peer_timeout_s is not None:
            self._watch = asyncio.get_running_loop().create_task(self._watch_coordinator())

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        task, self._watch = self._watch, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        self.link.close()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(HopnetError(f"rank {self.rank}: the coordinator client was closed"))

    # ------------------------------------------------------------------ what protocols call
    def send(self, message: Mapping[str, Any]) -> None:
        """Send ``message`` (a small dict with a ``"t"`` kind) to the coordinator; never blocks."""
        if self._closed:
            return
        self.sent += 1
        self._last_sent = self._now()
        self.link.send(message)

    async def receive(self, what: str) -> dict[str, Any]:
        """The next message for this worker. ``what`` names the wait in errors (``"the GO of
        this worker's group for iteration 7"``)."""
        if self._inbox:
            return self._inbox.popleft()
        if self._lost is not None:
            raise self._lost
        if self._closed:
            raise HopnetError(f"rank {self.rank}: receive() on a closed coordinator client")
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._waiter, self._wait_began, self._what = waiter, self._now(), what
        iteration = self._iteration()
        node = self.node
        try:
            if node is None:
                return await waiter
            return await node.clock.wait(waiter, f"{what} from {self.label}", iteration=iteration)
        finally:
            if self._waiter is waiter:
                self._waiter = None

    # ------------------------------------------------------------------ inbound
    def _deliver(self, message: dict[str, Any]) -> None:
        self._last_heard = self._now()
        self.received += 1
        kind = message.get("t")
        if kind == PONG:
            return
        if kind in (PEER_DEAD, PEER_FAILED) and self._stale_notice(message):
            return
        if kind == PEER_DEAD:
            rank, silent_s = message.get("rank"), message.get("silent_s")
            if (isinstance(rank, int) and rank != self.rank and self.node is not None
                    and 0 <= rank < self.node.graph.n):
                self.node.peer_dead(rank, float(silent_s) if isinstance(silent_s, (int, float)) else 0.0)
            return
        if kind == EXPELLED:
            given = message.get("why")
            why = given if isinstance(given, str) else ""
            self.fail(HopnetError(f"rank {self.rank}: {self.label} no longer counts this worker in: "
                                   f"{why[:200] or 'declared dead'} (was it blocked for --peer-timeout "
                                   f"{self.peer_timeout_s}s?)"))
            return
        if kind == PEER_FAILED:
            rank = message.get("rank")
            node = self.node
            if isinstance(rank, int) and rank != self.rank and node is not None and 0 <= rank < node.graph.n \
                    and rank not in node.departed and rank not in node.dead:
                node.record("peer_failed", peer=rank, iter=node.iteration)
                node.mailbox.peer_departed(rank, "failed (it told the coordinator so)", "departed")
            return
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            self._waiter = None
            waiter.set_result(message)
        else:
            self._inbox.append(message)

    def _stale_notice(self, message: Mapping[str, Any]) -> bool:
        """A notice about a process of a rank that this worker already saw replaced."""
        rank, restart = message.get("rank"), message.get("restart", 0)
        node = self.node
        return (node is not None and isinstance(rank, int) and isinstance(restart, int)
                and node.restarts_seen.get(rank, 0) > restart)

    # ------------------------------------------------------------------ the watch
    async def _watch_coordinator(self) -> None:
        assert self.peer_timeout_s is not None
        timeout_s = self.peer_timeout_s
        interval = beat_interval_for(timeout_s)
        while not self._closed:
            await asyncio.sleep(interval)
            now = self._now()
            waiting = self._waiter is not None and not self._waiter.done()
            if waiting and now - self._last_heard >= interval:
                self.pings += 1
                self.send({"t": PING})
            elif now - self._last_sent >= interval:
                self.send({"t": BEAT})
            silent_s = now - max(self._last_heard, self._wait_began)
            if waiting and silent_s >= timeout_s:
                self._declare_lost(now - self._last_heard)

    def _declare_lost(self, silent_s: float) -> None:
        iteration = self._iteration()
        at = f" in iteration {iteration}" if iteration is not None else ""
        self._lost = CoordinatorLost(
            f"{self.label} stopped answering: rank {self.rank} heard nothing from it for {silent_s:.1f}s "
            f"(--peer-timeout {self.peer_timeout_s:g}s) while waiting for {self._what}{at}",
            iteration=iteration)
        if self.node is not None:
            self.node.record("coordinator_lost", address=self.link.address, silent_s=round(silent_s, 3),
                             iter=iteration)
            self.node.events.flush()
        self.fail(self._lost)

    def fail(self, error: HopnetError) -> None:
        """Every receive from now on raises ``error`` (the one waiting now included)."""
        if self._lost is None or isinstance(error, CoordinatorLost):
            self._lost = error
        self._inbox.clear()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            self._waiter = None
            waiter.set_exception(error)

    # ------------------------------------------------------------------ helpers
    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _iteration(self) -> int | None:
        node = self.node
        return node.iteration if node is not None else None

    def summary(self) -> dict[str, Any]:
        return {"coordinator_sent": self.sent, "coordinator_received": self.received}


class ZmqLink(CoordinatorLink):
    """A DEALER connected to the coordinator's ROUTER, read from the event loop's reader callback."""

    can_die = True

    def __init__(self, address: str, rank: int, curve: CurveKeys | None = None) -> None:
        self.address = address
        self.rank = rank
        self.curve = curve
        self._sock: Any = None
        self._ctx: Any = None
        self._fd: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deliver: Deliver | None = None
        self._outbox: deque[bytes] = deque()
        self.dropped = 0

    def start(self, deliver: Deliver) -> None:
        import zmq

        self._loop = asyncio.get_running_loop()
        self._deliver = deliver
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, routing_id(self.rank))
        sock.setsockopt(zmq.MAXMSGSIZE, 1 << 16)
        from hopnet.security import secure_client

        secure_client(sock, self.curve)  # the run's CurveZMQ key, when the launcher secured the run
        try:
            sock.connect(self.address)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise HopnetError(f"rank {self.rank}: cannot connect to the coordinator at {self.address}: {exc}") from None
        self._sock = sock
        self._fd = sock.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._on_readable)
        self._loop.call_soon(self._on_readable)  # edge-triggered: look once now

    def send(self, message: Mapping[str, Any]) -> None:
        self._outbox.append(encode(message))
        self._flush()

    def _flush(self) -> None:
        import zmq

        sock, loop = self._sock, self._loop
        if sock is None or loop is None:
            return
        while self._outbox:
            try:
                sock.send(self._outbox[0], zmq.NOBLOCK)
            except zmq.Again:
                loop.call_later(0.01, self._flush)
                return
            except zmq.ZMQError:
                return
            self._outbox.popleft()
        loop.call_soon(self._on_readable)  # a send may consume the FD's edge

    def _on_readable(self) -> None:
        import zmq

        sock = self._sock
        if sock is None or self._deliver is None:
            return
        try:
            for _ in range(256):
                if not sock.get(zmq.EVENTS) & zmq.POLLIN:
                    return
                try:
                    payload = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                try:
                    message = decode(payload)
                except BadFrame:
                    self.dropped += 1
                    continue
                self._deliver(message)
        except zmq.ZMQError:
            return
        if self._sock is sock and self._loop is not None:
            self._loop.call_soon(self._on_readable)

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        if self._loop is not None and self._fd is not None:
            try:
                self._loop.remove_reader(self._fd)
            except (ValueError, OSError, RuntimeError):
                pass
        sock.close(0)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None


def client_from_environ(rank: int, peer_timeout_s: float, environ: Mapping[str, str] | None = None
                        ) -> CoordinatorClient | None:
    """The client for the coordinator `hopnet launch` started (``None`` when it started none)."""
    import os

    environ = os.environ if environ is None else environ
    address = environ.get(COORDINATOR_ENV, "").strip()
    if not address:
        return None
    if not address.startswith(("tcp://", "ipc://")):
        from hopnet.errors import ConfigError
        raise ConfigError(f"{COORDINATOR_ENV}={address!r} is not a ZeroMQ endpoint (expected tcp://HOST:PORT)")
    name = environ.get(COORDINATOR_NAME_ENV, "").strip() or "coordinator"
    from hopnet.security import keys_from_environ

    link = ZmqLink(address, rank, curve=keys_from_environ(environ))
    return CoordinatorClient(link, name=name, peer_timeout_s=peer_timeout_s)


__all__ = ["COORDINATOR_ENV", "CoordinatorClient", "CoordinatorLink", "CoordinatorLost", "WaitTimeout",
           "ZmqLink", "client_from_environ"]

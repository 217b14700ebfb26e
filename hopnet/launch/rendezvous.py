"""Rendezvous: workers find each other's addresses, and meet at barriers.

The launcher runs a :class:`RendezvousServer` (a ZeroMQ ROUTER socket served by a
thread) and passes its endpoint to every worker in ``HOPNET_RENDEZVOUS``. Each worker
binds its own transport first, then calls :func:`exchange_addresses` with the address
its peers should connect to; the call returns once *every* rank has registered, with
the full table ``{rank: address}`` (the same on every rank).

The same server implements named barriers (:func:`barrier`): the call returns once all
ranks have entered the barrier with that name. Workers use one at shutdown, so that no
worker closes its sockets while a neighbour still needs its last updates.

Wire format: one msgpack map per request and per reply (a request that is a JSON object
gets a JSON reply, for clients in other languages). Requests::

    {"rank": R, "address": "tcp://...", "world_size": N,
     "config": {...}, "restart": N}                          -> {"addresses": {R: address, ...}}
    {"rank": R, "barrier": "name"}                          -> {"barrier": "name"}
    {"status": true}                                        -> {"status": {...}}

and any request may be answered ``{"error": "one line"}`` (rank out of range, a rank
registered twice with different addresses, a world size that disagrees, ...).

``restart`` (optional, an integer >= 1) marks the registration of a replacement worker
(``HOPNET_RESTART``, see :mod:`hopnet.launch.restarts`): once the table is complete, it
replaces the rank's address and is answered at once with the whole table (without it, a
second address for a rank is refused as a rank registered twice). Before the table is
complete it is an ordinary registration.

``config`` (optional) is the protocol configuration the rank will run. Every rank must
run the same one: the first rank that registers a different one fails the whole
rendezvous, and every rank, waiting or still to come, gets the same error naming the
two ranks and the option they disagree on. :attr:`RendezvousServer.config` is the
agreed configuration once the exchange is complete.

With the run's CURVE keys (``curve=`` on the server and on every client call, see
:mod:`hopnet.security`) the server admits only holders of the run key: a process
without it never completes the handshake, so its requests are neither read nor
answered (they time out on its side), and the refused attempts are counted in
:attr:`RendezvousServer.refused_handshakes`.

Every wait takes a timeout and raises :class:`~hopnet.errors.WaitTimeout` naming the
rendezvous and, when the server can still tell, the ranks that never showed up.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Mapping
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from hopnet.errors import ConfigError, HopnetError, WaitTimeout
from hopnet.security import CurveKeys, HandshakeWatch, make_curve_client, make_curve_server

__all__ = [
    "RendezvousConfigError",
    "RendezvousError",
    "RendezvousServer",
    "barrier",
    "barrier_async",
    "exchange_addresses",
    "exchange_addresses_async",
    "rendezvous_status",
]

_STATUS_TIMEOUT_S = 0.5
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "")


class RendezvousError(HopnetError):
    """The rendezvous server refused a request (the message says why)."""


class RendezvousConfigError(RendezvousError, ConfigError):
    """The rendezvous refused the ranks' configuration (ranks that run different protocol
    options): a configuration error, which every rank meets (exit status 2)."""


# ----------------------------------------------------------------------------- encoding
def _encode(obj: Mapping[str, Any], as_json: bool = False) -> bytes:
    if as_json:
        return json.dumps(obj, sort_keys=True).encode("utf-8")
    return msgpack.packb(obj, use_bin_type=True)


def _decode(data: bytes) -> tuple[Any, bool]:
    """Decode a request or reply; returns (object, was_json)."""
    if data[:1] == b"{":
        return json.loads(data.decode("utf-8")), True
    return msgpack.unpackb(data, raw=False, strict_map_key=False), False


def _ranks_text(ranks: list[int]) -> str:
    if not ranks:
        return "none"
    if len(ranks) > 16:
        return ", ".join(str(r) for r in ranks[:16]) + f", ... ({len(ranks)} in all)"
    return ", ".join(str(r) for r in ranks)


# ------------------------------------------------------------------------------- server
class RendezvousServer:
    """Collects every rank's address and answers all of them at once; runs barriers.

    ``RendezvousServer(world_size).start()`` binds a ROUTER socket on ``host`` with a port
    the OS picks; :attr:`endpoint` is what workers connect to. :meth:`close` stops the
    serving thread. Usable as a context manager.
    """

    def __init__(self, world_size: int, host: str = "127.0.0.1", port: int | None = None,
                 advertise_host: str | None = None, curve: CurveKeys | None = None) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"rendezvous world size must be an integer >= 1 (got {world_size!r})")
        self.world_size = world_size
        self.host = host
        self.port = port
        self.advertise_host = advertise_host
        self.curve = curve
        self._handshakes: HandshakeWatch | None = None
        self._endpoint: str | None = None
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        # address exchange: rank -> address, and the requests waiting for the full table
        self._addresses: dict[int, str] = {}
        self._waiting: dict[int, tuple[bytes, bool]] = {}
        self.complete = threading.Event()
        """Set once every rank has registered its address."""
        self.completed_at: float | None = None
        """When :attr:`complete` was set (``time.monotonic()``)."""
        # barriers: name -> {rank: (identity, as_json)}
        self._barriers: dict[str, dict[int, tuple[bytes, bool]]] = {}
        self._barriers_done: list[str] = []
        self.config: dict[str, Any] | None = None
        """The protocol configuration every rank registered (set with :attr:`complete`)."""
        self._config_rank: int | None = None
        self._config_error: str | None = None
        self.errors: list[str] = []
        """One line per refused request, for the launcher's log."""
        self.bad_requests = 0
        """Requests that could not be handled at all (a bug or a malformed request)."""

    # -- lifecycle
    @property
    def endpoint(self) -> str:
        if self._endpoint is None:
            raise RuntimeError("RendezvousServer.endpoint is known only after start()")
        return self._endpoint

    def start(self) -> RendezvousServer:
        if self._thread is not None:
            return self
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 500)
        bind_host = "*" if self.host in _WILDCARD_HOSTS else self.host
        port = "*" if not self.port else str(self.port)
        if self.curve is not None:
            make_curve_server(sock, self.curve)
            self._handshakes = HandshakeWatch(sock)
        try:
            sock.bind(f"tcp://{bind_host}:{port}")
        except zmq.ZMQError as exc:
            if self._handshakes is not None:
                self._handshakes.close()
            sock.close(0)
            self._ctx.term()
            raise ConfigError(f"rendezvous: cannot bind tcp://{bind_host}:{port}: {exc}") from None
        last = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        bound_port = int(last.rsplit(":", 1)[1])
        host = self.advertise_host or ("127.0.0.1" if self.host in _WILDCARD_HOSTS else self.host)
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        self._endpoint = f"tcp://{host}:{bound_port}"
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="hopnet-rendezvous", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        # the serving thread closes the socket on its way out
        if self._ctx is not None:
            if self._sock is not None and not self._sock.closed:
                self._sock.close(0)
            self._ctx.term()
            self._ctx = None

    def __enter__(self) -> RendezvousServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def refused_handshakes(self) -> int:
        """Connection attempts refused at the CURVE handshake (clients without the run key)."""
        return self._handshakes.refused if self._handshakes is not None else 0

    # -- introspection (thread-safe)
    @property
    def addresses(self) -> dict[int, str]:
        with self._lock:
            return dict(self._addresses)

    def registered_ranks(self) -> list[int]:
        with self._lock:
            return sorted(self._addresses)

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "world_size": self.world_size,
                "registered": sorted(self._addresses),
                "missing": [r for r in range(self.world_size) if r not in self._addresses],
                "complete": self.complete.is_set(),
                "barriers": {name: sorted(ranks) for name, ranks in self._barriers.items()},
                "barriers_done": list(self._barriers_done),
            }

    # -- serving
    def _serve(self) -> None:
        sock = self._sock
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        watch = self._handshakes
        if watch is not None:
            poller.register(watch.socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                if watch is not None:
                    watch.poll()
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self._handle(sock, frames)
                    except zmq.ZMQError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - one bad request must not stop the rendezvous
                        self.bad_requests += 1
                        self.errors.append(f"rendezvous: could not handle a request ({type(exc).__name__})")
        except zmq.ZMQError:
            if not self._stop.is_set():
                raise
        finally:
            if watch is not None:
                watch.poll()
                watch.close()
            sock.close()

    @staticmethod
    def _reply(sock: zmq.Socket, identity: bytes, obj: Mapping[str, Any], as_json: bool) -> None:
        sock.send_multipart([identity, b"", _encode(obj, as_json)])

    def _refuse(self, sock: zmq.Socket, identity: bytes, message: str, as_json: bool, config: bool = False) -> None:
        """Answer with ``message``; ``config``: the configuration is refused (a :class:`RendezvousConfigError`)."""
        self.errors.append(message)
        self._reply(sock, identity, {"error": message, "config_error": True} if config else {"error": message},
                    as_json)

    def _handle(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        # A REQ client sends [identity, b"", payload]; a DEALER may omit the delimiter.
        if len(frames) < 2:
            return
        identity, payload = frames[0], frames[-1]
        try:
            msg, as_json = _decode(payload)
        except Exception:
            self._refuse(sock, identity, "rendezvous: undecodable request (expected msgpack or JSON)", False)
            return
        if not isinstance(msg, dict):
            self._refuse(sock, identity, "rendezvous: request must be a map", as_json)
            return
        if msg.get("status"):
            self._reply(sock, identity, {"status": self.status()}, as_json)
            return
        rank = msg.get("rank")
        if not isinstance(rank, int) or isinstance(rank, bool):
            self._refuse(sock, identity, f"rendezvous: rank must be an integer (got {rank!r})", as_json)
            return
        if not 0 <= rank < self.world_size:
            self._refuse(sock, identity, f"rendezvous: rank {rank} out of range "
                                         f"(world size {self.world_size})", as_json)
            return
        world_size = msg.get("world_size")
        if world_size is not None and world_size != self.world_size:
            self._refuse(sock, identity, f"rendezvous: rank {rank} says the world size is {world_size}, "
                                         f"the rendezvous expects {self.world_size}", as_json)
            return
        if "address" in msg:
            if not self._check_config(sock, identity, rank, msg.get("config"), as_json):
                return
            restart = msg.get("restart", 0)
            if not isinstance(restart, int) or isinstance(restart, bool) or restart < 0:
                self._refuse(sock, identity, f"rendezvous: rank {rank} sent a bad restart number {restart!r}",
                             as_json)
                return
            self._register(sock, identity, rank, msg["address"], as_json, restart=restart)
        elif "barrier" in msg:
            self._enter_barrier(sock, identity, rank, msg["barrier"], as_json)
        else:
            self._refuse(sock, identity, "rendezvous: request has neither 'address' nor 'barrier'", as_json)

    def _check_config(self, sock: zmq.Socket, identity: bytes, rank: int, config: Any, as_json: bool) -> bool:
        """Keep the first configuration; a different one fails every rank of the rendezvous."""
        with self._lock:
            if self._config_error is None and config is not None:
                if not isinstance(config, dict):
                    self._config_error = f"rendezvous: rank {rank} sent a malformed protocol configuration"
                elif self.config is None:
                    self.config, self._config_rank = dict(config), rank
                elif config != self.config:
                    self._config_error = _config_mismatch(self._config_rank, self.config, rank, config)
            message = self._config_error
            waiting = self._waiting if message is not None else {}
            if message is not None:
                self._waiting = {}
        if message is None:
            return True
        for ident, js in [*waiting.values(), (identity, as_json)]:
            self._refuse(sock, ident, message, js, config=True)
        return False

    def _register(self, sock: zmq.Socket, identity: bytes, rank: int, address: Any, as_json: bool,
                  restart: int = 0) -> None:
        if not isinstance(address, str) or not address:
            self._refuse(sock, identity, f"rendezvous: rank {rank} sent a bad address {address!r}", as_json)
            return
        table: dict[int, str] | None
        waiting: dict[int, tuple[bytes, bool]]
        with self._lock:
            known = self._addresses.get(rank)
            rejoin = restart > 0 and self.complete.is_set()
            if rejoin:
                # a replacement of a dead worker: its address is the rank's from now on
                message = None
                self._addresses[rank] = address
                table = dict(self._addresses)
                waiting = {rank: (identity, as_json)}
            elif known is not None and known != address:
                message = (f"rendezvous: rank {rank} registered twice ({known} and {address}); "
                           "are two workers using the same HOPNET_RANK?")
            else:
                message = None
                self._addresses[rank] = address  # same address again: a retry, answer the new request
                self._waiting[rank] = (identity, as_json)
                full = len(self._addresses) == self.world_size
                table = dict(self._addresses) if full else None
                waiting = self._waiting if full else {}
                if full:
                    self._waiting = {}
                    if not self.complete.is_set():
                        self.completed_at = time.monotonic()
                    self.complete.set()
        if message is not None:
            self._refuse(sock, identity, message, as_json)
            return
        if table is not None:
            for _, (ident, js) in sorted(waiting.items()):
                reply_table: dict[Any, str] = {str(r): a for r, a in table.items()} if js else table
                self._reply(sock, ident, {"addresses": reply_table}, js)

    def _enter_barrier(self, sock: zmq.Socket, identity: bytes, rank: int, name: Any, as_json: bool) -> None:
        if not isinstance(name, str) or not name:
            self._refuse(sock, identity, f"rendezvous: rank {rank} sent a bad barrier name {name!r}", as_json)
            return
        with self._lock:
            entered = self._barriers.setdefault(name, {})
            entered[rank] = (identity, as_json)  # a rank entering again is a retry
            if len(entered) < self.world_size:
                return
            del self._barriers[name]
            self._barriers_done.append(name)
        for _, (ident, js) in sorted(entered.items()):
            self._reply(sock, ident, {"barrier": name}, js)


def _config_mismatch(rank_a: int | None, a: Mapping[str, Any], rank_b: int, b: Mapping[str, Any]) -> str:
    names = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    shown = "; ".join(f"{k}={a.get(k)!r} on rank {rank_a}, {k}={b.get(k)!r} on rank {rank_b}" for k in names[:3])
    return f"ranks {rank_a} and {rank_b} run different protocol options: {shown}"


# ------------------------------------------------------------------------------- client
def _check_endpoint(endpoint: str) -> None:
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise ConfigError(f"rendezvous endpoint {endpoint!r} is not a ZeroMQ endpoint (expected tcp://HOST:PORT)")


def _check_timeout(timeout_s: float) -> float:
    if timeout_s is None or not timeout_s > 0:
        raise ConfigError(f"rendezvous timeout must be > 0 (got {timeout_s!r})")
    return float(timeout_s)


def _connect(sock: zmq.Socket, endpoint: str, curve: CurveKeys | None = None) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        make_curve_client(sock, curve)
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        sock.close(0)
        raise ConfigError(f"rendezvous endpoint {endpoint!r}: {exc}") from None


def _unpack_reply(data: bytes, endpoint: str) -> dict[str, Any]:
    try:
        reply, _ = _decode(data)
    except Exception:
        raise RendezvousError(f"rendezvous at {endpoint}: undecodable reply") from None
    if not isinstance(reply, dict):
        raise RendezvousError(f"rendezvous at {endpoint}: malformed reply")
    if "error" in reply:
        raise (RendezvousConfigError if reply.get("config_error") else RendezvousError)(str(reply["error"]))
    return reply


def _poll_ms(deadline: float) -> int:
    """Milliseconds to poll until ``deadline`` (rounded up: never return before it)."""
    return max(1, math.ceil((deadline - time.monotonic()) * 1000))


def _request_sync(endpoint: str, request: Mapping[str, Any], timeout_s: float,
                  curve: CurveKeys | None = None) -> dict[str, Any] | None:
    """Send one request; the reply, or ``None`` after ``timeout_s``."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    _connect(sock, endpoint, curve)
    deadline = time.monotonic() + timeout_s
    try:
        # A REQ socket holds a send until a connection completes, and one the
        # server refuses (a wrong CurveZMQ key) never does: wait only so long.
        while True:
            if sock.poll(_poll_ms(deadline), zmq.POLLOUT):
                try:
                    sock.send(_encode(request), zmq.NOBLOCK)
                    break
                except zmq.Again:
                    pass
            if time.monotonic() >= deadline:
                return None
        while not sock.poll(_poll_ms(deadline), zmq.POLLIN):
            if time.monotonic() >= deadline:
                return None
        return _unpack_reply(sock.recv(), endpoint)
    finally:
        sock.close(0)


async def _request_async(endpoint: str, request: Mapping[str, Any], timeout_s: float,
                         curve: CurveKeys | None = None) -> dict[str, Any] | None:
    sock = zmq.asyncio.Context.instance().socket(zmq.REQ)
    _connect(sock, endpoint, curve)
    deadline = time.monotonic() + timeout_s
    try:
        try:  # as in _request_sync: a refused connection never takes the send
            await asyncio.wait_for(sock.send(_encode(request)), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return None
        while not await sock.poll(_poll_ms(deadline)):  # flags default to POLLIN
            if time.monotonic() >= deadline:
                return None
        return _unpack_reply(await sock.recv(), endpoint)
    finally:
        sock.close(0)


def rendezvous_status(endpoint: str, timeout_s: float = _STATUS_TIMEOUT_S,
                      curve: CurveKeys | None = None) -> dict[str, Any] | None:
    """The server's view (registered and missing ranks, open barriers), or ``None`` if it does not answer."""
    _check_endpoint(endpoint)
    try:
        reply = _request_sync(endpoint, {"status": True}, timeout_s, curve)
    except HopnetError:
        return None
    return None if reply is None else reply.get("status")


async def _rendezvous_status_async(endpoint: str, timeout_s: float = _STATUS_TIMEOUT_S,
                                   curve: CurveKeys | None = None) -> dict[str, Any] | None:
    try:
        reply = await _request_async(endpoint, {"status": True}, timeout_s, curve)
    except HopnetError:
        return None
    return None if reply is None else reply.get("status")


def _exchange_what(endpoint: str, world_size: int, status: dict[str, Any] | None) -> str:
    what = f"the addresses of all {world_size} ranks from the rendezvous at {endpoint}"
    if status is None:
        return what + " (the rendezvous server does not answer)"
    missing = list(status.get("missing", []))
    return what + f" (ranks that never registered: {_ranks_text(missing)})"


def _barrier_what(endpoint: str, name: str, status: dict[str, Any] | None) -> str:
    what = f"all ranks at barrier {name!r} of the rendezvous at {endpoint}"
    if status is None:
        return what + " (the rendezvous server does not answer)"
    entered = set(status.get("barriers", {}).get(name, []))
    world_size = int(status.get("world_size", 0))
    missing = [r for r in range(world_size) if r not in entered]
    return what + f" (ranks that never arrived: {_ranks_text(missing)})"


def _exchange_request(rank: int, world_size: int, address: str,
                      config: Mapping[str, Any] | None = None, restart: int = 0) -> dict[str, Any]:
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world size must be an integer >= 1 (got {world_size!r})")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank!r} out of range (world size {world_size})")
    if not isinstance(address, str) or not address:
        raise ConfigError(f"rank {rank}: bad address {address!r}")
    request: dict[str, Any] = {"rank": rank, "world_size": world_size, "address": address}
    if config is not None:
        request["config"] = dict(config)
    if not isinstance(restart, int) or isinstance(restart, bool) or restart < 0:
        raise ConfigError(f"rank {rank}: bad restart number {restart!r} (expected an integer >= 0)")
    if restart > 0:
        request["restart"] = restart
    return request


def _address_table(reply: dict[str, Any], endpoint: str, world_size: int) -> dict[int, str]:
    table = reply.get("addresses")
    if not isinstance(table, dict):
        raise RendezvousError(f"rendezvous at {endpoint}: reply carries no address table")
    result = {int(r): str(a) for r, a in table.items()}
    if sorted(result) != list(range(world_size)):
        raise RendezvousError(f"rendezvous at {endpoint}: address table covers ranks "
                              f"{_ranks_text(sorted(result))}, expected 0..{world_size - 1}")
    return dict(sorted(result.items()))


def exchange_addresses(endpoint: str, rank: int, world_size: int, address: str,
                       timeout_s: float, config: Mapping[str, Any] | None = None,
                       curve: CurveKeys | None = None, *, restart: int = 0) -> dict[int, str]:
    """Register ``address`` for ``rank``; block until every rank has; return ``{rank: address}``.

    Raises :class:`WaitTimeout` (naming the rendezvous and the missing ranks) after
    ``timeout_s``, and :class:`RendezvousError` when the server refuses the request
    (also when ``config``, the protocol configuration this rank runs, differs from another
    rank's). ``curve``: the run key, when the server was started with one.
    ``restart`` N > 0 (``HOPNET_RESTART``): this process replaces rank ``rank``'s dead one; once
    every rank registered, its address replaces the old one and the table comes back at once.
    """
    _check_endpoint(endpoint)
    timeout_s = _check_timeout(timeout_s)
    request = _exchange_request(rank, world_size, address, config, restart)
    start = time.monotonic()
    reply = _request_sync(endpoint, request, timeout_s, curve)
    if reply is None:
        waited = time.monotonic() - start
        status = rendezvous_status(endpoint, curve=curve)
        raise WaitTimeout(_exchange_what(endpoint, world_size, status), waited_s=waited)
    return _address_table(reply, endpoint, world_size)


async def exchange_addresses_async(endpoint: str, rank: int, world_size: int, address: str,
                                   timeout_s: float, config: Mapping[str, Any] | None = None,
                                   curve: CurveKeys | None = None, *, restart: int = 0) -> dict[int, str]:
    """:func:`exchange_addresses` for an asyncio event loop (uses ``zmq.asyncio``)."""
    _check_endpoint(endpoint)
    timeout_s = _check_timeout(timeout_s)
    request = _exchange_request(rank, world_size, address, config, restart)
    start = time.monotonic()
    reply = await _request_async(endpoint, request, timeout_s, curve)
    if reply is None:
        waited = time.monotonic() - start
        status = await _rendezvous_status_async(endpoint, curve=curve)
        raise WaitTimeout(_exchange_what(endpoint, world_size, status), waited_s=waited)
    return _address_table(reply, endpoint, world_size)


def _barrier_request(rank: int, name: str) -> dict[str, Any]:
    if not isinstance(rank, int) or rank < 0:
        raise ConfigError(f"barrier: bad rank {rank!r}")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"barrier: bad name {name!r}")
    return {"rank": rank, "barrier": name}


def barrier(endpoint: str, rank: int, name: str, timeout_s: float, curve: CurveKeys | None = None) -> None:
    """Block until every rank has entered the barrier ``name`` (raises :class:`WaitTimeout`)."""
    _check_endpoint(endpoint)
    timeout_s = _check_timeout(timeout_s)
    start = time.monotonic()
    reply = _request_sync(endpoint, _barrier_request(rank, name), timeout_s, curve)
    if reply is None:
        waited = time.monotonic() - start
        raise WaitTimeout(_barrier_what(endpoint, name, rendezvous_status(endpoint, curve=curve)), waited_s=waited)
    if reply.get("barrier") != name:
        raise RendezvousError(f"rendezvous at {endpoint}: unexpected reply to barrier {name!r}")


async def barrier_async(endpoint: str, rank: int, name: str, timeout_s: float,
                        curve: CurveKeys | None = None) -> None:
    """:func:`barrier` for an asyncio event loop."""
    _check_endpoint(endpoint)
    timeout_s = _check_timeout(timeout_s)
    start = time.monotonic()
    reply = await _request_async(endpoint, _barrier_request(rank, name), timeout_s, curve)
    if reply is None:
        waited = time.monotonic() - start
        status = await _rendezvous_status_async(endpoint, curve=curve)
        raise WaitTimeout(_barrier_what(endpoint, name, status), waited_s=waited)
    if reply.get("barrier") != name:
        raise RendezvousError(f"rendezvous at {endpoint}: unexpected reply to barrier {name!r}")

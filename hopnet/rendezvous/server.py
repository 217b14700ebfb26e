"""The rendezvous server: the launcher's meeting point for its workers' addresses and barriers.

The launcher runs a :class:`RendezvousServer` (a ZeroMQ ROUTER socket served by a
thread) and passes its endpoint to every worker in ``HOPNET_RENDEZVOUS``. Each worker
binds its own transport first, then registers the address its peers should connect to
(:func:`hopnet.rendezvous.client.exchange_addresses`); the server answers every rank at
once, when *every* rank has registered, with the full table ``{rank: address}``.

The same server implements named barriers: a barrier's ranks are answered once all of them
have entered it. Workers use one at shutdown, so that no worker closes its sockets while a
neighbour still needs its last updates. The wire format is :mod:`hopnet.rendezvous.wire`.

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
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import zmq

from hopnet.errors import ConfigError
from hopnet.rendezvous.wire import config_mismatch, decode, encode
from hopnet.security import CurveKeys, HandshakeWatch, make_curve_server

__all__ = ["RendezvousServer"]

_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "")


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
        # an elastic run: every rank's control address, and what `hopnet join` needs to start workers
        self._control: dict[int, str] = {}
        self._next_rank = world_size
        self.join_info: dict[str, Any] | None = None
        """Set by the launcher of an elastic run: what a joining worker needs besides its rank."""

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
        sock.send_multipart([identity, b"", encode(obj, as_json)])

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
            msg, as_json = decode(payload)
        except Exception:
            self._refuse(sock, identity, "rendezvous: undecodable request (expected msgpack or JSON)", False)
            return
        if not isinstance(msg, dict):
            self._refuse(sock, identity, "rendezvous: request must be a map", as_json)
            return
        if msg.get("status"):
            self._reply(sock, identity, {"status": self.status()}, as_json)
            return
        if "join" in msg:
            self._assign_ranks(sock, identity, msg["join"], as_json)
            return
        rank = msg.get("rank")
        if "control" in msg and isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < self._next_rank:
            address = msg["control"]
            if not isinstance(address, str) or not address:
                self._refuse(sock, identity, f"rendezvous: rank {rank} sent a bad control address", as_json)
                return
            with self._lock:
                self._control[rank] = address
                table = {str(r): a for r, a in self._control.items()}
            self._reply(sock, identity, {"control": table}, as_json)
            return
        if not isinstance(rank, int) or isinstance(rank, bool):
            self._refuse(sock, identity, f"rendezvous: rank must be an integer (got {rank!r})", as_json)
            return
        batch = msg.get("count")
        if "barrier" in msg and isinstance(batch, int) and not isinstance(batch, bool) and 0 < batch \
                and 0 <= rank < self._next_rank:
            self._enter_barrier(sock, identity, rank, msg["barrier"], as_json, count=batch)
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

    def _assign_ranks(self, sock: zmq.Socket, identity: bytes, count: Any, as_json: bool) -> None:
        """`hopnet join --nproc K`: K new ranks, never used before, and what their workers need."""
        if self.join_info is None:
            self._refuse(sock, identity, "this run is not elastic: it was launched without --max-nproc "
                                         "or --min-nproc, so it takes no joiners", as_json)
            return
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            self._refuse(sock, identity, f"rendezvous: join needs a count >= 1 (got {count!r})", as_json)
            return
        with self._lock:
            ranks = list(range(self._next_rank, self._next_rank + count))
            self._next_rank += count
            table = {str(r): a for r, a in self._control.items()}
        self._reply(sock, identity, {"ranks": ranks, "control": table, "config": self.config,
                                     "info": self.join_info}, as_json)

    def _check_config(self, sock: zmq.Socket, identity: bytes, rank: int, config: Any, as_json: bool) -> bool:
        """Keep the first configuration; a different one fails every rank of the rendezvous."""
        with self._lock:
            if self._config_error is None and config is not None:
                if not isinstance(config, dict):
                    self._config_error = f"rendezvous: rank {rank} sent a malformed protocol configuration"
                elif self.config is None:
                    self.config, self._config_rank = dict(config), rank
                elif config != self.config:
                    self._config_error = config_mismatch(self._config_rank, self.config, rank, config)
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

    def _enter_barrier(self, sock: zmq.Socket, identity: bytes, rank: int, name: Any, as_json: bool,
                       count: int | None = None) -> None:
        """``count``: the barrier is for that many ranks (the workers of one `hopnet join`), not the whole world."""
        if not isinstance(name, str) or not name:
            self._refuse(sock, identity, f"rendezvous: rank {rank} sent a bad barrier name {name!r}", as_json)
            return
        with self._lock:
            entered = self._barriers.setdefault(name, {})
            entered[rank] = (identity, as_json)  # a rank entering again is a retry
            if len(entered) < (self.world_size if count is None else count):
                return
            del self._barriers[name]
            self._barriers_done.append(name)
        for _, (ident, js) in sorted(entered.items()):
            self._reply(sock, ident, {"barrier": name}, js)

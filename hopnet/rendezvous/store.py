"""The run's c10d store: one torch ``TCPStore`` per run, hosted by `hopnet launch`.

The launcher hosts the store (:func:`host_store`) next to its rendezvous server and hands
its endpoint to every worker as ``HOPNET_STORE=HOST:PORT``. Workers open it as clients
when they need it (:func:`connect_store`): the torch bulk plane and the torch collective
build their process groups from prefixed keys of it, so process groups are formed by
their members alone. With several machines node 0's launcher hosts it at
``--rdzv-endpoint`` (:mod:`hopnet.launch.nodes`); under torchrun's c10d rendezvous the
same role is played by torchrun's own agent store, under srun by a store rank 0 hosts
(:mod:`hopnet.bootstrap.external`).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from hopnet.errors import ConfigError, HopnetError

if TYPE_CHECKING:  # torch is imported where a store is made: `hopnet launch`'s argument checks load none
    import torch.distributed as dist

STORE_CONNECT_RETRY_S = 0.1


NAMESPACE_SEPARATOR = "/"
"""``HOST:PORT/NAME``: the run's store seen through the prefix ``NAME`` (each lane of a run of
replica groups keeps its process groups apart this way: :mod:`hopnet.replica`)."""


def in_namespace(endpoint: str, name: str) -> str:
    """``endpoint`` with every key prefixed by ``name`` (after any namespace it already has)."""
    return f"{endpoint}{NAMESPACE_SEPARATOR}{name}"


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 as ``[::1]:PORT``) as a (host, port) pair; a ``/NAME`` namespace is ignored."""
    text = endpoint.strip().split(NAMESPACE_SEPARATOR, 1)[0]
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"store endpoint {endpoint!r}: expected HOST:PORT")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"store endpoint {endpoint!r}: port {port_text!r} is not an integer") from None
    if not 0 < port < 65536:
        raise ConfigError(f"store endpoint {endpoint!r}: port {port} out of range")
    return host, port


def format_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class HostedStore:
    """The master side of the run's TCPStore; :meth:`close` shuts its server down."""

    def __init__(self, host: str, timeout_s: float = 300.0, port: int = 0) -> None:
        import torch.distributed as dist

        try:
            self.store: dist.TCPStore | None = dist.TCPStore(
                host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
        except Exception as exc:  # torch raises RuntimeError / DistNetworkError
            where = format_endpoint(host, port) if port else host
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise HopnetError(f"cannot host the run's c10d store on {where}: {first}") from None
        self.host = host
        self.port = int(self.store.port)

    @property
    def endpoint(self) -> str:
        return format_endpoint(self.host, self.port)

    def close(self) -> None:
        """Stop serving. Dropping the last reference to the master stops its server thread."""
        self.store = None


def host_store(host: str = "127.0.0.1", port: int = 0) -> HostedStore:
    """Host a TCPStore for ``host`` at ``port`` (0: a free one), without waiting for clients.

    The server listens on every interface whatever ``host`` says; ``host`` is the name
    the :attr:`HostedStore.endpoint` gives the clients."""
    return HostedStore(host, port=port)


def _wait_until_reachable(host: str, port: int, timeout_s: float,
                          waiting: Callable[[float], None] | None = None) -> None:
    started = time.monotonic()
    deadline = started + timeout_s
    last: OSError | None = None
    while True:
        if waiting is not None:
            waiting(time.monotonic() - started)
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, timeout_s))):
                return
        except OSError as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise HopnetError(f"the run's c10d store at {format_endpoint(host, port)} is unreachable "
                              f"after {timeout_s:g}s ({last.strerror or last if last else 'no answer'})")
        time.sleep(STORE_CONNECT_RETRY_S)


def connect_store(endpoint: str, timeout_s: float = 60.0,
                  waiting: Callable[[float], None] | None = None) -> dist.TCPStore:
    """Open the run's store as a client. Fails naming the endpoint, never hangs; ``waiting`` is
    called with the seconds waited so far while the endpoint does not answer yet.

    ``timeout_s`` bounds the connection and every later blocking call on the store
    (``get``/``wait`` of a key nobody sets fail after it).
    """
    import torch.distributed as dist

    host, port = parse_endpoint(endpoint)
    _wait_until_reachable(host, port, timeout_s, waiting)  # a clear message instead of torch's retry log
    try:
        store: dist.Store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                          timeout=timedelta(seconds=timeout_s))
    except Exception as exc:
        raise HopnetError(f"cannot open the run's c10d store at {endpoint}: {exc}") from None
    for name in endpoint.strip().split(NAMESPACE_SEPARATOR)[1:]:
        store = dist.PrefixStore(name, store)
    return store  # type: ignore[return-value]


__all__ = ["HostedStore", "connect_store", "format_endpoint", "host_store", "in_namespace", "parse_endpoint"]

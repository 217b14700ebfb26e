"""The rendezvous client: what a worker calls to find its peers' addresses and meet at barriers.

A worker started by `hopnet launch` finds the server's endpoint in ``HOPNET_RENDEZVOUS``
(:mod:`hopnet.rendezvous.server`). It binds its own transport first, then calls
:func:`exchange_addresses` with the address its peers should connect to; the call returns
once *every* rank has registered, with the full table ``{rank: address}`` (the same on
every rank). :func:`barrier` returns once all ranks have entered the barrier with that name.

Every wait takes a timeout and raises :class:`~hopnet.errors.WaitTimeout` naming the
rendezvous and, when the server can still tell, the ranks that never showed up. A refusal
raises :class:`~hopnet.rendezvous.wire.RendezvousError` (a configuration the ranks disagree
on: :class:`~hopnet.rendezvous.wire.RendezvousConfigError`). With the run's CURVE keys
(``curve=``) a call is admitted by a server that holds the run key.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping
from typing import Any

import zmq
import zmq.asyncio

from hopnet.errors import ConfigError, HopnetError, WaitTimeout
from hopnet.rendezvous.wire import RendezvousConfigError, RendezvousError, decode, encode
from hopnet.security import CurveKeys, make_curve_client

__all__ = [
    "RendezvousConfigError",
    "RendezvousError",
    "barrier",
    "barrier_async",
    "exchange_addresses",
    "exchange_addresses_async",
    "rendezvous_status",
]

_STATUS_TIMEOUT_S = 0.5


def _ranks_text(ranks: list[int]) -> str:
    if not ranks:
        return "none"
    if len(ranks) > 16:
        return ", ".join(str(r) for r in ranks[:16]) + f", ... ({len(ranks)} in all)"
    return ", ".join(str(r) for r in ranks)


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
        reply, _ = decode(data)
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
                    sock.send(encode(request), zmq.NOBLOCK)
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
            await asyncio.wait_for(sock.send(encode(request)), max(0.0, deadline - time.monotonic()))
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


def _barrier_request(rank: int, name: str, count: int | None = None) -> dict[str, Any]:
    if not isinstance(rank, int) or rank < 0:
        raise ConfigError(f"barrier: bad rank {rank!r}")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"barrier: bad name {name!r}")
    return {"rank": rank, "barrier": name} if count is None else {"rank": rank, "barrier": name, "count": count}


def barrier(endpoint: str, rank: int, name: str, timeout_s: float, curve: CurveKeys | None = None,
            count: int | None = None) -> None:
    """Block until every rank (``count`` ranks, if given) has entered the barrier ``name`` (raises
    :class:`WaitTimeout`)."""
    _check_endpoint(endpoint)
    timeout_s = _check_timeout(timeout_s)
    start = time.monotonic()
    reply = _request_sync(endpoint, _barrier_request(rank, name, count), timeout_s, curve)
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


def register_control(endpoint: str, rank: int, address: str, timeout_s: float,
                     curve: CurveKeys | None = None) -> dict[int, str]:
    """An elastic run: register this rank's control address; returns every control address known."""
    reply = _request_sync(endpoint, {"rank": rank, "control": address}, timeout_s, curve)
    if reply is None:
        raise HopnetError(f"rank {rank}: the rendezvous at {endpoint} did not answer within {timeout_s:g}s")
    if "error" in reply:
        raise HopnetError(str(reply["error"]))
    return {int(r): str(a) for r, a in reply.get("control", {}).items()}


def request_join(endpoint: str, count: int, timeout_s: float, curve: CurveKeys | None = None) -> dict[str, Any]:
    """`hopnet join`: ask the run at ``endpoint`` for ``count`` new ranks."""
    try:
        reply = _request_sync(endpoint, {"join": count}, timeout_s, curve)
    except RendezvousError as exc:
        raise ConfigError(str(exc)) from None
    if reply is None:
        raise HopnetError(f"the run's rendezvous at {endpoint} did not answer within {timeout_s:g}s "
                          "(is the run still going, and is the key file the run's?)")
    if "error" in reply:
        raise ConfigError(str(reply["error"]))
    return reply

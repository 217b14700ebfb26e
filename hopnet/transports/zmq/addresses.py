"""Who is who on ZeroMQ: the routing ids a rank's DEALERs present, and the addresses a transport takes."""

from __future__ import annotations

from hopnet.errors import ConfigError
from hopnet.transports import payload_stream as ps


def routing_id(rank: int) -> bytes:
    """The ZeroMQ routing id a rank's DEALERs present to their peers."""
    return str(rank).encode("ascii")


def express_routing_id(rank: int) -> bytes:
    """The routing id of a rank's express DEALER (:meth:`ZmqTransport.send_express`)."""
    return b"x" + routing_id(rank)


def zmq_endpoint(address: str) -> str:
    """The ZeroMQ endpoint of a transport's address (without its ``?data=PORT``), for a
    plain ZeroMQ socket that talks to the transport's ROUTER."""
    return ps.split_address(address)[0]


def check_address(address: str, what: str) -> None:
    if not isinstance(address, str) or not address.startswith(("tcp://", "ipc://")):
        raise ConfigError(f"{what} must be tcp://HOST:PORT or ipc:///path, got {address!r}")
    if "?" in address and ps.split_address(address)[1] is None:
        raise ConfigError(f"{what} must be tcp://HOST:PORT, optionally ?data=PORT, got {address!r}")

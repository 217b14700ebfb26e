"""The rendezvous's wire format and errors, shared by its server and its clients.

One msgpack map per request and per reply (a request that is a JSON object gets a JSON
reply, for clients in other languages). Requests::

    {"rank": R, "address": "tcp://...", "world_size": N,
     "config": {...}, "restart": N}                          -> {"addresses": {R: address, ...}}
    {"rank": R, "barrier": "name"}                          -> {"barrier": "name"}
    {"status": true}                                        -> {"status": {...}}

and any request may be answered ``{"error": "one line"}`` (rank out of range, a rank
registered twice with different addresses, a world size that disagrees, ...).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgpack

from hopnet.errors import ConfigError, HopnetError


class RendezvousError(HopnetError):
    """The rendezvous server refused a request (the message says why)."""


class RendezvousConfigError(RendezvousError, ConfigError):
    """The rendezvous refused the ranks' configuration (ranks that run different protocol
    options): a configuration error, which every rank meets (exit status 2)."""


def encode(obj: Mapping[str, Any], as_json: bool = False) -> bytes:
    if as_json:
        return json.dumps(obj, sort_keys=True).encode("utf-8")
    return msgpack.packb(obj, use_bin_type=True)


def decode(data: bytes) -> tuple[Any, bool]:
    """Decode a request or reply; returns (object, was_json)."""
    if data[:1] == b"{":
        return json.loads(data.decode("utf-8")), True
    return msgpack.unpackb(data, raw=False, strict_map_key=False), False


def config_mismatch(rank_a: int | None, a: Mapping[str, Any], rank_b: int, b: Mapping[str, Any]) -> str:
    """One line naming two ranks that run different protocol options, and (up to three of) the options."""
    names = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    shown = "; ".join(f"{k}={a.get(k)!r} on rank {rank_a}, {k}={b.get(k)!r} on rank {rank_b}" for k in names[:3])
    return f"ranks {rank_a} and {rank_b} run different protocol options: {shown}"

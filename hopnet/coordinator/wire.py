"""The coordinator's wire format: one msgpack-encoded map per ZeroMQ message.

A worker's DEALER presents the routing id ``b"w<rank>"`` and sends single-frame
messages; the coordinator's ROUTER sees ``[routing id, payload]``. Every payload is a map
with string keys whose ``"t"`` names the kind; values are ints, floats, strings, bools,
None, or lists of them. A payload that is not that (bad msgpack, too large, another type
or a routing id that is not a worker's) is dropped and counted, never acted on.

Kinds the host itself answers and never passes to the state machine (:data:`HOST_KINDS`):

==========  ==================  ===================================================
kind        direction           meaning
==========  ==================  ===================================================
``hello``   worker -> host      first message of a worker: it is connected (``"restart": N``:
                                it replaces the rank's dead worker, see ``rejoin``)
``ping``    worker -> host      are you there? answered with ``pong``
``beat``    worker -> host      a sign of life, sent when nothing else went out lately
``rejoin``  worker -> host      a replacement (its ``hello`` carried ``"restart": N``, which
                                ended its predecessor here) has taken a neighbour's state:
                                the machine takes the rank back (``on_worker_rejoined``)
``bye``     worker -> host      leaving: the host calls ``on_worker_gone`` and answers
                                ``bye_ok`` after every message it sent before; with
                                ``"failed": true`` the worker is failing, and the others
                                are told (``peer_failed``)
``pong``    host -> worker      answer to ``ping``
``bye_ok``  host -> worker      the last message a leaving worker gets
``peer_dead`` host -> workers   ``rank`` went silent (``silent_s``): fail what waits on it
``peer_failed`` host -> workers ``rank`` left failing: fail what waits on it
``expelled`` host -> worker     answer to any message of a worker declared dead: it is
                                in no group any more (``why``)
``synced``  host -> worker      answer to a message that carried ``"sync": ID`` (the key is
                                removed before the machine sees it), sent after every
                                message the machine sent in reply: ``{"t", "id": ID}``
==========  ==================  ===================================================
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import msgpack

MAX_MESSAGE_BYTES = 64 * 1024
"""Largest payload either side accepts; coordinator messages are a few dozen bytes."""
MAX_LIST_ITEMS = 4096

HELLO = "hello"
PING = "ping"
PONG = "pong"
BEAT = "beat"
BYE = "bye"
BYE_OK = "bye_ok"
PEER_DEAD = "peer_dead"
PEER_FAILED = "peer_failed"
EXPELLED = "expelled"
SYNC = "sync"
"""A key any worker message may carry: the host answers ``synced`` after the machine's reply."""
SYNCED = "synced"
REJOIN = "rejoin"
HOST_KINDS = frozenset({HELLO, PING, BEAT, BYE, REJOIN})
"""Worker -> host kinds the host handles itself."""

_ROUTING_ID = re.compile(rb"w(0|[1-9][0-9]{0,8})")


class BadFrame(ValueError):
    """A payload or routing id that is not a coordinator message (dropped and counted)."""


def routing_id(rank: int) -> bytes:
    """The routing id a worker's DEALER presents to the coordinator."""
    return b"w%d" % rank


def rank_of(identity: bytes, world_size: int) -> int:
    match = _ROUTING_ID.fullmatch(identity)
    if match is None:
        raise BadFrame("routing id is not a worker's")
    rank = int(match.group(1))
    if rank >= world_size:
        raise BadFrame(f"rank {rank} out of range")
    return rank


def encode(message: Mapping[str, Any]) -> bytes:
    return msgpack.packb(dict(message), use_bin_type=True)


def decode(payload: bytes) -> dict[str, Any]:
    """The message in ``payload``, checked: a map with a string ``"t"`` and plain values."""
    if len(payload) > MAX_MESSAGE_BYTES:
        raise BadFrame(f"payload of {len(payload)} bytes")
    try:
        message = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True,
                                  max_array_len=MAX_LIST_ITEMS, max_map_len=64, max_str_len=1024,
                                  max_bin_len=0, max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise BadFrame(f"not msgpack ({type(exc).__name__})") from None
    check_message(message)
    return message


def check_message(message: Any) -> None:
    if not isinstance(message, dict):
        raise BadFrame(f"a {type(message).__name__}, not a map")
    kind = message.get("t")
    if not isinstance(kind, str) or not kind:
        raise BadFrame("no kind (\"t\")")
    for key, value in message.items():
        if not isinstance(key, str):
            raise BadFrame("a key that is not a string")
        _check_value(value, depth=0)


def _check_value(value: Any, depth: int) -> None:
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, list) and depth == 0:
        for item in value:
            _check_value(item, depth + 1)
        return
    raise BadFrame(f"a value of type {type(value).__name__}")

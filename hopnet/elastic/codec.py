"""Membership messages as plain maps (msgpack on the control channel) and back."""

from __future__ import annotations

from typing import Any

from hopnet.errors import HopnetError
from hopnet.membership import (
    Accept, Accepted, Ballot, Beat, Change, ChangeRequest, Commit, JoinRequest, Message, Nack,
    Prepare, Promise, Requests, View,
)

_KINDS: dict[str, type] = {cls.__name__: cls for cls in
                           (Beat, JoinRequest, ChangeRequest, Prepare, Promise, Accept, Accepted, Nack, Commit)}


def _ballot(b: Ballot | None) -> list[int] | None:
    return None if b is None else [b.round, b.proposer]


def _unballot(v: Any) -> Ballot | None:
    return None if v is None else Ballot(int(v[0]), int(v[1]))


def _change(c: Change | None) -> dict[str, Any] | None:
    if c is None:
        return None
    return {"n": c.view.number, "m": list(c.view.members), "j": list(c.joined), "l": list(c.left),
            "d": list(c.died), "r": list(c.refused)}


def _unchange(v: Any) -> Change | None:
    if v is None:
        return None
    return Change(View(int(v["n"]), tuple(int(r) for r in v["m"])), tuple(v["j"]), tuple(v["l"]), tuple(v["d"]),
                  tuple(v["r"]))


def _requests(r: Requests) -> list[list[int]]:
    return [list(r.joins), list(r.leaves), list(r.deaths)]


def _unrequests(v: Any) -> Requests:
    return Requests(tuple(v[0]), tuple(v[1]), tuple(v[2]))


def encode(message: Message) -> dict[str, Any]:
    """``message`` as a map of plain values."""
    out: dict[str, Any] = {"k": type(message).__name__, "v": message.view}
    if isinstance(message, JoinRequest):
        out["rank"] = message.rank
    elif isinstance(message, ChangeRequest):
        out["req"] = _requests(message.requests)
    elif isinstance(message, Prepare):
        out["b"] = _ballot(message.ballot)
    elif isinstance(message, Promise):
        out.update(b=_ballot(message.ballot), ab=_ballot(message.accepted_ballot),
                   a=_change(message.accepted), req=_requests(message.requests))
    elif isinstance(message, (Accept, Accepted)):
        out.update(b=_ballot(message.ballot), c=_change(message.change))
    elif isinstance(message, Nack):
        out.update(b=_ballot(message.ballot), p=_ballot(message.promised))
    elif isinstance(message, Commit):
        out.update(b=_ballot(message.ballot), c=_change(message.change), by=list(message.accepted_by))
    return out


def decode(data: Any) -> Message:
    """The message :func:`encode` made; :class:`HopnetError` for anything else."""
    try:
        kind = _KINDS[data["k"]]
        view = int(data["v"])
        if kind is Beat:
            return Beat(view)
        if kind is JoinRequest:
            return JoinRequest(view, int(data["rank"]))
        if kind is ChangeRequest:
            return ChangeRequest(view, _unrequests(data["req"]))
        if kind is Prepare:
            return Prepare(view, _unballot(data["b"]))  # type: ignore[arg-type]
        if kind is Promise:
            return Promise(view, _unballot(data["b"]), _unballot(data["ab"]),  # type: ignore[arg-type]
                           _unchange(data["a"]), _unrequests(data["req"]))
        if kind is Accept:
            return Accept(view, _unballot(data["b"]), _unchange(data["c"]))  # type: ignore[arg-type]
        if kind is Accepted:
            return Accepted(view, _unballot(data["b"]), _unchange(data["c"]))  # type: ignore[arg-type]
        if kind is Nack:
            return Nack(view, _unballot(data["b"]), _unballot(data["p"]))  # type: ignore[arg-type]
        return Commit(view, _unballot(data["b"]), _unchange(data["c"]),  # type: ignore[arg-type]
                      tuple(int(r) for r in data["by"]))
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise HopnetError(f"malformed membership message: {exc!r}") from None

"""The message kinds the transports accept: the runtime's own, and those protocols declare.

Apart from :mod:`hopnet.wire` (which re-exports these) so that declaring a protocol
(:func:`hopnet.registry.register`) imports no torch.
"""

from __future__ import annotations

# Kinds every transport accepts. Protocols add theirs with register_kind().
# ``bye``: the sender leaves after iteration ``iter``; ``meta`` may hold its planned last
# iteration under ``"f"``. ``beat``: a heartbeat, sent to a neighbour nothing else went to
# lately (see hopnet.runtime.liveness); it carries nothing but the sender's iteration.
# ``done``: the sender finished training and is quiescing for the consensus (it starts no
# exchange any more, so no neighbour should wait on it for one); it still beats, and says
# ``bye`` when it closes.
_KNOWN_KINDS: set[str] = {"update", "token", "ack", "hello", "bye", "beat", "done"}
BYE_FINAL_ITER = "f"
# Kinds accepted from any rank of the run, not only from graph neighbours (collectives
# among groups formed on the fly, and the goodbye every rank may say to any other).
_ANY_RANK_KINDS: set[str] = {"bye"}


def register_kind(kind: str, *, any_rank: bool = False) -> None:
    """Allow a protocol-specific message kind on the wire.

    With ``any_rank`` the kind is accepted from every rank of the run; otherwise only
    from the graph neighbours the transport was given."""
    _KNOWN_KINDS.add(kind)
    if any_rank:
        _ANY_RANK_KINDS.add(kind)


def known_kinds() -> frozenset[str]:
    return frozenset(_KNOWN_KINDS)


def is_known_kind(kind: str) -> bool:
    return kind in _KNOWN_KINDS


def any_rank_kinds() -> frozenset[str]:
    return frozenset(_ANY_RANK_KINDS)


def is_any_rank_kind(kind: str) -> bool:
    return kind in _ANY_RANK_KINDS


__all__ = ["BYE_FINAL_ITER", "any_rank_kinds", "is_any_rank_kind", "is_known_kind", "known_kinds", "register_kind"]

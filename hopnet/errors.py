"""Exceptions raised by hopnet. Every one carries a message meant for a person."""

from __future__ import annotations


class HopnetError(Exception):
    """Base class of all hopnet errors."""


class ConfigError(HopnetError, ValueError):
    """Bad user input: a graph, a flag, an option. The message is one line."""


class GraphError(ConfigError):
    """A communication graph that is malformed or unusable."""


PEER_STATES = ("stalled", "departed", "dead")
"""What a failed wait can say about the peer it blames.

``stalled``: the peer is alive (it still answers heartbeats) but sent nothing it owed;
``departed``: it said goodbye (``bye``) before sending what was needed;
``dead``: it went silent (its process died or its host stopped answering)."""


class WaitTimeout(HopnetError, TimeoutError):
    """A blocking wait expired. The message names what was awaited, from whom, and for which iteration.

    ``peer`` is the rank the wait blames (``None`` when no peer is to blame) and
    ``peer_state`` one of :data:`PEER_STATES` when it is known.
    """

    def __init__(self, what: str, *, peer: int | None = None, iteration: int | None = None,
                 waited_s: float | None = None, peer_state: str | None = None) -> None:
        parts = [f"timed out waiting for {what}"]
        if peer is not None:
            parts.append(f"from peer {peer}" + (f" ({peer_state})" if peer_state else ""))
        if iteration is not None:
            parts.append(f"in iteration {iteration}")
        if waited_s is not None:
            parts.append(f"after {waited_s:.1f}s")
        super().__init__(" ".join(parts))
        self.what = what
        self.peer = peer
        self.peer_state = peer_state
        self.iteration = iteration
        self.waited_s = waited_s


class MembershipStopped(HopnetError):
    """An elastic run's membership stopped this worker: cut off from a majority of its view,
    dropped from it, too few members left, or its join refused. The message is the
    membership's one line."""


class ProtocolError(HopnetError):
    """A protocol invariant was violated (a bug, or peers configured inconsistently)."""


class PeerFailure(HopnetError):
    """A peer is known to have stopped: it departed or died before sending what was needed.

    ``peer`` names it and ``peer_state`` is ``"departed"`` or ``"dead"`` (see :data:`PEER_STATES`).
    """

    def __init__(self, message: str, *, peer: int | None = None, peer_state: str | None = None,
                 iteration: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer
        self.peer_state = peer_state
        self.iteration = iteration


class NonFiniteError(HopnetError):
    """A worker's own model holds inf or NaN: it stops rather than send it to anyone.

    ``rank`` and ``iteration`` say whose model and when (see :mod:`hopnet.finite`)."""

    def __init__(self, message: str, *, rank: int, iteration: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.iteration = iteration

"""Exceptions raised by hopnet. Every one carries a message meant for a person."""

from __future__ import annotations


class HopnetError(Exception):
    """Base class of all hopnet errors."""


class ConfigError(HopnetError, ValueError):
    """Bad user input: a graph, a flag, an option. The message is one line."""


class GraphError(ConfigError):
    """A communication graph that is malformed or unusable."""


class WaitTimeout(HopnetError, TimeoutError):
    """A blocking wait expired. The message names what was awaited, from whom, and for which iteration."""

    def __init__(self, what: str, *, peer: int | None = None, iteration: int | None = None,
                 waited_s: float | None = None) -> None:
        parts = [f"timed out waiting for {what}"]
        if peer is not None:
            parts.append(f"from peer {peer}")
        if iteration is not None:
            parts.append(f"in iteration {iteration}")
        if waited_s is not None:
            parts.append(f"after {waited_s:.1f}s")
        super().__init__(" ".join(parts))
        self.what = what
        self.peer = peer
        self.iteration = iteration
        self.waited_s = waited_s


class ProtocolError(HopnetError):
    """A protocol invariant was violated (a bug, or peers configured inconsistently)."""


class PeerFailure(HopnetError):
    """A peer is known to have stopped."""

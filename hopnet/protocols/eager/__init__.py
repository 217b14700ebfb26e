"""eager-SGD (Li et al., PPoPP'20): solo and majority partial all-reduce of the gradients.

Modules: ``spec`` (the declaration), ``options``, ``protocol`` (the algorithm: the trainer's side), built on
``rounds`` (the activations and the round engine, with the protocol's state).
The registry imports ``spec`` only (no torch); ``spec`` imports ``protocol`` when a run builds one,
and ``protocol`` reads ``options``, never ``spec``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hopnet.protocols.eager.options import EagerOptions

if TYPE_CHECKING:
    from hopnet.protocols.eager.protocol import EagerProtocol


def __getattr__(name: str) -> object:
    """``from hopnet.protocols.eager import EagerProtocol`` imports the algorithm (torch) only when asked."""
    if name == "EagerProtocol":
        from hopnet.protocols.eager.protocol import EagerProtocol

        return EagerProtocol
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["EagerOptions", "EagerProtocol"]

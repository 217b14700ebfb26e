"""Pipe-SGD (Li et al., NeurIPS'18): the all-reduce of iteration k runs behind the compute of
the next K-1 iterations, with light gradient compression.

Modules: ``spec`` (the declaration), ``options``, ``protocol`` (the algorithm).
The registry imports ``spec`` only (no torch); ``spec`` imports ``protocol`` when a run builds one,
and ``protocol`` reads ``options``, never ``spec``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hopnet.protocols.pipesgd.options import PipeSgdOptions

if TYPE_CHECKING:
    from hopnet.protocols.pipesgd.protocol import PipeSgdProtocol


def __getattr__(name: str) -> object:
    """``from hopnet.protocols.pipesgd import PipeSgdProtocol`` imports the algorithm (torch) only when asked."""
    if name == "PipeSgdProtocol":
        from hopnet.protocols.pipesgd.protocol import PipeSgdProtocol

        return PipeSgdProtocol
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PipeSgdOptions", "PipeSgdProtocol"]

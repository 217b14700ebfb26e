"""Partial Reduce (Miao et al., SIGMOD'21): a controller forms groups of the first P ready workers,
which average with staleness-aware weights.

Modules: ``spec``, ``options``, ``protocol``, and its coordinator: ``controller`` (the sans-IO state
machine), ``weights`` (staleness-aware weights), ``window`` (the group-frozen filter's components),
``mixing`` (the mixing matrices of its rounds).
The registry imports ``spec`` only (no torch); ``spec`` imports ``protocol`` when a run builds one,
and ``protocol`` reads ``options``, never ``spec``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hopnet.protocols.partial_reduce.options import PartialReduceOptions

if TYPE_CHECKING:
    from hopnet.protocols.partial_reduce.protocol import PartialReduceProtocol


def __getattr__(name: str) -> object:
    """``from hopnet.protocols.partial_reduce import PartialReduceProtocol`` imports the algorithm (torch) only when asked."""
    if name == "PartialReduceProtocol":
        from hopnet.protocols.partial_reduce.protocol import PartialReduceProtocol

        return PartialReduceProtocol
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PartialReduceOptions", "PartialReduceProtocol"]

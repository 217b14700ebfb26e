"""AD-PSGD (Lian et al., ICML'18): atomic pairwise model averaging between the two sides of a
bipartite graph, free of deadlock.

Modules: ``spec`` (the declaration), ``options``, ``protocol`` (the algorithm).
The registry imports ``spec`` only (no torch); ``spec`` imports ``protocol`` when a run builds one,
and ``protocol`` reads ``options``, never ``spec``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hopnet.protocols.adpsgd.options import AdPsgdOptions

if TYPE_CHECKING:
    from hopnet.protocols.adpsgd.protocol import AdPsgdProtocol


def __getattr__(name: str) -> object:
    """``from hopnet.protocols.adpsgd import AdPsgdProtocol`` imports the algorithm (torch) only when asked."""
    if name == "AdPsgdProtocol":
        from hopnet.protocols.adpsgd.protocol import AdPsgdProtocol

        return AdPsgdProtocol
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AdPsgdOptions", "AdPsgdProtocol"]

"""DiLoCo: H local steps, then an outer Nesterov step on the averaged pseudo-gradient (optionally
streamed in fragments, and among a quorum).

Modules: ``spec``, ``options``, ``protocol``, ``quorum`` (the outer step among a quorum of ready workers).
The registry imports ``spec`` only (no torch); ``spec`` imports ``protocol`` when a run builds one,
and ``protocol`` reads ``options``, never ``spec``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hopnet.protocols.diloco.options import DiLoCoOptions

if TYPE_CHECKING:
    from hopnet.protocols.diloco.protocol import DiLoCoProtocol


def __getattr__(name: str) -> object:
    """``from hopnet.protocols.diloco import DiLoCoProtocol`` imports the algorithm (torch) only when asked."""
    if name == "DiLoCoProtocol":
        from hopnet.protocols.diloco.protocol import DiLoCoProtocol

        return DiLoCoProtocol
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DiLoCoOptions", "DiLoCoProtocol"]

"""Prague (Luo et al., ASPLOS'20): Partial All-Reduce in groups a Group Generator forms (random,
smart, or a static schedule).

Modules: ``spec``, ``options``, ``protocol``, and the Group Generators it runs as a coordinator:
``random_gg``, ``smart_gg``, ``static_schedule``.
The registry imports ``spec`` only (no torch); ``spec`` imports ``protocol`` when a run builds one,
and ``protocol`` reads ``options``, never ``spec``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hopnet.protocols.prague.options import PragueOptions

if TYPE_CHECKING:
    from hopnet.protocols.prague.protocol import PragueProtocol


def __getattr__(name: str) -> object:
    """``from hopnet.protocols.prague import PragueProtocol`` imports the algorithm (torch) only when asked."""
    if name == "PragueProtocol":
        from hopnet.protocols.prague.protocol import PragueProtocol

        return PragueProtocol
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PragueOptions", "PragueProtocol"]

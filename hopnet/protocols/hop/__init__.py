"""Hop (Luo et al., ASPLOS'19): update queues tagged by iteration, token queues bounding the iteration
gap, backup workers, bounded staleness and iteration skipping.

Modules: ``spec`` (the declaration), ``options``, ``protocol`` (the algorithm: its iteration flow), built on
``state`` (its state and shared bookkeeping), ``receiving`` (where updates land, what is held back) and
``rejoin`` (its part in replacing a dead worker), with ``failures`` (why an iteration cannot finish, in
words); ``queues`` (update and token queues), ``mix_sums`` (the weighted sums updates are mixed into).
The registry imports ``spec`` only (no torch); ``spec`` imports ``protocol`` when a run builds one,
and ``protocol`` reads ``options``, never ``spec``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hopnet.protocols.hop.options import HopOptions, NotifyAckOptions

if TYPE_CHECKING:
    from hopnet.protocols.hop.protocol import HopProtocol


def __getattr__(name: str) -> object:
    """``from hopnet.protocols.hop import HopProtocol`` imports the algorithm (torch) only when asked."""
    if name == "HopProtocol":
        from hopnet.protocols.hop.protocol import HopProtocol

        return HopProtocol
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["HopOptions", "NotifyAckOptions", "HopProtocol"]

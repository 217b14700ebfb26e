"""Synchronous all-reduce of the gradients among all ranks: the DDP baseline.

Modules: ``spec`` (the declaration), ``options``, ``protocol`` (the algorithm).
The registry imports ``spec`` only (no torch); ``spec`` imports ``protocol`` when a run builds one,
and ``protocol`` reads ``options``, never ``spec``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hopnet.protocols.allreduce.options import AllReduceOptions

if TYPE_CHECKING:
    from hopnet.protocols.allreduce.protocol import AllReduceProtocol


def __getattr__(name: str) -> object:
    """``from hopnet.protocols.allreduce import AllReduceProtocol`` imports the algorithm (torch) only when asked."""
    if name == "AllReduceProtocol":
        from hopnet.protocols.allreduce.protocol import AllReduceProtocol

        return AllReduceProtocol
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AllReduceOptions", "AllReduceProtocol"]

"""scaled-mean's options: read by the declaration and the algorithm alike. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from hopnet.options import ProtocolOptions, option

NAME = "scaled-mean"


@dataclass(frozen=True)
class ScaledMeanOptions(ProtocolOptions):
    scale_by: float = option(1.0, minimum=0, metavar="X", help="multiply the averaged gradient by X")


__all__ = ["NAME", "ScaledMeanOptions"]

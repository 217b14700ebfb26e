"""Pipe-SGD's options and message kinds: what the algorithm and the declaration (:mod:`.spec`)
both read. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from hopnet.options import option
from hopnet.protocols.compression import COMPRESSIONS
from hopnet.protocols.gradient_options import BucketOptions

DEFAULT_PIPELINE_K = 2


@dataclass(frozen=True)
class PipeSgdOptions(BucketOptions):
    pipeline_k: int = option(DEFAULT_PIPELINE_K, minimum=1, metavar="K",
                             help="each step applies the averaged gradient of K-1 iterations earlier while the "
                                  "newer all-reduces run behind the compute (Algorithm 1's g[t-K]); 1 is "
                                  "synchronous")
    compress: str = option("none", choices=COMPRESSIONS,
                           help="compress every hop of the ring: trunc16 keeps the top 16 bits of each float32 "
                                "(2x fewer bytes), int8 quantizes with scale max|block|/127 (4x)")


__all__ = ["DEFAULT_PIPELINE_K", "PipeSgdOptions"]

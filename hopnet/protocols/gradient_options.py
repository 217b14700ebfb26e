"""The options every gradient-averaging protocol shares (allreduce, eager-sgd, pipe-sgd).

``--buffers`` is explained in :mod:`hopnet.protocols.buffer_sync`, ``--bucket-mb`` in
:mod:`hopnet.protocols.overlap`; both modules re-export what is declared here.
"""

from __future__ import annotations

from dataclasses import dataclass

from hopnet.options import ProtocolOptions, option

BUFFER_MODES = ("broadcast", "average", "local")
DEFAULT_BUCKET_MB = 25.0


@dataclass(frozen=True)
class GradientOptions(ProtocolOptions):
    """The options every protocol that averages gradients takes."""

    buffers: str = option("broadcast", choices=BUFFER_MODES,
                          help="keep the model's floating buffers (BatchNorm statistics) in step after each step: "
                               "broadcast rank 0's (as torch DDP does), average them, or keep them local")


@dataclass(frozen=True)
class BucketOptions(GradientOptions):
    """The options of the gradient protocols that can reduce during the backward pass."""

    bucket_mb: float = option(DEFAULT_BUCKET_MB, minimum=0, metavar="MB",
                              help="all-reduce the gradient in buckets of at most this many MiB while the backward "
                                   "pass runs, as torch DDP's bucket_cap_mb (pipe-sgd: with --pipeline-k 1 only); "
                                   "0: one all-reduce after it")


__all__ = ["BUFFER_MODES", "DEFAULT_BUCKET_MB", "BucketOptions", "GradientOptions"]

"""Pipe-SGD's declaration (:mod:`hopnet.protocols.pipesgd` is the algorithm)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hopnet.config import ProtocolConfig
from hopnet.options import option
from hopnet.output_spec import Count, OutputSpec, Wait
from hopnet.protocols.specs.compression import COMPRESSIONS
from hopnet.protocols.specs.gradient_options import BucketOptions
from hopnet.registry import Averages, ProtocolSpec, register

if TYPE_CHECKING:
    import torch

    from hopnet.model_state import ModelState
    from hopnet.params import FlatGradients
    from hopnet.protocols.base import Protocol

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


def _build(config: ProtocolConfig, options: PipeSgdOptions, model: ModelState | None,
           grads: FlatGradients | torch.Tensor | None) -> Protocol:
    from hopnet.protocols.pipesgd import PipeSgdProtocol

    return PipeSgdProtocol(config, options, grads, model)


PIPE_SGD_OUTPUT = OutputSpec(
    waits=(Wait("wait_updates_s", "wait for all-reduce", "wait all-reduce"),),
    counts=(Count("pipeline_k", "pipeline depth", "max"), Count("mean_in_flight", "all-reduces in flight", "mean"),
            Count("overlapped", "reduced in backward", in_summary=False),
            Count("issued_in_backward", "issued by backward thread", in_summary=False),
            Count("applied", "gradients applied", in_summary=False),
            Count("discarded", "gradients discarded", in_summary=False)))


register(ProtocolSpec(
    name="pipe-sgd",
    summary="Pipe-SGD: the all-reduce of the gradients, pipelined K deep behind the compute "
            "(--pipeline-k, --compress).",
    options=PipeSgdOptions,
    build=_build,
    averages=Averages.GRADIENTS,
    uses_graph=False,
    resumable=True,
    restartable=True,
    output=PIPE_SGD_OUTPUT,
))

__all__ = ["COMPRESSIONS", "DEFAULT_PIPELINE_K", "PipeSgdOptions"]

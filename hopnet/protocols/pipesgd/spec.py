"""Pipe-SGD's declaration (:mod:`hopnet.protocols.pipesgd.protocol` is the algorithm)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hopnet.config import ProtocolConfig
from hopnet.output_spec import Count, OutputSpec, Wait
from hopnet.registry import Averages, ProtocolSpec, register
from hopnet.protocols.pipesgd.options import PipeSgdOptions

if TYPE_CHECKING:
    import torch

    from hopnet.model_state import ModelState
    from hopnet.params import FlatGradients
    from hopnet.protocols.base import Protocol


def _build(config: ProtocolConfig, options: PipeSgdOptions, model: ModelState | None,
           grads: FlatGradients | torch.Tensor | None) -> Protocol:
    from hopnet.protocols.pipesgd.protocol import PipeSgdProtocol

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
    between_replicas=True,
    summary="Pipe-SGD: the all-reduce of the gradients, pipelined K deep behind the compute "
            "(--pipeline-k, --compress).",
    options=PipeSgdOptions,
    build=_build,
    averages=Averages.GRADIENTS,
    uses_graph=False,
    resumable=True,
    restartable=True,
    restarts_replicas=True,
    output=PIPE_SGD_OUTPUT,
))


"""allreduce's declaration (:mod:`hopnet.protocols.allreduce.protocol` is the algorithm)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hopnet.config import ProtocolConfig
from hopnet.output_spec import Count, OutputSpec, Wait
from hopnet.registry import Averages, ProtocolSpec, register
from hopnet.protocols.allreduce.options import AllReduceOptions

if TYPE_CHECKING:
    import torch

    from hopnet.model_state import ModelState
    from hopnet.params import FlatGradients
    from hopnet.protocols.base import Protocol


def _build(config: ProtocolConfig, options: AllReduceOptions, model: ModelState | None,
           grads: FlatGradients | torch.Tensor | None) -> Protocol:
    from hopnet.protocols.allreduce.protocol import AllReduceProtocol

    return AllReduceProtocol(config, grads, model, options)


ALLREDUCE_OUTPUT = OutputSpec(
    waits=(Wait("wait_updates_s", "wait for all-reduce", "wait all-reduce"),),
    counts=(Count("rounds", "rounds", "max", in_summary=False), Count("buckets", "buckets", "max", in_summary=False),
            Count("overlapped", "reduced in backward"),
            Count("issued_in_backward", "issued by backward thread", in_summary=False)))


register(ProtocolSpec(
    name="allreduce",
    between_replicas=True,
    summary="synchronous all-reduce of the gradients among all ranks (what torch DDP does); the graph plays "
            "no part in it.",
    options=AllReduceOptions,
    build=_build,
    averages=Averages.GRADIENTS,
    uses_graph=False,
    resumable=True,
    restartable=True,
    restarts_replicas=True,
    output=ALLREDUCE_OUTPUT,
))


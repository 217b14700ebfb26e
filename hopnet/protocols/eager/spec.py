"""eager-SGD's declaration (:mod:`hopnet.protocols.eager.protocol` is the algorithm)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hopnet.config import ProtocolConfig
from hopnet.output_spec import Count, OutputSpec, Wait
from hopnet.registry import Averages, MessageKind, ProtocolSpec, register
from hopnet.protocols.eager.options import ACTIVATION_KIND, EagerOptions

if TYPE_CHECKING:
    import torch

    from hopnet.model_state import ModelState
    from hopnet.params import FlatGradients
    from hopnet.protocols.base import Protocol


def _build(config: ProtocolConfig, options: EagerOptions, model: ModelState | None,
           grads: FlatGradients | torch.Tensor | None) -> Protocol:
    from hopnet.protocols.eager.protocol import EagerProtocol

    return EagerProtocol(config, options, model, grads)


EAGER_OUTPUT = OutputSpec(
    waits=(Wait("wait_updates_s", "wait for round", "wait round"),),
    counts=(Count("initiated", "rounds started", "per_rank"), Count("stale_calls", "late contributions"),
            Count("rounds", "rounds", "max", in_summary=False),
            Count("rounds_skipped", "rounds skipped", in_summary=False),
            Count("active_mean", "mean ranks active per round", "mean", in_summary=False)))


register(ProtocolSpec(
    name="eager-sgd",
    between_replicas=True,
    summary="eager-SGD's partial all-reduce of the gradients among all ranks (see --eager-mode).",
    options=EagerOptions,
    build=_build,
    averages=Averages.GRADIENTS,
    uses_graph=False,
    message_kinds=(MessageKind(ACTIVATION_KIND, any_rank=True),),
    resumable=True,
    restartable=True,
    lane_channels=2,
    output=EAGER_OUTPUT,
))


"""scaled-mean's declaration: the registry imports this module (and only this one) to know the protocol."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hopnet.registry import Averages, ProtocolSpec, register

from .options import NAME, ScaledMeanOptions

if TYPE_CHECKING:
    import torch

    from hopnet.config import ProtocolConfig
    from hopnet.model_state import ModelState
    from hopnet.params import FlatGradients
    from hopnet.protocols.base import Protocol


def build(config: ProtocolConfig, options: ScaledMeanOptions, model: ModelState | None,
          grads: FlatGradients | torch.Tensor | None) -> Protocol:
    from .protocol import ScaledMeanProtocol  # the algorithm imports torch: only a run loads it

    return ScaledMeanProtocol(config, options, grads)


register(ProtocolSpec(
    name=NAME,
    summary="all-reduce the gradients, then scale the mean (a toy: the adding-a-protocol walk-through).",
    options=ScaledMeanOptions,
    build=build,
    averages=Averages.GRADIENTS,
    uses_graph=False,
))

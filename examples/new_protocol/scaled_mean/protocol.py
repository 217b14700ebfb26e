"""scaled-mean's algorithm: the mean of every rank's gradient, scaled."""

from __future__ import annotations

import torch

from hopnet.config import ProtocolConfig
from hopnet.params import FlatGradients
from hopnet.protocols.base import ApplyFn
from hopnet.protocols.gradient import AllRanksGradientProtocol

from .options import NAME, ScaledMeanOptions


class ScaledMeanProtocol(AllRanksGradientProtocol):
    name = NAME

    def __init__(self, config: ProtocolConfig, options: ScaledMeanOptions,
                 grads: FlatGradients | torch.Tensor | None) -> None:
        super().__init__(config, grads)
        self.scale = options.scale_by

    async def finish_iteration(self, apply: ApplyFn | None, *, last: bool = False) -> None:
        k = self.iteration
        buffer = self.grads.gather() if isinstance(self.grads, FlatGradients) else self.grads
        assert buffer is not None
        await self.node.collective.allreduce(self.everyone, buffer, "mean", tag=f"scaled-mean/{k}")
        buffer.mul_(self.scale)  # every .grad is a view into the flat buffer
        if apply is not None:
            apply()
        self.node.iteration_done(k, self)
        if not last:
            self.iteration = k + 1
            self.node.entered(k + 1, self)

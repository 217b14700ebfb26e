"""Synchronous all-reduce: the baseline every other protocol is measured against.

What torch's DistributedDataParallel does, one flat tensor at a time. Every iteration,
every worker:

1. computes its gradients (the trainer's ``loss.backward()``, into the flat buffer);
2. all-reduces them (mean) among all ranks, tagged by the iteration;
3. applies them (the optimizer step).

All workers start from the same parameters (the trainer seeds its model the same way
on every rank), reduce to bit-identical gradients and apply the same step, so their
models stay identical. The communication graph plays no part: the all-reduce runs among
all ranks, in rank order, over the node's collective.
"""

from __future__ import annotations

from typing import Any

from hopnet.options import NoOptions
from hopnet.protocols.base import ApplyFn
from hopnet.protocols.gradient import AllRanksGradientProtocol
from hopnet.registry import Averages, ProtocolSpec, register

TAG_PREFIX = "allreduce"


class AllReduceProtocol(AllRanksGradientProtocol):
    name = "allreduce"

    async def synchronize(self) -> None:
        k = self.iteration
        if self.synchronized == k:
            return
        await self.node.collective.allreduce(self.everyone, self._gradient_buffer(), "mean", tag=f"{TAG_PREFIX}/{k}")
        self.synchronized = k

    async def finish_iteration(self, apply: ApplyFn | None, *, last: bool = False) -> None:
        k = self.iteration
        await self.synchronize()
        if apply is not None:
            apply()
        self.node.iteration_done(k, self)
        if last:
            return
        self.iteration = k + 1
        self.node.entered(k + 1, self)

    def summary(self) -> dict[str, Any]:
        return {"rounds": self.iteration + 1}


register(ProtocolSpec(
    name="allreduce",
    summary="synchronous all-reduce of the gradients among all ranks (what torch DDP does); the graph plays "
            "no part in it.",
    options=NoOptions,
    build=lambda config, options, params, grads: AllReduceProtocol(config, grads),
    averages=Averages.GRADIENTS,
    uses_graph=False,
))

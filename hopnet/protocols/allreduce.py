"""Synchronous all-reduce: the baseline every other protocol is measured against.

What torch's DistributedDataParallel does, one flat tensor at a time. Every iteration,
every worker:

1. computes its gradients (the trainer's ``loss.backward()``, into the flat buffer);
2. all-reduces them (mean) among all ranks, tagged by the iteration;
3. applies them (the optimizer step);
4. keeps the model's floating buffers in step (``--buffers``: rank 0's by default, as DDP).

All workers start from the same parameters (the trainer seeds its model the same way
on every rank), reduce to bit-identical gradients and apply the same step, so their
models stay identical. The communication graph plays no part: the all-reduce runs among
all ranks, in rank order, over the node's collective.
"""

from __future__ import annotations

from typing import Any

from hopnet.protocols.base import ApplyFn
from hopnet.protocols.buffer_sync import GradientOptions
from hopnet.protocols.gradient import AllRanksGradientProtocol
from hopnet.registry import Averages, ProtocolSpec, register

TAG_PREFIX = "allreduce"


class AllReduceProtocol(AllRanksGradientProtocol):
    name = "allreduce"

    async def synchronize(self) -> None:
        k = self.iteration
        if self.synchronized == k:
            return
        grads = self._gradient_buffer()
        await self.node.collective.allreduce(self.everyone, grads, "mean", tag=f"{TAG_PREFIX}/{k}")
        self._unpack_gradients(grads)
        self.synchronized = k

    async def finish_iteration(self, apply: ApplyFn | None, *, last: bool = False) -> None:
        k = self.iteration
        await self.synchronize()
        if apply is not None:
            apply()
        await self.buffer_sync.sync(self.node.collective, self.everyone, tag=f"{TAG_PREFIX}/{k}/buffers")
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
    options=GradientOptions,
    build=lambda config, options, model, grads: AllReduceProtocol(config, grads, model, options),
    averages=Averages.GRADIENTS,
    uses_graph=False,
    resumable=True,
))

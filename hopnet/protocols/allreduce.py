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

import torch

from hopnet.config import ProtocolConfig
from hopnet.errors import ConfigError
from hopnet.params import FlatGradients
from hopnet.protocols.base import ApplyFn, Protocol
from hopnet.wire import Header, Message

TAG_PREFIX = "allreduce"


class AllReduceProtocol(Protocol):
    name = "allreduce"

    def __init__(self, config: ProtocolConfig, grads: FlatGradients | torch.Tensor | None) -> None:
        super().__init__()
        if isinstance(grads, torch.Tensor) and (grads.dim() != 1 or not grads.is_contiguous()):
            raise ConfigError("the allreduce protocol reduces one flat, contiguous gradient buffer")
        self.config = config
        self.grads = grads
        self.everyone: tuple[int, ...] = ()
        self.left_early: dict[int, int] = {}

    def bind(self, node: Any) -> None:
        super().bind(node)
        self.rank = node.rank
        self.everyone = tuple(range(node.graph.n))

    async def start(self) -> None:
        self.node.entered(0, self)

    async def finish_iteration(self, apply: ApplyFn | None, *, last: bool = False) -> None:
        k = self.iteration
        await self.node.collective.allreduce(self.everyone, self._gradient_buffer(), "mean", tag=f"{TAG_PREFIX}/{k}")
        if apply is not None:
            apply()
        self.node.iteration_done(k, self)
        if last:
            return
        self.iteration = k + 1
        self.node.entered(k + 1, self)

    def _gradient_buffer(self) -> torch.Tensor:
        if isinstance(self.grads, FlatGradients):
            return self.grads.gather()
        if self.grads is None:
            raise ConfigError("--protocol allreduce averages gradients: start the worker with "
                              "hopnet.init(model), or give Worker a grads buffer")
        return self.grads

    async def stop(self) -> None:
        """Say goodbye to the ring neighbours, the only ranks that wait on this one's messages."""
        n = len(self.everyone)
        if n < 2:
            return
        for peer in {(self.rank - 1) % n, (self.rank + 1) % n}:
            if peer not in self.left_early:
                await self.node.connect_to([peer])
                self.node.post(Message("bye", self.rank, peer, self.iteration))
        await self.node.flush()

    def on_peer_departed(self, peer: int, last_iteration: int) -> None:
        self.left_early[peer] = last_iteration  # the collective fails the waits on it

    def buffers_for(self, header: Header) -> Any:
        return None

    def on_message(self, msg: Message) -> None:
        self.node.count_drop("unexpected_kind")

    def summary(self) -> dict[str, Any]:
        return {"rounds": self.iteration + 1}

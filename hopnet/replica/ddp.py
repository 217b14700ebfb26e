"""``--replica-mode ddp``: every member holds the whole model; the replica averages the gradient
in the backward pass, as DDP does, and each member's lane mixes one slice of the model.

The gradient: every parameter's post-accumulate hook queues one callback at the end of the
backward pass, which all-reduces hopnet's flat gradient buffer over the replica and divides
by its size (DDP's mean); inside ``no_sync()`` backward passes only accumulate, and the next
one outside it, or the step, averages the sum. Buffers follow DDP's rule: the first member's
are broadcast to the others before each step. The model: member ``m``'s lane mixes slice ``m``
of each flat (views: it lands in the model), and :func:`~hopnet.replica.shards.share_slices`
gives every member the others' slices before the optimizer step and after the step, so the
members' parameters are bit-identical at every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hopnet.errors import ConfigError
from hopnet.model_state import ModelState
from hopnet.params import FlatGradients
from hopnet.replica.base import ReplicaSync
from hopnet.replica.shards import bounds, lane_state, share_slices


class DdpReplica(ReplicaSync):
    mode = "ddp"

    def __init__(self, *, size: int, member: int, replica_index: int, group: Any, state: ModelState,
                 grads: FlatGradients, averages_models: bool) -> None:
        if grads.packed:
            raise ConfigError("--replica-mode ddp needs trainable parameters of one dtype")
        self.size, self.member, self.replica_index = size, member, replica_index
        self.group = group
        self.state = state
        self.grads = grads
        self.averages_models = averages_models
        self._first = dist.get_global_rank(group, 0)
        self._broadcast(state.flats)  # one starting model per replica, as DDP's constructor does
        self.lane_model = lane_state(state, size, member)
        start, stop = bounds(grads.buffer.numel(), size, member)
        self.lane_grads = grads.buffer[start:stop]
        self._deferred = False
        self._queued = False
        self._accumulated = False  # a backward pass added to the gradient since it was last averaged
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in grads.params]

    # ------------------------------------------------------------------ the backward pass
    def _on_gradient(self, _param: torch.Tensor) -> None:
        self._accumulated = True
        if self._deferred or self._queued:
            return
        self._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._average)  # type: ignore[attr-defined]

    def _average(self) -> None:
        self._queued = False
        if self._deferred:
            return
        with self.timed():
            buffer = self.grads.gather()
            dist.all_reduce(buffer, group=self.group)
            buffer.div_(self.size)
        self._accumulated = False

    def deferring(self, deferred: bool) -> None:
        self._deferred = deferred

    # ------------------------------------------------------------------ the step
    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        with self.timed():
            works = [dist.broadcast(t, src=self._first, group=self.group, async_op=True) for t in tensors if t.numel()]
            for work in works:
                work.wait()

    def _share(self, tensors: list[torch.Tensor]) -> None:
        with self.timed():
            share_slices(tensors, self.size, self.member, self.group)

    def before_step(self) -> None:
        self.report_time()
        if self._accumulated:  # a step after no_sync(): the sum is averaged now
            self._average()
        self._broadcast(self.state.buffers)

    def before_synchronize(self) -> None:
        if self._accumulated:
            self._average()

    def after_synchronize(self) -> None:
        self._share([self.grads.buffer])

    def wrap_apply(self, apply: Callable[[], None] | None) -> Callable[[], None] | None:
        if apply is None:
            return None

        def whole_then_apply() -> None:
            self._share(self.state.flats if self.averages_models else [self.grads.buffer])
            apply()
        return whole_then_apply

    def after_step(self, *, mixed: bool = False) -> None:
        if self._lanes_mixed() or mixed or self.averages_models or self.state.buffers:
            self._share(self.state.flats)

    def agree(self, ok: bool) -> bool:
        return ok  # every member applies the same averaged gradient: they agree already

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


__all__ = ["DdpReplica"]

"""Synchronous all-reduce: the baseline every other protocol is measured against.

What torch's DistributedDataParallel does, one flat tensor at a time. Every iteration,
every worker:

1. computes its gradients (the trainer's ``loss.backward()``, into the flat buffer);
2. all-reduces them (mean) among all ranks, tagged by the iteration: with ``--bucket-mb``
   (25 by default, as DDP's ``bucket_cap_mb``) in buckets while the backward pass still runs
   (:mod:`hopnet.protocols.overlap`), else (``--bucket-mb 0``, a bare gradient tensor,
   gradients of several dtypes, ``--max-restarts``) the whole buffer at the step;
3. applies them (the optimizer step);
4. keeps the model's floating buffers in step (``--buffers``: rank 0's by default, as DDP).

All workers start from the same parameters (the trainer seeds its model the same way
on every rank), reduce to bit-identical gradients and apply the same step, so their
models stay identical. The communication graph plays no part: the all-reduce runs among
all ranks, in rank order, over the node's collective.

A dead worker replaced live (``hopnet launch --max-restarts``): a round that a dead member
broke cannot finish, and the ring may have finished it on some members and not on others.
Every member of a broken round puts its gradient back as it was, waits (``--timeout`` at
most) until the dead rank's replacement has joined, then all ranks, the replacement
included (at its first step, with the iteration and state its donor handed over),
*resynchronize*: they all-reduce their iterations, and the lowest rank of the furthest
iteration broadcasts its model (parameters and buffers). A member that was a step behind
first takes that rank's registered state (the optimizer's, an LR schedule's) and iteration;
its own step is void (recorded as ``iteration_voided``), and its gradient goes into no
round. The others retry the round. Rounds are tagged with the number of replacements every
rank has taken back (``Node.epoch``), so no chunk of a broken round mixes into a later one.
The models, the optimizer states and what the trainer steps after the optimizer are
identical again afterwards.

Its declaration (options, what it refuses, what it registers) is :mod:`hopnet.protocols.allreduce.spec`,
which imports no torch.
"""

from __future__ import annotations

from typing import Any

import torch

from hopnet.config import ProtocolConfig
from hopnet.errors import PeerFailure
from hopnet.model_state import ModelState
from hopnet.params import FlatGradients
from hopnet.protocols.base import ApplyFn
from hopnet.protocols.gradient import AllRanksGradientProtocol
from hopnet.protocols.gradient_options import BucketOptions, GradientOptions

__all__ = ["AllReduceProtocol"]

TAG_PREFIX = "allreduce"


class AllReduceProtocol(AllRanksGradientProtocol):
    name = "allreduce"

    tag_prefix = TAG_PREFIX

    def __init__(self, config: ProtocolConfig, grads: FlatGradients | torch.Tensor | None,
                 model: ModelState | None = None, options: GradientOptions | None = None) -> None:
        super().__init__(config, grads, model, options)
        self.bucket_mb = options.bucket_mb if isinstance(options, BucketOptions) else 0.0
        self.voided: int | None = None  # the iteration a resync found this worker behind in
        self._saved: torch.Tensor | None = None  # the gradient before its round (--max-restarts)

    async def synchronize(self) -> None:
        k = self.iteration
        if self.synchronized == k or self.voided is not None:
            # (voided: a resync moved this worker on within this step; its gradient, computed for the
            # void iteration, must not go into the others' round of the one it now stands at)
            return
        if self._reduced_in_backward():
            self.synchronized = k
            return
        grads = self._gradient_buffer()
        if self.node.max_restarts:
            if not await self._reduce_surviving(grads):
                return
        else:
            await self.node.collective.allreduce(self.everyone, grads, "mean", tag=self._tag(str(k)))
        self._unpack_gradients(grads)
        self.synchronized = k

    async def finish_iteration(self, apply: ApplyFn | None, *, last: bool = False) -> None:
        k = self.iteration
        await self.synchronize()
        if self.voided is not None:
            self._void()
            return
        if apply is not None:
            apply()
        try:
            await self.buffer_sync.sync(self.node.collective, self.everyone, tag=self._tag(f"{k}/buffers"))
            finished = True
        except PeerFailure as exc:
            if not self._survivable(exc):
                raise
            finished = False
        if not await self._every_lane_finished(finished):
            # The step is applied: this worker's model stands at k + 1. A replacement that took a
            # neighbour's model here stands at k, and the resync moves it on to k + 1 with it, its
            # step of k void (resyncing at k, it would run iteration k again, alone).
            if await self._resync(at=k + 1):
                self.node.iteration_done(k, self)
                self.node.entered(self.iteration, self)
                return
        self.node.iteration_done(k, self)
        if last:
            return
        self.iteration = k + 1
        self.node.entered(k + 1, self)

    # ------------------------------------------------------------------ replacements
    async def _reduce_surviving(self, grads: torch.Tensor) -> bool:
        """The round of this iteration's gradient, retried after a resync while members die and are
        replaced. False when the resync moved this worker on (its gradient is void)."""
        while True:
            k = self.iteration
            if self.resync_needed and await self._resync():
                self.voided = k
                return False
            if self._saved is None or self._saved.shape != grads.shape:
                self._saved = torch.empty_like(grads)
            self._saved.copy_(grads)
            try:
                await self.node.collective.allreduce(self.everyone, grads, "mean", tag=self._tag(str(self.iteration)))
                finished = True
            except PeerFailure as exc:
                if not self._survivable(exc):
                    raise
                finished = False
            if await self._every_lane_finished(finished):
                return True
            grads.copy_(self._saved)
            self.resync_needed = True

    def _void(self) -> None:
        """The resync found this worker a step behind: its iteration is void, it now is where the others are."""
        void, self.voided = self.voided, None
        self.node.record("iteration_voided", iter=void, to=self.iteration)
        self.node.entered(self.iteration, self)

    def summary(self) -> dict[str, Any]:
        return {"rounds": self.iteration + 1, **self.overlap_summary(),
                **({"resyncs": self.resyncs} if self.resyncs else {})}

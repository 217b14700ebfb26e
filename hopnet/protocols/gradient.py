"""What the protocols that all-reduce one flat gradient buffer among all ranks share.

``allreduce`` and ``pipe-sgd`` differ only in when a reduced gradient is applied; the
buffer they reduce, the model's floating buffers they keep in step (``--buffers``, see
:mod:`hopnet.protocols.buffer_sync`), how they leave (a goodbye to the ring neighbours,
the only ranks that wait on this one's messages) and the messages they take (none of
their own: the collective's go through the node's mailbox) are the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from typing import Any

import torch

from hopnet.collectives.base import Collective, IssueFn
from hopnet.config import ProtocolConfig
from hopnet.errors import ConfigError, PeerFailure
from hopnet.model_state import ModelState
from hopnet.params import FlatGradients
from hopnet.protocols.base import Protocol
from hopnet.protocols.resync import resynchronize
from hopnet.protocols.buffer_sync import BufferSync, GradientOptions
from hopnet.protocols.overlap import MB, BackwardReducer
from hopnet.runtime.services import AllReduce, NodeServices
from hopnet.wire import Header, Message


class AllRanksGradientProtocol(Protocol):
    """Base of the protocols that average ``grads`` among every rank of the run."""

    def __init__(self, config: ProtocolConfig, grads: FlatGradients | torch.Tensor | None,
                 model: ModelState | None = None, options: GradientOptions | None = None) -> None:
        super().__init__()
        if isinstance(grads, torch.Tensor) and (grads.dim() != 1 or not grads.is_contiguous()):
            raise ConfigError(f"the {self.name} protocol reduces one flat, contiguous gradient buffer")
        self.config = config
        self.grads = grads
        self.model_buffers = list(model.buffers) if model is not None else []
        self.buffers_mode = options.buffers if options is not None else "local"
        self.everyone: tuple[int, ...] = ()
        self.left_early: dict[int, int] = {}
        self.synchronized = -1
        """The last iteration whose gradient :meth:`synchronize` averaged (the trainer's call, or the step's)."""
        self.resync_needed = False  # a replacement joined, or a round broke: resynchronize before the next
        self.resyncs = 0
        self.bucket_mb = 0.0
        """``--bucket-mb`` where the protocol reduces during the backward pass (0: it does not)."""
        self.reducer: BackwardReducer | None = None
        """The hooks that reduce the gradient in buckets during the backward pass (``--bucket-mb``)."""
        self.overlapped = 0
        """Steps whose whole gradient the backward pass reduced (nothing left for the step)."""

    def bind(self, node: NodeServices) -> None:
        super().bind(node)
        self.rank = node.rank
        self.everyone = tuple(range(node.graph.n))
        self.buffer_sync = BufferSync(self.buffers_mode, self.model_buffers, self.rank, node.graph.n)

    async def start(self) -> None:
        self.node.entered(self.iteration, self)
        grads = self.grads
        # Not under --max-restarts: a round a dead member broke is retried whole, after a resync.
        if self.bucket_mb > 0 and isinstance(grads, FlatGradients) and not grads.packed \
                and not self.node.max_restarts and len(self.everyone) > 1 and self.reducer is None:
            self.reducer = BackwardReducer(grads, self.bucket_mb * MB, self._reduce_bucket, self._bucket_tag,
                                           asyncio.get_running_loop(), self._bucket_issuer)

    # ------------------------------------------------------------------ overlap with the backward pass
    def _overlap_collective(self) -> AllReduce:
        """What the buckets are reduced on."""
        return self.node.collective

    def _reduce_bucket(self, tensor: torch.Tensor, tag: str) -> Awaitable[torch.Tensor]:
        return self._overlap_collective().allreduce(self.everyone, tensor, "mean", tag=tag)

    def _bucket_issuer(self) -> IssueFn | None:
        """The buckets' reduces issued by the backward pass's own thread, where the collective can."""
        collective = self._overlap_collective()
        if not isinstance(collective, Collective) or not isinstance(self.grads, FlatGradients):
            return None
        return collective.issuer(self.everyone, "mean", self.grads.buffer.device)

    def _bucket_tag(self, backward: int, bucket: int) -> str:
        return self._tag(f"{self.iteration}/{backward}/{bucket}")

    def defer_gradient_sync(self, deferred: bool) -> None:
        if self.reducer is not None:
            self.reducer.enabled = not deferred

    def _reduced_in_backward(self) -> bool:
        """Whether the backward passes of this iteration reduced its gradient already, all of it (then
        the step reduces nothing more); consumes what they did. Raises what failed them."""
        reducer = self.reducer
        if reducer is None:
            return False
        error, reduced = reducer.error, reducer.reduced and not reducer.unreduced
        reducer.reset()
        if error is not None:
            raise error
        self.overlapped += reduced
        return reduced

    def overlap_summary(self) -> dict[str, Any]:
        """The ``stop`` record's account of the overlap (``--bucket-mb``): buckets, steps the backward
        pass reduced, and its rounds whose reduces it issued from its own thread (not the loop);
        nothing when this worker reduced at the step only."""
        if self.reducer is None:
            return {}
        return {"buckets": len(self.reducer.buckets), "overlapped": self.overlapped,
                "issued_in_backward": self.reducer.issued_rounds}

    def _close_reducer(self) -> None:
        if self.reducer is not None:
            self.reducer.close()

    def _gradient_buffer(self) -> torch.Tensor:
        if isinstance(self.grads, FlatGradients):
            return self.grads.gather()
        if self.grads is None:
            raise ConfigError(f"--protocol {self.name} averages gradients: start the worker with "
                              "hopnet.init(model), or give Worker a grads buffer")
        return self.grads

    def _unpack_gradients(self, reduced: torch.Tensor) -> None:
        """Gradients of several dtypes were reduced packed in one buffer: give each ``.grad`` its part."""
        if isinstance(self.grads, FlatGradients):
            self.grads.unpack(reduced)

    async def _say_goodbye(self) -> None:
        """Tell the ring neighbours, the only ranks that wait on this one's messages."""
        n = len(self.everyone)
        if n < 2:
            return
        await self.say_goodbye((peer for peer in {(self.rank - 1) % n, (self.rank + 1) % n}
                                if peer not in self.left_early), final_iteration=False)

    async def stop(self) -> None:
        self._close_reducer()
        await self._say_goodbye()

    def on_peer_departed(self, peer: int, last_iteration: int) -> None:
        self.left_early[peer] = last_iteration  # the collective fails the waits on it

    # ------------------------------------------------------------------ replacements (--max-restarts)
    tag_prefix = "grad"

    def _tag(self, what: str) -> str:
        """A round's tag; under ``--max-restarts`` with the replacements every rank took back
        (``Node.epoch``), so that no chunk of a round a dead member broke meets a retried one."""
        return f"{self.tag_prefix}/{what}@{self.node.epoch}" if self.node.max_restarts \
            else f"{self.tag_prefix}/{what}"

    def _survivable(self, failure: PeerFailure) -> bool:
        return bool(self.node.max_restarts) and failure.peer is not None and failure.peer != self.rank

    async def _every_lane_finished(self, finished: bool) -> bool:
        """Whether the round finished on every lane of this worker's replica group (under ``--max-restarts``;
        else on this one). A dead replica's processes die at different moments: one of them may have
        finished a round with a survivor's lane before it died, while its sibling broke the round on the
        survivor's other lane. The lanes then retry the round together, after a resync, or the replica's
        lanes would stand an iteration apart, each waiting in the other's collective."""
        lanes = self.node.lanes
        if lanes is None or not self.node.max_restarts:
            return finished
        return await lanes.least(int(finished)) == 1

    def on_peer_rejoined(self, peer: int) -> None:
        self.resync_needed = True
        self.left_early.pop(peer, None)

    def rejoin_at(self, iteration: int, state: Mapping[str, Any]) -> None:
        super().rejoin_at(iteration, state)
        self.resync_needed = True

    async def after_rejoin(self) -> None:
        """Nothing yet: the replacement resynchronizes at its first step (``resync_needed``), as a
        survivor does. It then finishes that iteration as the others do theirs (a void one when the
        resync finds it behind), so the trainer's own state stepped after the optimizer (an LR
        schedule, a loss scaler) stays in step with theirs, and the state it takes from the
        furthest rank loads into the trainer's registered objects (registered only after ``init``)."""

    async def _resync(self, at: int | None = None) -> bool:
        """Every rank takes the furthest rank's model and iteration (:mod:`hopnet.protocols.resync`).
        ``at``: the iteration this worker's model stands at, when its step of the current one is
        already applied (the next); by default the current one. Whether this worker was behind
        and moved on."""
        at = self.iteration if at is None else at
        done = await resynchronize(self.node, self.node.collective, self.everyone, at,
                                   self.model_tensors(), self._tag, self.config.timeout_s)
        self.resync_needed = False
        self.resyncs += 1
        if done.furthest <= at:
            return False
        self.iteration = done.furthest
        self.synchronized = -1
        return True

    def buffers_for(self, header: Header) -> Any:
        return None

    def on_message(self, msg: Message) -> None:
        self.node.count_drop("unexpected_kind")

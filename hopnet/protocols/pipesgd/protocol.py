"""Pipe-SGD (Li et al., NeurIPS'18, Algorithm 1): all-reduce pipelined K iterations deep.

The compute thread and the comm thread of Algorithm 1 are the trainer's thread and the
node's event loop. At the end of iteration ``t`` (numbered from 0, as ``worker.iterations``
yields them) every worker:

1. launches the all-reduce (mean) of its local gradient as a task on the loop, tagged
   ``pipe/{t}``, after the all-reduce of ``t-1`` (one at a time, in iteration order, as the
   paper's comm thread runs them);
2. waits for the all-reduce of iteration ``t+1-K``, makes its result the gradients the
   optimizer reads (each ``.grad``) and calls ``apply`` (the optimizer step);
3. returns to the trainer, which computes iteration ``t+1`` while the loop all-reduces the
   gradients of iterations ``t+2-K .. t``.

In the paper's numbering (iterations from 1, the update opening iteration ``t``) this is
``w[t] = w[t-1] - lr * g[t-K]``: the gradient computed at the parameters of iteration ``s``
is applied after iteration ``s+K-1``, a fixed staleness of ``K-1``, never a newer one even
when it is already there. ``K = 1`` waits for the iteration's own all-reduce: the
synchronous baseline, bit for bit ``--protocol allreduce``.

Warm-up: Algorithm 1 starts from ``g[1-K..0] = 0``. Here the first ``K-1`` steps have no
averaged gradient yet and call no ``apply`` at all: the same as a zero gradient for plain
SGD, and no spurious momentum or weight-decay step for other optimizers.

Drain: the last iteration applies the gradient of iteration ``T-K`` like any other, then
waits for the ``K-1`` all-reduces still in flight to finish on every member (so no peer
is left waiting on this one) and discards their results: every run makes ``T`` steps of
which ``T-K+1`` apply a gradient, as Algorithm 1 does for the same ``T``.

Buffers: with the model's flat gradients (``hopnet.init(model)``) the all-reduce of
iteration ``t`` runs in place on the buffer the trainer's backward filled, and step 2
rebinds every ``.grad`` to the buffer of ``t+1-K``'s result (:meth:`FlatGradients.rebind`),
which the next ``zero_grad``/``backward`` reuses: ``K`` buffers take turns and no gradient
is copied (two fewer model-sized copies per iteration than copying into a slot and back,
which on a busy CPU cost as much as a good part of the all-reduce; docs/performance/index.md,
"Pipe-SGD"). So a reference to a ``.grad`` tensor is good for one iteration only. A bare
gradient tensor (``Worker(grads=tensor)``) cannot move: it is copied into a slot and back.

Model buffers (``--buffers``, :mod:`hopnet.protocols.buffer_sync`): a copy of the floating
buffers taken at the end of iteration ``t`` is reduced (uncompressed) in the same chain, right
after ``pipe/{t}``, and written into the model when step 2 applies ``t``'s gradient: the buffers
lag ``K-1`` iterations, as the gradients do. The drain adopts the last one, so every rank ends
with the same buffers.

Overlap with the backward pass (``--bucket-mb``, :mod:`hopnet.protocols.overlap`): with ``K = 1``
the model's flat gradients are all-reduced in buckets while the backward pass runs, as under
``allreduce``; step 1 then launches only the model buffers' part of the chain. With ``K > 1`` the
option is ignored: the all-reduces already run behind the next iterations' compute.

Gradients of several dtypes (:attr:`FlatGradients.packed`) are reduced in one packed buffer
through a slot, like a bare tensor, and unpacked into the ``.grad`` views when applied.

Compression (``--compress trunc16|int8``) runs inside the ring, on every hop, through the
collective's codec hook; see :mod:`hopnet.collectives.compression`.

Its declaration (options, what it refuses, what it registers) is :mod:`hopnet.protocols.pipesgd.spec`,
which imports no torch.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from hopnet.collectives.ring import RingCollective
from hopnet.collectives.codec import IdentityCodec
from hopnet.collectives.compression import make_codec
from hopnet.config import ProtocolConfig
from hopnet.errors import ConfigError, PeerFailure
from hopnet.model_state import ModelState
from hopnet.params import FlatGradients
from hopnet.protocols.base import ApplyFn
from hopnet.protocols.gradient import AllRanksGradientProtocol
from hopnet.protocols.pipesgd.options import PipeSgdOptions
from hopnet.runtime.services import AllReduce

TAG_PREFIX = "pipe"


class PipeSgdProtocol(AllRanksGradientProtocol):
    name = "pipe-sgd"
    tag_prefix = TAG_PREFIX

    def __init__(self, config: ProtocolConfig, options: PipeSgdOptions,
                 grads: FlatGradients | torch.Tensor | None, model: ModelState | None = None) -> None:
        super().__init__(config, grads, model, options)
        self.options = options
        self.k = options.pipeline_k
        # K = 1 waits for the iteration's own all-reduce: it can run during the backward pass, in buckets.
        # K > 1 reduces behind the next iterations' compute, into buffers the step rotates.
        self.bucket_mb = options.bucket_mb if self.k == 1 else 0.0
        self.codec = make_codec(options.compress)
        self._slots: list[torch.Tensor] = []
        self._buffers: dict[int, torch.Tensor] = {}  # iteration -> the tensor its all-reduce reduces
        self._model_buffers: dict[int, list[torch.Tensor]] = {}  # iteration -> its copy of the model's buffers
        self._pool: list[torch.Tensor] = []  # flat-gradient buffers beyond the model's own
        self._reductions: dict[int, asyncio.Task[None]] = {}
        self._collective: AllReduce | None = None
        self.applied: list[int | None] = []
        """For each finished iteration, the iteration whose averaged gradient its step applied
        (None in the warm-up): the record a test reads to check Algorithm 1's schedule."""
        self.discarded = 0
        self.in_flight_total = 0  # all-reduces in flight at the end of each step, summed (the overlap)
        self.pipeline_start = 0
        """The first iteration whose gradient is applied: 0, or where a resync restarted the pipeline."""
        self.voided: int | None = None  # the iteration a resync threw away (--max-restarts)
        self._rejoined: int | None = None  # the last peer taken back (--max-restarts)
        self.comm_times: list[tuple[int, float, float, float]] = []
        """Per all-reduce ``(t, launched, began, ended)`` on ``node.timer`` (the system's monotonic
        clock in real runs, shared by the ranks of one machine): launched by the trainer's step,
        began once its predecessor finished, ended. bench/pipesgd.py splits the comm thread's
        time with it into waiting for the last member and the ring itself."""

    # ------------------------------------------------------------------ Algorithm 1
    async def synchronize(self) -> None:
        """Steps 1 and 2 up to ``apply``: launch iteration ``t``'s all-reduce, wait for ``t+1-K``'s
        and make it each ``.grad`` (zeros in the warm-up)."""
        t = self.iteration
        if self.synchronized == t or self.voided is not None:
            return
        grads = self._gradient_buffer()
        if self.resync_needed:
            await self._restart_pipeline(t)
            return
        if self.k == 1:
            await self._reduce_now(t, grads)
            return
        self._launch_allreduce(t, grads, reduced=self._reduced_in_backward())
        due = self.gradient_of(t)
        if due >= self.pipeline_start:
            try:
                await self._wait_for(due)
                finished = True
            except PeerFailure as exc:
                if not self._survivable(exc):
                    raise
                finished = False
            if not await self._every_lane_finished(finished):
                await self._restart_pipeline(t)
                return
            self._take_result(due, grads)
        else:
            self._take_result(None, grads)
        self.synchronized = t

    async def _reduce_now(self, t: int, grads: torch.Tensor) -> None:
        """K = 1: the iteration waits for its own all-reduce (nothing else is ever in flight), so it runs in
        this coroutine, not a task of its own chained and awaited through the clock (a few loop
        wake-ups less per iteration, which is what K = 1 lost to ``allreduce``, docs/performance/index.md, "Pipe-SGD")."""
        reduced = self._reduced_in_backward()
        slot = grads if self._zero_copy else self._slot(t, like=grads)
        if slot is not grads:
            slot.copy_(grads)
        self._buffers[t] = slot
        snapshot = self.buffer_sync.snapshot() if self.buffer_sync.active else None
        if snapshot is not None:
            self._model_buffers[t] = snapshot
        began = self.node.timer()
        try:
            await self._allreduce(t, slot, None, began, snapshot, reduced=reduced)
            finished = True
        except PeerFailure as exc:
            if not self._survivable(exc):
                raise
            finished = False
        finally:
            self.node.waited("updates", self.node.timer() - began)
        if not await self._every_lane_finished(finished):
            await self._restart_pipeline(t)
            return
        self._take_result(t, grads)
        self.synchronized = t

    def gradient_of(self, iteration: int) -> int:
        return iteration + 1 - self.k

    async def finish_iteration(self, apply: ApplyFn | None, *, last: bool = False) -> None:
        t = self.iteration
        await self.synchronize()
        if self.voided is not None:
            void, self.voided = self.voided, None
            self.node.record("iteration_voided", iter=void, to=self.iteration)
            self.node.entered(self.iteration, self)  # computed again, from the model the resync gave
            return
        due = self.gradient_of(t)
        if due >= self.pipeline_start:
            if apply is not None:
                apply()
            self.applied.append(due)
        else:
            self.applied.append(None)  # warm-up: g[1-K..0] = 0, no step
        self.in_flight_total += len(self._reductions)
        self.node.iteration_done(t, self)
        if last:
            await self._drain()
            return
        self.iteration = t + 1
        self.node.entered(t + 1, self)

    # ------------------------------------------------------------------ replacements (--max-restarts)
    async def _restart_pipeline(self, t: int) -> None:
        """A dead member broke the pipeline (or a replacement joined): drop every all-reduce in flight,
        resynchronize (every rank takes the furthest rank's model and iteration), and start the
        pipeline again from there, empty: this step is void, its iteration computed again, and the
        next ``K-1`` steps warm up as the first ones did. The gradients in flight are lost."""
        for task in self._reductions.values():
            task.cancel()
        if self._reductions:
            await asyncio.wait(list(self._reductions.values()), timeout=self.config.peer_timeout_s)
        self._reductions.clear()
        self._buffers.clear()
        for snapshot in self._model_buffers.values():
            self.buffer_sync.release(snapshot)
        self._model_buffers.clear()
        await self._resync()
        self.pipeline_start = self.iteration
        self.voided = t

    def resume_at(self, iteration: int) -> None:
        """Every rank resumes from its checkpoint of ``iteration - 1`` (the same model and optimizer
        state on all: they applied the same averaged gradients) with the pipeline empty: the ``K-1``
        all-reduces in flight at the kill are lost, and the next ``K-1`` steps warm up as the first
        ones did. With ``K = 1`` nothing is in flight between two steps: the resumed run is exact."""
        super().resume_at(iteration)
        self.pipeline_start = iteration

    def on_peer_rejoined(self, peer: int) -> None:
        super().on_peer_rejoined(peer)
        self._rejoined = peer

    def _launch_allreduce(self, t: int, grads: torch.Tensor, *, reduced: bool = False) -> None:
        """All-reduce iteration ``t``'s gradient on the loop, after ``t-1``'s (``reduced``: the backward
        pass did, in buckets; the model's buffers still go through the chain).

        With the model's flat gradients (:class:`FlatGradients`) the buffer the trainer filled
        is reduced in place and the ``.grad`` views move to another one (:meth:`_take_result`):
        no copy. A bare tensor is copied into a slot of its own first."""
        if self._zero_copy:
            slot = grads
        else:
            slot = self._slot(t, like=grads)
            slot.copy_(grads)
        self._buffers[t] = slot
        snapshot = self.buffer_sync.snapshot() if self.buffer_sync.active else None
        if snapshot is not None:
            self._model_buffers[t] = snapshot
        previous = self._reductions.get(t - 1)
        task = asyncio.get_running_loop().create_task(
            self._allreduce(t, slot, previous, self.node.timer(), snapshot, reduced=reduced),
            name=f"rank{self.rank}-pipe/{t}")
        task.add_done_callback(_retrieve)
        self._reductions[t] = task

    def _take_result(self, due: int | None, grads: torch.Tensor) -> None:
        """Put the averaged gradient of ``due`` where the optimizer reads it (None: warm-up).

        Flat gradients: rebind the ``.grad`` views to the result's buffer, which the trainer's
        next ``zero_grad``/``backward`` then reuses (its all-reduce is over); in the warm-up, to
        a fresh buffer, as the trainer's one is still in flight. At most ``K`` buffers exist."""
        result = self._buffers.pop(due) if due is not None else None
        if due is not None and due in self._model_buffers:
            self.buffer_sync.adopt(self._model_buffers.pop(due))
        if self._zero_copy:
            assert isinstance(self.grads, FlatGradients)
            if result is None:
                result = self._spare(grads)
            self.grads.rebind(result)
        elif result is not None:
            grads.copy_(result)
            self._unpack_gradients(grads)

    @property
    def _zero_copy(self) -> bool:
        """The model's flat gradients of one dtype: reduced in place and rebound, never copied."""
        return isinstance(self.grads, FlatGradients) and not self.grads.packed

    def _spare(self, like: torch.Tensor) -> torch.Tensor:
        in_use = {b.data_ptr() for b in self._buffers.values()}
        for buffer in self._pool:
            if buffer.data_ptr() not in in_use:
                return buffer.zero_()
        buffer = torch.zeros_like(like)
        self._pool.append(buffer)
        return buffer

    async def _allreduce(self, t: int, slot: torch.Tensor, previous: asyncio.Task[None] | None,
                         launched: float, model_buffers: list[torch.Tensor] | None = None, *,
                         reduced: bool = False) -> None:
        epoch = self.node.epoch
        tag = self._tag(str(t))  # tagged as launched: a round left over from before a replacement never runs
        if previous is not None:
            await asyncio.shield(previous)  # in iteration order; its failure is this one's too
        if self.node.epoch != epoch and self._rejoined is not None:
            raise PeerFailure(f"rank {self.rank}: rank {self._rejoined} was replaced while the all-reduce of "
                              f"iteration {t} waited for its turn", peer=self._rejoined, peer_state="dead")
        began = self.node.timer()
        if not reduced:
            await self.collective.allreduce(self.everyone, slot, "mean", tag=tag)
        self.comm_times.append((t, launched, began, self.node.timer()))
        if model_buffers is not None:  # uncompressed: running statistics are no gradient
            await self.buffer_sync.reduce(self.node.collective, self.everyone, model_buffers,
                                          tag=f"{tag}/buffers")

    async def _wait_for(self, t: int) -> None:
        task = self._reductions[t]
        began = self.node.timer()
        try:
            await self.node.clock.wait(asyncio.shield(task),
                                       f"the all-reduce of iteration {t}'s gradients ({TAG_PREFIX}/{t}, "
                                       f"rank {self.rank})", iteration=t)
        finally:
            self.node.waited("updates", self.node.timer() - began)
        del self._reductions[t]

    async def _drain(self) -> None:
        """Finish the all-reduces still in flight (the peers need this rank's part); apply none."""
        for t in sorted(self._reductions):
            await self._wait_for(t)
            self._buffers.pop(t, None)
            if t in self._model_buffers:  # the newest buffers, so every rank ends with the same ones
                self.buffer_sync.adopt(self._model_buffers.pop(t))
            self.discarded += 1

    def _slot(self, t: int, *, like: torch.Tensor | None = None) -> torch.Tensor:
        if not self._slots:
            assert like is not None
            self._slots = [torch.empty_like(like) for _ in range(self.k)]
        return self._slots[t % self.k]

    def _overlap_collective(self) -> AllReduce:
        return self.collective  # with --compress, the ring's codec

    @property
    def collective(self) -> AllReduce:
        if self._collective is None:
            base = self.node.collective
            if isinstance(self.codec, IdentityCodec):
                self._collective = base
            elif isinstance(base, RingCollective):
                self._collective = base.with_codec(self.codec)
            else:
                raise ConfigError(f"--compress {self.options.compress} needs a collective with a per-hop codec "
                                  f"(the ring); {type(base).__name__} has none")
        return self._collective

    # ------------------------------------------------------------------ leaving
    async def quiesce(self) -> None:
        """Finish the all-reduces still in flight, applying none (the last step drained them
        already; a loop that stopped without one did not)."""
        await self._drain()

    async def stop(self) -> None:
        """Abandon all-reduces left in flight (only on a failure path), then say goodbye to the
        ring neighbours, the only ranks that wait on this one's messages."""
        self._close_reducer()
        for task in self._reductions.values():
            task.cancel()
        if self._reductions:
            await asyncio.wait(list(self._reductions.values()))
            self._reductions.clear()
        await self._say_goodbye()

    def snapshot(self) -> dict[str, Any]:
        return {"grad_iter": self.applied[-1] if self.applied else None, "in_flight": len(self._reductions)}

    def summary(self) -> dict[str, Any]:
        return {"rounds": self.iteration + 1, "pipeline_k": self.k, "compress": self.options.compress,
                "applied": sum(1 for a in self.applied if a is not None), "discarded": self.discarded,
                "mean_in_flight": round(self.in_flight_total / len(self.applied), 3) if self.applied else None,
                **self.overlap_summary()}


def _retrieve(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()  # surfaced by _wait_for; retrieved here so asyncio does not log it twice


__all__ = ["PipeSgdProtocol"]

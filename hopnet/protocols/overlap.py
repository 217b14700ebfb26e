"""Reducing the gradient while the backward pass still runs, in buckets, as torch DDP does.

The flat gradient buffer (:class:`hopnet.params.FlatGradients`) is cut into buckets of at most
``cap_bytes``: contiguous slices, taken in reverse parameter order (the last layers' gradients
are ready first). Each parameter's ``register_post_accumulate_grad_hook`` marks it ready, on the
thread that runs the backward pass; a bucket whose parameters are all ready starts its
all-reduce at once on the node's event loop, in place on its slice, once every bucket before it
started (a torch.distributed collective needs the same order of calls on every member), without
waiting for those to end: the collective queues them.

Where the collective can (:meth:`hopnet.collectives.base.Collective.issuer`: torch.distributed's
groups, once formed) and the gradient is on the CPU, a round skips the loop altogether, as DDP
does: the hook that completes a bucket issues its reduce itself (gloo only enqueues it), and the
end of the backward pass waits for them in the trainer's thread. On a machine with fewer cores
than threads, each hand-off to the loop and back waits for a time slice. The first round, which
forms the group, and every round of a collective without an issuer (ZeroMQ's ring, a compressing
codec) go through the loop.

One backward pass is one *round*. Its first hook opens it and queues a callback at the end of
the backward pass (the autograd engine's ``queue_callback``, what DDP uses); that callback
marks the buckets of parameters the pass did not reach (their ``.grad`` is zeroed if it was
set to None) and waits for the round's reductions, as DDP's does: a second backward pass (gradient
accumulation) must not add into a slice still being reduced. An error of the round (a dead peer)
is kept and raised by the protocol's ``synchronize``, the trainer's step.

No overlap, and the protocol reduces the whole buffer at its step as before, when a backward
pass runs on the event loop's own thread (an :class:`hopnet.api.AsyncWorker` whose trainer
computes on the loop: waiting there would block the loop) or inside ``no_sync()``
(:attr:`BackwardReducer.enabled` false): :attr:`BackwardReducer.unreduced` then says the buffer
holds gradient that no round reduced. The hooks of CUDA parameters run on autograd's device
thread, not the one that called ``backward()``, so for those the loop's thread is looked at
instead: a pass is not overlapped while that thread is inside ``torch.autograd.backward``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hopnet.collectives.base import IssueFn, PendingReduce
from hopnet.params import FlatGradients
from hopnet.protocols.gradient_options import DEFAULT_BUCKET_MB, BucketOptions

MB = 1 << 20

ReduceFn = Callable[[torch.Tensor, str], Awaitable[Any]]
"""All-reduce (mean) a slice of the gradient buffer in place, under a tag."""
TagFn = Callable[[int, int], str]
"""The tag of round ``r``'s bucket ``b``."""
IssuerFn = Callable[[], IssueFn | None]
"""Asked when a round opens: a way to start the buckets' reduces from the backward pass's own
thread (:meth:`hopnet.collectives.base.Collective.issuer`), or None to reduce them on the loop."""


def in_backward(thread_id: int) -> bool:
    """Whether the thread ``thread_id`` is inside a backward pass (``Tensor.backward`` and
    ``torch.autograd.backward`` both enter through the latter)."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code is torch.autograd.backward.__code__:
            return True
        frame = frame.f_back
    return False


@dataclass(frozen=True)
class Bucket:
    """``buffer[start:stop]``, holding the gradients of parameters ``members`` (indices into
    ``FlatGradients.params``)."""

    start: int
    stop: int
    members: tuple[int, ...]


def plan_buckets(numels: Sequence[int], element_size: int, cap_bytes: float) -> list[Bucket]:
    """Buckets of at most ``cap_bytes`` (a parameter larger than that is a bucket alone) over
    parameters of ``numels`` elements laid out in order in one buffer, the last parameters first."""
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    buckets: list[Bucket] = []
    members: list[int] = []
    size = 0
    for i in reversed(range(len(numels))):
        if members and (size + numels[i]) * element_size > cap_bytes:
            buckets.append(Bucket(offsets[members[-1]], offsets[members[0] + 1], tuple(members)))
            members, size = [], 0
        members.append(i)
        size += numels[i]
    if members:
        buckets.append(Bucket(offsets[members[-1]], offsets[members[0] + 1], tuple(members)))
    return buckets


@dataclass
class _Round:
    """One backward pass's reduction: on the loop (``future``), or issued from the pass's thread (``issue``)."""

    left: list[int]  # per bucket: its parameters not yet ready
    fired: list[bool]  # per parameter: ready in this pass
    ready: list[asyncio.Event]  # per bucket, set on the loop
    future: concurrent.futures.Future[None] | None = field(default=None)
    issue: IssueFn | None = None
    number: int = 0  # among the step's rounds (the tags')
    issued: list[PendingReduce] = field(default_factory=list)  # buckets 0 .. len - 1
    error: BaseException | None = None  # what stopped the issuing


class BackwardReducer:
    """The gradient hooks of one worker's parameters, and the rounds they start (see the module)."""

    def __init__(self, grads: FlatGradients, cap_bytes: float, reduce: ReduceFn, tag: TagFn,
                 loop: asyncio.AbstractEventLoop, issuer: IssuerFn | None = None) -> None:
        """Built on ``loop``'s thread (the node's), whose backward passes are not overlapped.
        ``issuer``: see :data:`IssuerFn` (asked for CPU gradients only)."""
        self.grads = grads
        self.buckets = plan_buckets([p.numel() for p in grads.params], grads.buffer.element_size(), cap_bytes)
        self._bucket_of = [0] * len(grads.params)
        for b, bucket in enumerate(self.buckets):
            for i in bucket.members:
                self._bucket_of[i] = b
        self._reduce = reduce
        self._tag = tag
        self._issuer = issuer if grads.buffer.device.type == "cpu" else None
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._round: _Round | None = None
        self._rounds = 0  # rounds started since the last reset (numbers the tags)
        self.enabled = True
        """False inside ``no_sync()``: backward passes accumulate and reduce nothing."""
        self.reduced = False
        """A round finished since the last :meth:`reset`."""
        self.unreduced = False
        """A backward pass since the last :meth:`reset` added gradient that no round reduced."""
        self.error: BaseException | None = None
        """What failed a round since the last :meth:`reset` (raised by the protocol's synchronize)."""
        self.issued_rounds = 0
        """Rounds whose reduces the backward pass's thread issued itself (not the loop)."""
        self._closed = False
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(grads.params)]

    def close(self) -> None:
        """Remove the hooks: later backward passes leave the gradient to the step."""
        self._closed = True
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def reset(self) -> None:
        """The step consumed the gradient: start counting afresh (on the loop, the trainer blocked)."""
        self.reduced = self.unreduced = False
        self.error = None
        self._rounds = 0

    # ------------------------------------------------------------------ the trainer's thread
    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def ready(param: torch.Tensor) -> None:
            self._ready(index, param)
        return ready

    def _overlapping(self, param: torch.Tensor) -> bool:
        if not self.enabled or self._closed or self._loop.is_closed() or threading.get_ident() == self._loop_thread:
            return False
        # A device's hooks run on autograd's thread for it, whoever called backward(): if that is
        # the loop's thread, waiting for the loop at the end of the pass would never return. Looked
        # at once per pass (its first hook opens the round), not per parameter.
        return param.device.type == "cpu" or self._round is not None or not in_backward(self._loop_thread)

    def _ready(self, index: int, param: torch.Tensor) -> None:
        if not self._overlapping(param):
            self.unreduced = True
            return
        rnd = self._round
        if rnd is None or rnd.fired[index]:  # (fired: a pass that raised never reached its end)
            rnd = self._open_round()
        self._own_view(index)
        rnd.fired[index] = True
        b = self._bucket_of[index]
        rnd.left[b] -= 1
        if rnd.left[b] == 0:
            self._bucket_ready(rnd, b)

    def _bucket_ready(self, rnd: _Round, b: int) -> None:
        if rnd.issue is None:
            self._loop.call_soon_threadsafe(rnd.ready[b].set)
            return
        # In bucket order, the same on every member: this one and the ready ones after it.
        while rnd.error is None and len(rnd.issued) < len(self.buckets) and rnd.left[len(rnd.issued)] == 0:
            bucket = self.buckets[len(rnd.issued)]
            try:
                rnd.issued.append(rnd.issue(self.grads.buffer[bucket.start:bucket.stop],
                                            self._tag(rnd.number, len(rnd.issued))))
            except Exception as exc:
                rnd.error = exc

    def _own_view(self, index: int) -> None:
        """Make the parameter's ``.grad`` its view into the buffer again, if something replaced it."""
        param, view = self.grads.params[index], self.grads.views[index]
        grad = param.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
        else:
            return
        param.grad = view

    def _open_round(self) -> _Round:
        rnd = _Round(left=[len(b.members) for b in self.buckets], fired=[False] * len(self.grads.params),
                     ready=[asyncio.Event() for _ in self.buckets])
        rnd.issue = self._issuer() if self._issuer is not None else None
        if rnd.issue is not None:
            rnd.number = self._rounds
            self._rounds += 1
            self.issued_rounds += 1
        else:
            rnd.future = asyncio.run_coroutine_threadsafe(self._reduce_round(rnd), self._loop)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)  # type: ignore[attr-defined]
        self._round = rnd
        return rnd

    def _end_of_backward(self) -> None:
        rnd, self._round = self._round, None
        if rnd is None:
            return
        for b, bucket in enumerate(self.buckets):
            if rnd.left[b] == 0:
                continue
            for i in bucket.members:  # parameters this pass did not reach
                if not rnd.fired[i]:
                    self._own_view(i)
            rnd.left[b] = 0
            self._bucket_ready(rnd, b)
        try:
            if rnd.future is not None:
                rnd.future.result()
            else:
                self._wait_issued(rnd)
        except Exception as exc:  # raised at the step, where the trainer expects the run's errors
            self.error = exc
            return
        self.reduced = True
        self.unreduced = False  # a round reduces the whole buffer, what passes before it added too

    @staticmethod
    def _wait_issued(rnd: _Round) -> None:
        """Wait for every reduce the pass issued (none may still write into the buffer when the step
        reads it), then raise the first failure."""
        error = rnd.error
        for pending in rnd.issued:
            try:
                pending.wait()
            except Exception as exc:  # (a signal's exception, Ctrl-C, leaves the backward pass at once)
                error = error or exc
        if error is not None:
            raise error

    # ------------------------------------------------------------------ the loop
    async def _reduce_round(self, rnd: _Round) -> None:
        """Start each bucket's reduce as soon as it is ready and every bucket before it started
        (the same order of calls on every member), without waiting for the one before to end:
        a collective queues them, and the next runs the moment the last one ends."""
        number = self._rounds
        self._rounds += 1
        buffer = self.grads.buffer
        started: list[asyncio.Future[Any]] = []
        try:
            for b, bucket in enumerate(self.buckets):
                await rnd.ready[b].wait()
                started.append(asyncio.ensure_future(self._reduce(buffer[bucket.start:bucket.stop],
                                                                  self._tag(number, b))))
            await asyncio.gather(*started)
        finally:
            for reduce in started:
                reduce.cancel()
            if started:
                await asyncio.wait(started)


__all__ = ["DEFAULT_BUCKET_MB", "MB", "BackwardReducer", "Bucket", "BucketOptions", "plan_buckets"]

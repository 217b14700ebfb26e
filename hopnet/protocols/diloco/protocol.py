"""DiLoCo: local steps of the user's optimizer, then an outer step on the averaged pseudo-gradient
(Douillard et al., arXiv 2311.08105), optionally streamed in fragments (arXiv 2501.18512).

Every worker runs the trainer's own optimizer (the *inner* one) through the usual loop; the
model is not communicated between syncs. Every ``H`` iterations (``--local-steps``):

1. the pseudo-gradient ``delta = anchor - model`` (the round's start minus its end) is averaged
   among all ranks over the collective layer (mean all-reduce, ``--compress`` on every hop);
2. the *outer* optimizer applies the average to the round's start: SGD with momentum
   (``--outer-lr`` 0.7, ``--outer-momentum`` 0.9, Nesterov unless ``--no-outer-nesterov``),
   torch's SGD formula (``buf = mu * buf + delta``; ``update = delta + mu * buf`` with Nesterov,
   else ``buf``; ``anchor -= lr * update``);
3. the model and the next round's anchor both become that result.

Parameters and floating buffers (BatchNorm statistics) travel in the same all-reduce, one per
dtype: the buffers take the plain mean of the ranks' ends (``anchor - mean(delta)``), the outer
optimizer acts on the parameters only. Every member decodes the same reduced bytes and applies
the same deterministic outer step to the same anchor, so the models are bit-identical after
each sync. The first round starts from rank 0's parameters and the ranks' mean buffers, taken at
the first step before its inner step (that step's gradient was computed on the rank's own initial
model: the same one when the trainer seeds its model alike on every rank).

With ``H = 1``, ``--outer-lr 1`` and ``--outer-momentum 0`` the result is the mean of the ranks'
models after one inner step, which for plain SGD is the ``allreduce`` protocol's step.

**Streaming** (``--fragments F``): each flat tensor is cut into ``F`` contiguous fragments;
fragment ``f`` syncs after the iterations ``t`` with ``(t + 1 + f * H // F) % H == 0``, so the
fragments' syncs are staggered over the round and each moves ``1/F`` of the model. A fragment's
all-reduce runs in the background while the trainer goes on (``--overlap-steps D``, 1 by
default with fragments): its outer step is applied at the end of iteration ``t + D`` (the worker
waits there if the reduction has not landed). The fragment then becomes the outer result *plus the
inner steps this worker made on it during the D iterations*, and the anchor the outer result: no
inner step is lost or counted twice (the next pseudo-gradient holds them), and the ranks differ
only by their own last D steps on that fragment. ``D = 0``: the sync blocks the step.

Checkpoints and resume: the anchor, the outer momentum and the outer-step count are the protocol's
state in every checkpoint (:meth:`DiLoCoProtocol.state_dict`, saved beside the optimizer's). All
ranks resume from the same iteration with the same anchor; a fragment's reduction in flight at the
checkpoint is lost on every rank alike (its steps stay in the model and join the fragment's next
pseudo-gradient). A dead worker cannot be replaced live (``--max-restarts`` is refused): a
replacement would need the anchor and momentum the others hold, and the round it died in.

Failures: a dead, silent or departed rank fails the all-reduce waiting on it (named, after at most
``--timeout``), as under ``allreduce``.

Stragglers: every sync waits for every rank here; ``--outer-quorum P`` closes rounds over the first
``P`` ready workers instead (:mod:`hopnet.protocols.diloco.quorum`).

Its declaration (options, the sync schedule, the gap bound) is :mod:`hopnet.protocols.diloco.spec`,
which imports no torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hopnet.collectives.codec import IdentityCodec
from hopnet.collectives.compression import make_codec
from hopnet.collectives.ring import RingCollective
from hopnet.config import ProtocolConfig
from hopnet.errors import ConfigError
from hopnet.model_state import ModelState
from hopnet.protocols.base import ApplyFn, Protocol
from hopnet.protocols.diloco.options import DiLoCoOptions, sync_offsets
from hopnet.runtime.services import AllReduce, NodeServices
from hopnet.wire import Header, Message

TAG_PREFIX = "diloco"
ROOT = 0


class OuterSGD:
    """The outer optimizer: torch's SGD (no dampening, no weight decay) on the averaged pseudo-gradient,
    applied in place to the round's start."""

    def __init__(self, lr: float, momentum: float, nesterov: bool) -> None:
        self.lr = lr
        self.momentum = momentum
        self.nesterov = nesterov and momentum > 0

    def step(self, anchor: torch.Tensor, delta: torch.Tensor, buf: torch.Tensor) -> None:
        """``anchor -= lr * update(delta)``; ``buf``: these elements' momentum, updated in place."""
        if self.momentum > 0:
            buf.mul_(self.momentum).add_(delta)
            update = delta.add(buf, alpha=self.momentum) if self.nesterov else buf
        else:
            update = delta
        anchor.add_(update, alpha=-self.lr)


@dataclass(frozen=True)
class Piece:
    """A fragment's part of one flat tensor: elements ``[start, stop)`` of flat ``flat``, the
    parameters among them ``[start, params_stop)`` (the rest are floating buffers)."""

    flat: int
    start: int
    stop: int
    params_stop: int


def fragment_pieces(lengths: Sequence[int], params: Sequence[int], fragments: int) -> list[list[Piece]]:
    """Each flat (``lengths``, its first ``params`` elements parameters) cut into ``fragments``
    contiguous, near-equal pieces; fragment ``f`` is the ``f``-th piece of every flat."""
    out: list[list[Piece]] = [[] for _ in range(fragments)]
    for i, (n, p) in enumerate(zip(lengths, params)):
        bounds = [n * f // fragments for f in range(fragments + 1)]
        for f in range(fragments):
            a, b = bounds[f], bounds[f + 1]
            if b > a:
                out[f].append(Piece(i, a, b, min(max(p, a), b)))
    return out


@dataclass
class _Reduction:
    """A fragment's pseudo-gradient on its way: launched after iteration ``launched``."""

    fragment: int
    launched: int
    deltas: list[torch.Tensor]
    at_launch: list[torch.Tensor] | None
    """The fragment's pieces of the model at launch (overlap only): what the inner steps since changed."""
    task: asyncio.Task[None]


class DiLoCoProtocol(Protocol):
    name = "diloco"

    def __init__(self, config: ProtocolConfig, options: DiLoCoOptions, model: ModelState | torch.Tensor | None) -> None:
        super().__init__()
        state = ModelState.wrap(model)
        if state is None:
            raise ConfigError("--protocol diloco averages models: start the worker with hopnet.init(model), "
                              "or give Worker a params buffer")
        if any(f.dim() != 1 or not f.is_contiguous() or not f.is_floating_point() for f in state.flats):
            raise ConfigError("the diloco protocol averages flat, contiguous floating-point tensors")
        self.config = config
        self.options = options
        self.flats = state.flats
        self.h = options.local_steps
        self.overlap = options.overlap()
        self.outer = OuterSGD(options.outer_lr, options.outer_momentum, options.outer_nesterov)
        self.offsets = sync_offsets(self.h, options.fragments)
        self.param_lengths = _param_lengths(state)
        self.pieces = fragment_pieces([f.numel() for f in self.flats], self.param_lengths, options.fragments)
        self.anchor: list[torch.Tensor] = []
        self.momentum: list[torch.Tensor] = []
        self.outer_steps = 0
        """Fragment syncs applied (one per fragment per round)."""
        self.rounds_lost = 0
        self._pending: dict[int, list[_Reduction]] = {}  # due iteration -> reductions to land then
        self._last_task: asyncio.Task[None] | None = None
        self._collective: AllReduce | None = None
        self.everyone: tuple[int, ...] = ()

    def bind(self, node: NodeServices) -> None:
        super().bind(node)
        self.rank = node.rank
        self.everyone = tuple(range(node.graph.n))

    @property
    def collective(self) -> AllReduce:
        if self._collective is None:
            base = self.node.collective
            codec = make_codec(self.options.compress)
            if isinstance(codec, IdentityCodec):
                self._collective = base
            elif isinstance(base, RingCollective):
                self._collective = base.with_codec(codec)
            else:
                raise ConfigError(f"--compress {self.options.compress} needs a collective with a per-hop codec "
                                  f"(the ring); {type(base).__name__} has none")
        return self._collective

    # ------------------------------------------------------------------ start
    async def start(self) -> None:
        self.node.entered(self.iteration, self)

    async def _first_anchor(self) -> None:
        """Every rank starts the first round from rank 0's parameters and the mean of the ranks' buffers,
        taken at the first step before its inner step (the trainer may load weights until it starts,
        and its forward pass writes the buffers meanwhile). Not when resuming: the checkpoint holds
        the anchor every rank shares."""
        if len(self.everyone) > 1:
            for i, (flat, n) in enumerate(zip(self.flats, self.param_lengths)):
                params, buffers = flat[:n], flat[n:]
                if params.numel():
                    if self.rank != ROOT:
                        params.zero_()
                    await self.node.collective.allreduce(self.everyone, params, "sum", tag=f"{TAG_PREFIX}/start/{i}")
                if buffers.numel():  # the first forward pass wrote them: their mean, as a sync would take
                    await self.node.collective.allreduce(self.everyone, buffers, "mean",
                                                         tag=f"{TAG_PREFIX}/start/{i}/buffers")
        self.anchor = [flat.detach().clone() for flat in self.flats]
        self.momentum = [torch.zeros_like(flat) for flat in self.flats]

    def view_change_iteration(self, candidate: int) -> int:
        """An outer round's first iteration: the model is the shared outer result there."""
        return -(-candidate // self.h) * self.h

    # ------------------------------------------------------------------ the step
    def syncs_after(self, iteration: int) -> list[int]:
        """The fragments whose round ends with ``iteration``."""
        return [f for f, off in enumerate(self.offsets) if (iteration + 1 + off) % self.h == 0]

    async def finish_iteration(self, apply: ApplyFn | None, *, last: bool = False) -> None:
        k = self.iteration
        if not self.anchor:
            await self._first_anchor()
        if apply is not None:
            apply()
        for reduction in self._pending.pop(k, []):
            await self._land(reduction, k)
        if last:  # every fragment syncs at the run's last iteration: every rank ends with the anchor
            await self._drain(k)
            for f in range(len(self.pieces)):
                await self._land(self._launch(f, k, overlap=False), k)
        for f in [] if last else self.syncs_after(k):
            reduction = self._launch(f, k)
            if self.overlap == 0:
                await self._land(reduction, k)
            else:
                self._pending.setdefault(k + self.overlap, []).append(reduction)
        self.node.iteration_done(k, self)
        if last:
            return
        self.iteration = k + 1
        self.node.entered(k + 1, self)

    def _launch(self, fragment: int, k: int, *, overlap: bool = True) -> _Reduction:
        """Start averaging ``fragment``'s pseudo-gradient, behind the reductions already running
        (``overlap``: the inner steps go on while it runs, under ``--overlap-steps``)."""
        pieces = self.pieces[fragment]
        deltas = [self.anchor[p.flat][p.start:p.stop] - self.flats[p.flat][p.start:p.stop] for p in pieces]
        at_launch = [self.flats[p.flat][p.start:p.stop].clone() for p in pieces] \
            if overlap and self.overlap else None
        task = asyncio.get_running_loop().create_task(self._reduce(fragment, k, deltas, self._last_task),
                                                      name=f"rank{self.rank}-{TAG_PREFIX}/{k}/{fragment}")
        task.add_done_callback(_retrieve)
        self._last_task = task
        return _Reduction(fragment, k, deltas, at_launch, task)

    async def _reduce(self, fragment: int, k: int, deltas: list[torch.Tensor],
                      previous: asyncio.Task[None] | None) -> None:
        if previous is not None:
            await asyncio.shield(previous)  # in launch order on every rank; its failure is this one's too
        for i, delta in enumerate(deltas):
            await self.collective.allreduce(self.everyone, delta, "mean", tag=f"{TAG_PREFIX}/{k}/{fragment}/{i}")

    async def _land(self, reduction: _Reduction, k: int) -> None:
        """Wait for ``reduction`` and apply its outer step to the anchor and the model."""
        began = self.node.timer()
        try:
            await self.node.clock.wait(asyncio.shield(reduction.task),
                                       f"the all-reduce of fragment {reduction.fragment}'s pseudo-gradient "
                                       f"({TAG_PREFIX}/{reduction.launched}, rank {self.rank})", iteration=k)
        finally:
            self.node.waited("updates", self.node.timer() - began)
        for n, (piece, delta) in enumerate(zip(self.pieces[reduction.fragment], reduction.deltas)):
            anchor = self._outer_step(piece, delta)
            live = self.flats[piece.flat][piece.start:piece.stop]
            if reduction.at_launch is None:
                live.copy_(anchor)
            else:  # keep the inner steps made on the fragment while its reduction ran
                live.sub_(reduction.at_launch[n]).add_(anchor)
        self.outer_steps += 1
        if reduction.task is self._last_task:
            self._last_task = None

    def _outer_step(self, piece: Piece, delta: torch.Tensor) -> torch.Tensor:
        """Apply the mean pseudo-gradient ``delta`` of ``piece`` to the anchor; the anchor's piece."""
        anchor = self.anchor[piece.flat][piece.start:piece.stop]
        p = piece.params_stop - piece.start
        self.outer.step(anchor[:p], delta[:p], self.momentum[piece.flat][piece.start:piece.params_stop])
        anchor[p:].sub_(delta[p:])  # buffers: the mean of the ranks' ends
        return anchor

    async def _drain(self, k: int) -> None:
        """Land every reduction still in flight (training ends here: the peers need this rank's part)."""
        for due in sorted(self._pending):
            for reduction in self._pending.pop(due):
                await self._land(reduction, k)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self) -> DiLoCoProtocol:
        return self

    def state_dict(self) -> dict[str, Any]:
        """The outer optimizer's state: the anchor (the last outer result every rank shares), the
        momentum, and the count of outer steps."""
        return {"anchor": self.anchor, "momentum": self.momentum, "outer_steps": self.outer_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        anchor, momentum = list(state["anchor"]), list(state["momentum"])
        shapes = [f.shape for f in self.flats]
        if [a.shape for a in anchor] != shapes or [m.shape for m in momentum] != shapes:
            raise ConfigError("--protocol diloco: the checkpoint's outer state does not fit this model")
        self.anchor = [a.to(f.device, f.dtype).clone() for a, f in zip(anchor, self.flats)]
        self.momentum = [m.to(f.device, f.dtype).clone() for m, f in zip(momentum, self.flats)]
        self.outer_steps = int(state["outer_steps"])

    # ------------------------------------------------------------------ leaving
    async def quiesce(self) -> None:
        await self._drain(self.iteration)

    async def stop(self) -> None:
        """Abandon reductions left in flight (a failure path), say goodbye to the ring neighbours."""
        tasks = [r.task for due in self._pending.values() for r in due]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self.rounds_lost += len(tasks)
        self._pending.clear()
        n = len(self.everyone)
        if n > 1:
            await self.say_goodbye({(self.rank - 1) % n, (self.rank + 1) % n}, final_iteration=False)

    def buffers_for(self, header: Header) -> Any:
        return None

    def on_message(self, msg: Message) -> None:
        self.node.count_drop("unexpected_kind")

    def snapshot(self) -> dict[str, Any]:
        return {"outer_steps": self.outer_steps, "in_flight": sum(len(r) for r in self._pending.values())}

    def summary(self) -> dict[str, Any]:
        return {"rounds": self.outer_steps // max(1, self.options.fragments), "outer_steps": self.outer_steps,
                "local_steps": self.h, "fragments": self.options.fragments, "compress": self.options.compress}


def _param_lengths(state: ModelState) -> list[int]:
    """How many leading elements of each flat are parameters (the rest are floating buffers)."""
    lengths = []
    for flat in state.flats:
        ptr = flat.untyped_storage().data_ptr()
        lengths.append(sum(p.numel() for p in state.params if p.untyped_storage().data_ptr() == ptr))
    return lengths


def _retrieve(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()  # raised where the reduction is landed; retrieved here so asyncio does not log it


__all__ = ["ROOT", "TAG_PREFIX", "DiLoCoProtocol", "OuterSGD", "Piece", "fragment_pieces"]

"""eager-SGD between replica groups: the lanes of a replica put the same calls' gradients into each
round and take the same round's result.

Alone, a rank adds its gradient to ``pend`` when the trainer calls, and a round carries whatever
``pend`` holds when its activation arrives; the call then takes the newest finished round, or
waits for the next. Each lane of a replica would see the activations and the trainer's calls in
its own order, so its shard would mix other gradients than its sibling lanes' shards. Here:

* **What a round carries.** A call's gradient is *held*, not added. At a round's start the lanes
  agree (``least``, on the agreement's second group: the round engine's order) how many of the
  held gradients every lane has, and move exactly those into the round, oldest first.
* **Which result a call takes.** Each lane proposes what it would take alone (the newest
  finished round if one finished since the last take, else the next round); the lanes take the
  newest of the proposals (``least_each`` of the negated values, on the first group: the trainer's
  order). A lane that has not finished that round waits for it. Results are kept from the
  lowest round a call in flight may still be given.

The lanes thus agree on everything a round's content and a call's result depend on; when an
activation reaches each of them changes only how long they wait.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from hopnet.errors import ConfigError
from hopnet.runtime.services import ReplicaLanes


@dataclass
class Held:
    """A call's gradient (and the buffers the trainer's model had then), not yet in a round."""

    gradient: torch.Tensor
    buffers: list[torch.Tensor] | None


@dataclass
class Result:
    """A finished round's mean gradient and reduced buffers, and how many calls had gone into
    rounds by then (a call whose gradient is not among them took a stale result)."""

    gradient: torch.Tensor
    buffers: list[torch.Tensor] | None
    calls_in: int


@dataclass(frozen=True)
class Target:
    round_id: int
    """The round whose result every lane's call takes."""
    finished_somewhere: bool
    """Some lane of the replica has finished it: it was requested in that lane's group."""


class ReplicaRounds:
    """One lane's side of the agreements (see the module's docstring)."""

    def __init__(self, lanes: ReplicaLanes) -> None:
        if lanes.side is None:
            raise ConfigError("eager-sgd between replica groups needs a second agreement group "
                              "(its spec's lane_channels)")
        self.lanes = lanes
        self.side: ReplicaLanes = lanes.side
        self.held: deque[Held] = deque()
        self.calls_in = 0
        """Calls whose gradients went into rounds (the same on every lane once a round's start is agreed)."""
        self.results: dict[int, Result] = {}
        self._keep_from: int | None = None
        self._free: list[torch.Tensor] = []
        """Gradient-sized tensors no longer used (held gradients moved, results taken or dropped): the
        next hold or round takes one instead of allocating on every step."""

    def hold(self, gradient: torch.Tensor, buffers: list[torch.Tensor] | None) -> None:
        copy = self._free.pop() if self._free else torch.empty_like(gradient)
        self.held.append(Held(copy.copy_(gradient), buffers))

    def release(self, tensor: torch.Tensor) -> None:
        """``tensor`` (a moved held gradient, a taken result) is free for reuse."""
        self._free.append(tensor)

    def spare_like(self, like: torch.Tensor) -> torch.Tensor:
        """A zeroed tensor for the next round's pending sum."""
        return self._free.pop().zero_() if self._free else torch.zeros_like(like)

    async def agreed_moves(self) -> list[Held]:
        """At a round's start: the held gradients every lane has (oldest first), taken out."""
        count = await self.side.least(len(self.held))
        moved = [self.held.popleft() for _ in range(count)]
        self.calls_in += count
        return moved

    def keep(self, round_id: int, gradient: torch.Tensor, buffers: list[torch.Tensor] | None,
             executed: int) -> list[list[torch.Tensor]]:
        """Keep a finished round's result; returns the buffers of the results no call can be given any
        more (their gradients are reused here)."""
        self.results[round_id] = Result(gradient, buffers, self.calls_in)
        return self._prune(executed)

    async def agreed_target(self, executed: int, consumed: int) -> Target:
        """The trainer's call: the round whose result every lane takes."""
        proposal = max(executed - 1, consumed)
        self._keep_from = proposal  # the target is at least this lane's proposal
        newest, finished = await self.lanes.least_each([-proposal, -(executed - 1)])
        return Target(-newest, -newest <= -finished)

    def take(self, round_id: int, executed: int) -> tuple[Result, list[list[torch.Tensor]]]:
        """The result of ``round_id`` (finished here; :meth:`release` its gradient once read), and the
        buffers of the results no call can be given any more."""
        result = self.results.pop(round_id)
        self._keep_from = None
        return result, self._prune(executed)

    def _prune(self, executed: int) -> list[list[torch.Tensor]]:
        # A later call proposes at least the newest round finished by then, so only what a call in
        # flight may be given, or the newest, is kept.
        floor = self._keep_from if self._keep_from is not None else executed - 1
        buffers = []
        for round_id in [r for r in self.results if r < floor]:
            dropped = self.results.pop(round_id)
            self.release(dropped.gradient)
            if dropped.buffers is not None:
                buffers.append(dropped.buffers)
        return buffers


__all__ = ["Held", "ReplicaRounds", "Result", "Target"]

"""One all-reduce API for every protocol that reduces among a group of ranks.

A group is an ordered tuple of global ranks. Every member calls
``await collective.allreduce(group, tensor, op, tag=...)`` with the same group, the same
tag and a tensor of the same shape and dtype; the call reduces in place and returns the
tensor once this member holds the result. Results are bitwise identical on every member.

The ``tag`` keeps groups apart: two all-reduces with different tags never mix, whether
they run concurrently (disjoint groups) or back to back (the same group, round after
round). Protocols build tags from what identifies the round, e.g. ``f"prague/{gid}"`` or
``f"ar/{iteration}"``. Ranks outside the group take no part and are never touched.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from hopnet.errors import ConfigError
from hopnet.runtime.services import ReduceOp

REDUCE_OPS: tuple[str, ...] = ("mean", "sum")


def check_group(group: Sequence[int], rank: int, world_size: int) -> tuple[int, ...]:
    """The group as a tuple, checked: distinct ranks in range, this rank among them."""
    members = tuple(int(r) for r in group)
    if not members:
        raise ConfigError("an all-reduce group needs at least one rank")
    if len(set(members)) != len(members):
        raise ConfigError(f"all-reduce group {list(members)} names a rank twice")
    bad = [r for r in members if not 0 <= r < world_size]
    if bad:
        raise ConfigError(f"all-reduce group {list(members)}: rank {bad[0]} out of range ({world_size} workers)")
    if rank not in members:
        raise ConfigError(f"rank {rank} called an all-reduce of group {list(members)} it is not a member of")
    return members


class PendingReduce(Protocol):
    """A reduce started by :data:`IssueFn`, not yet waited for."""

    def wait(self) -> torch.Tensor:
        """Block the calling thread until this member holds the result (divided, for ``mean``);
        raise what failed it, or :class:`hopnet.errors.WaitTimeout` after the collective's timeout."""
        ...


IssueFn = Callable[[torch.Tensor, str], PendingReduce]
"""Start the reduce of a tensor under a tag, from the calling thread, without waiting for it."""


class Collective(abc.ABC):
    """All-reduce among an ordered group of ranks, awaited on the node's event loop (what the
    node holds as its :class:`hopnet.runtime.services.AllReduce`)."""

    rank: int
    world_size: int

    @abc.abstractmethod
    async def allreduce(self, group: Sequence[int], tensor: torch.Tensor, op: ReduceOp = "mean", *,
                        tag: str) -> torch.Tensor:
        """Reduce ``tensor`` in place among ``group`` (sum, or sum / len(group) for mean)."""

    def allreduce_blocking(self, group: Sequence[int], tensor: torch.Tensor, op: ReduceOp = "mean", *,
                           tag: str) -> torch.Tensor | None:
        """The same reduce for a caller outside the event loop that blocks for it anyway: done
        in the calling thread where the collective can (then it returns ``tensor``), else
        nothing is done and it returns None, and the caller awaits :meth:`allreduce` on the loop.
        Saves the thread hand-offs of the loop on small tensors. Default: None."""
        return None

    def issuer(self, group: Sequence[int], op: ReduceOp, device: torch.device) -> IssueFn | None:
        """Where the collective can, a way for a thread outside the event loop to start reduces of
        ``group`` itself, in the order of its calls, and wait for each where it needs the result
        (what DDP does from its gradient hooks): no hand-off to the loop and back. Several may be
        in flight; every member must start the same reduces in the same order. None where the
        collective cannot, or not yet (the group's first call has not formed it): then
        :meth:`allreduce` on the loop. Default: None."""
        return None

    async def close(self) -> None:
        """Release what the collective holds (communicators, buffers)."""

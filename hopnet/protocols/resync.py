"""The resync after a dead worker was replaced (``--max-restarts``), for the protocols whose
workers must hold the same model and iteration: allreduce, pipe-sgd, eager-sgd.

A round a dead member broke may have finished on some members and not on others, so the ranks
can be a step apart. Every rank, the replacement included, all-reduces its iteration (and any
counters the protocol must agree on, the maximum of each is taken); the lowest rank of the
furthest iteration is the leader. A rank behind takes the leader's state first (a handover: its
optimizer state must include the steps it missed), then the leader broadcasts its model
(parameters and buffers) to every rank. docs/design/checkpoints.md, "A dead worker replaced live".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hopnet.protocols.base import ModelSnapshot, allreduce_each, reduce_or_roll_back
from hopnet.runtime.services import AllReduce, NodeServices


@dataclass(frozen=True)
class Resynced:
    leader: int
    furthest: int
    """The furthest iteration: every rank is there now."""
    counters: tuple[int, ...]
    """The maximum over the ranks of each counter passed in."""


async def resynchronize(node: NodeServices, collective: AllReduce, everyone: Sequence[int], iteration: int,
                        model: Sequence[torch.Tensor], tag: Callable[[str], str], timeout_s: float,
                        counters: Sequence[int] = ()) -> Resynced:
    """Wait for every dead peer's replacement, then agree and take the leader's model (see the module's
    docstring). A member dying meanwhile starts it over, once its replacement is there; a failure
    naming this rank, or with no replacements to come, is raised."""
    node.handover_point()  # a replacement, or a rank behind, may ask for this worker's state here
    snapshot = ModelSnapshot()
    try:
        while True:
            await node.wait_for_rejoins(f"rank {node.rank}'s resync in iteration {iteration}")
            done = await reduce_or_roll_back(
                node, snapshot, model, _resync_once(node, collective, everyone, iteration, model, tag, timeout_s,
                                                    counters))
            if isinstance(done, Resynced):
                return done
    finally:
        node.handover_point(False)


async def _resync_once(node: NodeServices, collective: AllReduce, everyone: Sequence[int], iteration: int,
                       model: Sequence[torch.Tensor], tag: Callable[[str], str], timeout_s: float,
                       counters: Sequence[int]) -> Resynced:
    n = len(everyone)
    table = torch.zeros((1 + len(counters), n), dtype=torch.float64)
    table[0, node.rank] = iteration
    for i, value in enumerate(counters):
        table[1 + i, node.rank] = value
    await collective.allreduce(everyone, table.view(-1), "sum", tag=tag("resync"))
    furthest = int(table[0].max())
    leader = int((table[0] == furthest).nonzero()[0])
    if furthest > iteration and node.load_state is not None:
        node.load_state(await node.fetch_state(leader, timeout_s))
    if node.rank != leader:
        for tensor in model:
            tensor.zero_()
    await allreduce_each(collective, everyone, model, "sum", tag=tag("resync/model"))
    done = Resynced(leader, furthest, tuple(int(row.max()) for row in table[1:]))
    node.record("resynced", iter=iteration, to=furthest, leader=leader, epoch=node.epoch)
    return done


__all__ = ["Resynced", "resynchronize"]

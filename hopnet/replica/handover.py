"""A replica that came back takes every lane's state at one iteration, from one replica.

Each lane of a restarted replica asks the same lane of a neighbour replica for its state, as a
single replacement asks its neighbour (:mod:`hopnet.runtime.rejoin`). The donor's lanes answer
at their own next step boundary, and the requests reach them at different moments: one lane may
be handed iteration 241 and its sibling iteration 240. A replica whose lanes start apart pairs
different steps in its own all-reduces and hangs.

So the lanes compare what they were handed (one all-reduce of six integers): the iteration, the
donor, and a key of the state itself. Under ddp the key is a digest of the whole model, which the
donor's members hold bit-identical wherever they are consistent: at a step boundary, or blocked
inside an iteration (where a neighbour's replacement may take the state,
:meth:`hopnet.runtime.node.Node.handover_point`). Under fsdp the members' shards differ, and the
key only tells a state handed at a step boundary from one handed by a blocked donor
(:data:`hopnet.runtime.rejoin.BLOCKED`). When any of the three differ, every lane asks the agreed
donor again, for its state at the step boundary before an iteration a little past the newest one
handed: the donor's lanes move in step, so they all answer at that boundary. A donor blocked
waiting for this very replica answers at once, and all of its lanes are blocked in the same
iteration. A donor already past the target answers at its next boundary, and the lanes try again
with twice the margin.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable

import torch

from hopnet.errors import HopnetError
from hopnet.replica.agreement import LaneAgreement
from hopnet.runtime.rejoin import BLOCKED, Handover

ATTEMPTS = 8
"""How many times the lanes ask again before the replica gives up (the margin doubles each time)."""


def state_key(handover: Handover, *, parameters: frozenset[str] | None) -> int:
    """What two lanes' handovers of one iteration must share: under ddp a digest of the model's
    ``parameters`` (the buffers may differ inside a step: the next step gives every member the first
    one's), under fsdp (``None``: the shards differ from lane to lane) whether the donor was blocked
    inside the iteration."""
    if parameters is None:
        return int(bool(handover.protocol_state.get(BLOCKED)))
    digest = hashlib.sha1()
    for name, tensor in sorted(handover.state["model"].items()):
        if name in parameters and isinstance(tensor, torch.Tensor):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(digest.digest()[:8], "little") >> 2  # (negated in the MIN all-reduce: no overflow)


async def one_handover(lanes: LaneAgreement, handover: Handover, ask_again: Callable[[int, int], Awaitable[Handover]],
                       key: Callable[[Handover], int], *, replica: int) -> Handover:
    """The handover every lane of ``replica`` loads: ``handover`` where the lanes' agree (same donor,
    iteration and ``key``), else what ``ask_again(donor, at)`` brings once they do."""
    margin = 2
    for _ in range(ATTEMPTS):
        mine = key(handover)
        neg_newest, oldest, first_donor, neg_last_donor, least_key, neg_most_key = await lanes.least_each(
            [-handover.iteration, handover.iteration, handover.donor, -handover.donor, mine, -mine])
        if -neg_newest == oldest and first_donor == -neg_last_donor and least_key == -neg_most_key:
            return handover
        handover = await ask_again(first_donor, -neg_newest + margin)
        margin *= 2
    raise HopnetError(f"replica {replica}: its lanes were handed different states {ATTEMPTS} times "
                      "(the donor replica's lanes do not move in step)")


__all__ = ["ATTEMPTS", "one_handover", "state_key"]

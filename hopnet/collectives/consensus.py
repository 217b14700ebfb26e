"""One model at the end: the exact average of the live workers' models, on every live worker.

:func:`consensus` runs on each worker once training is over and its protocol has quiesced
(:meth:`hopnet.runtime.node.Node.quiesce`); ``hopnet.Worker.consensus`` drives both. Two steps:

1. **Agreement on the live set** (:func:`agree_on_members`). A worker starts from the ranks it
   knows to be gone (said ``bye``, or declared dead by its heartbeats or by the coordinator)
   and sends that set, its *view*, to every other rank (but those it knows gone itself: a
   live worker others wrote off learns it so). Round ``r``
   ends once it holds the round-``r`` view of each of them, or knows it gone. When every
   view of the round equals its own, and it learned of no departure meanwhile, every live
   worker holds the same views and ends with the same members; otherwise each takes the
   union into round ``r + 1``. A worker dead before the consensus but not yet detected holds
   up the round until a neighbour's heartbeats declare it dead (``--peer-timeout``); a
   worker waiting on it learns that from the neighbour's next view (round ``r + 1`` views are
   read while round ``r`` waits). A worker that finds itself in another's view (declared
   dead by it, so cut off) fails, saying who wrote it off.
2. **The mean** (:func:`average_model`). Every member all-reduces float64 copies of its
   model tensors (``protocol.model_tensors()``) over the node's collective, tagged
   ``consensus/<call>/<i>``, and writes the results back under the node's model lock. All
   members decode the same bytes, so they end bit for bit equal; a failed all-reduce leaves
   the model as it was. A member whose model holds inf or NaN says so in its agreement
   messages; it contributes zeros and the sum is divided by the finite members only, so its
   model is left out of the mean (counted as the drop ``non_finite_model`` and named in the
   ``consensus`` record) and it receives the mean like the others. With no finite model at
   all every member fails with :class:`~hopnet.errors.NonFiniteError`.

Every wait has the node's ``--timeout`` and fails naming the ranks it waited on. The
agreement's first round also waits for the slowest worker to finish training: a worker that
finishes more than ``--timeout`` seconds before another fails its consensus.

The agreement assumes that no worker dies during it: one that does makes the others fail
(naming it, or after ``--timeout``), never hang.

:func:`gather` is the agreement alone, each view carrying the sender's value: every live worker
gets every live worker's value (``hopnet.Worker.gather``; a framework's strategy builds its
barrier, broadcast and reductions on it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hopnet.errors import HopnetError, NonFiniteError, PeerFailure, WaitTimeout
from hopnet.finite import all_finite_in
from hopnet.runtime.mailbox import COLLECTIVE_KIND
from hopnet.runtime.services import NodeServices
from hopnet.wire import Message

TAG_PREFIX = "consensus"
VIEW = "gone"
"""The meta key of an agreement message: the sender's view, the ranks it counts gone."""
FINITE = "finite"
"""The meta key of an agreement message: whether the sender's model is free of inf and NaN."""
VALUE = "value"
"""The meta key of an agreement message of :func:`gather`: the sender's value."""
GATHER_PREFIX = "gather"


class ConsensusError(HopnetError):
    """The consensus could not complete: this worker was written off by another, or a wait failed."""


@dataclass(frozen=True)
class ConsensusResult:
    """What one worker's consensus did."""

    members: tuple[int, ...]
    """The live workers whose models were averaged, in rank order."""
    rounds: int
    """Agreement rounds it took (1 when every worker knew the same departures from the start)."""
    non_finite: tuple[int, ...] = ()
    """Members whose model held inf or NaN: left out of the mean (they received it all the same)."""


async def consensus(node: NodeServices, tensors: Sequence[torch.Tensor], *, call: int = 0) -> ConsensusResult:
    """Agree on the live workers, then replace ``tensors`` in place by their mean over them.
    ``call`` numbers this worker's consensus calls (each needs tags of its own)."""
    tag = f"{TAG_PREFIX}/{call}"
    began = node.clock.now()
    finite = {node.rank: all_finite_in(tensors)}
    members, rounds = await agree_on_members(node, tag=f"{tag}/agree", finite=finite)
    non_finite = tuple(m for m in members if not finite[m])
    if len(non_finite) == len(members):
        raise NonFiniteError(f"rank {node.rank}: no consensus: the model of every live worker "
                             f"({', '.join(map(str, members))}) holds inf or NaN", rank=node.rank)
    for _ in non_finite:
        node.count_drop("non_finite_model")
    await average_model(node, members, tensors, tag=tag, contributes=finite[node.rank],
                        contributors=len(members) - len(non_finite))
    node.record("consensus", members=list(members), rounds=rounds, seconds=round(node.clock.now() - began, 6),
                iter=node.iteration, non_finite=list(non_finite))
    return ConsensusResult(members, rounds, non_finite)


async def gather(node: NodeServices, value: Any, *, call: int = 0) -> dict[int, Any]:
    """Every live worker's ``value`` (msgpack-able: None, bool, numbers, str, bytes, lists and dicts
    of them), by position in the graph: the agreement on the live set below, each view carrying
    the sender's value, so every live worker returns the same dict (one round trip when no
    worker left). Every live worker calls it, with the same ``call``. For small values: they
    travel in the messages' headers."""
    values = {node.rank: value}
    members, _ = await agree_on_members(node, tag=f"{GATHER_PREFIX}/{call}", values=values)
    return {m: values[m] for m in members}


async def agree_on_members(node: NodeServices, *, tag: str, finite: dict[int, bool] | None = None,
                           values: dict[int, Any] | None = None) -> tuple[tuple[int, ...], int]:
    """The live set every live worker agrees on, and the rounds it took (see the module's text).

    ``finite``: this worker's entry says whether its model is finite, which its messages carry;
    the entry of every other member is filled in from theirs. ``values``, the same for any
    value (:func:`gather`)."""
    finite = finite if finite is not None else {node.rank: True}
    carried = {} if values is None else {VALUE: values[node.rank]}
    gone = set(node.departed) | set(node.dead)
    views: dict[tuple[int, int], frozenset[int]] = {}  # (round, sender) -> its view
    try:
        r = 0
        while True:
            view = frozenset(gone)
            members = tuple(m for m in range(node.graph.n) if m not in view)
            others = [m for m in members if m != node.rank]
            # Also to the ranks only others count gone: one still alive learns it was written off.
            told = [m for m in range(node.graph.n)
                    if m != node.rank and m not in node.departed and m not in node.dead]
            await node.connect_to(told)
            for peer in told:
                node.post(Message(COLLECTIVE_KIND, node.rank, peer, r, tag,
                                  {VIEW: sorted(view), FINITE: finite[node.rank], **carried}))
            await _collect_round(node, tag, r, others, gone, views, finite, values)
            heard = [views[(r, m)] for m in others if m not in gone]
            if gone == view and all(v == view for v in heard):
                return members, r + 1
            r += 1
    finally:
        node.mailbox.discard_tag(COLLECTIVE_KIND, tag)


async def _collect_round(node: NodeServices, tag: str, r: int, others: Sequence[int], gone: set[int],
                         views: dict[tuple[int, int], frozenset[int]], finite: dict[int, bool],
                         values: dict[int, Any] | None = None) -> None:
    """Wait for round ``r``'s view of every rank of ``others`` not known gone. ``gone`` grows by
    every view read (round ``r + 1`` views are read too, as they come) and by the receives that
    fail because their sender left or died; ``views`` keeps what was read."""
    tasks: dict[asyncio.Task[Message], tuple[int, int]] = {}

    def receive(round_: int, peer: int) -> None:
        what = f"rank {peer}'s view of agreement round {round_} of {tag!r} (rank {node.rank})"
        task = asyncio.ensure_future(node.mailbox.receive(COLLECTIVE_KIND, tag, peer, round_, what=what))
        tasks[task] = (round_, peer)

    for peer in others:
        for round_ in (r, r + 1):
            if (round_, peer) not in views:
                receive(round_, peer)

    def waiting() -> list[int]:
        return [m for m in others if m not in gone and (r, m) not in views]

    try:
        while waiting():
            current = [t for t, (round_, peer) in tasks.items() if peer not in gone]
            if not current:
                break
            done, _ = await asyncio.wait(current, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                round_, peer = tasks.pop(task)
                try:
                    msg = task.result()
                except PeerFailure:
                    gone.add(peer)  # it said bye or was declared dead: the mailbox knows
                    continue
                except WaitTimeout as exc:
                    missing = waiting()
                    states = ", ".join(f"{m} ({node.peer_state(m)})" for m in missing)
                    call = "gather" if tag.startswith(GATHER_PREFIX) else "consensus"
                    raise WaitTimeout(f"the {call}'s agreement round {r}: no view from rank(s) {states} "
                                      f"(rank {node.rank}; did every live worker call {call}()?)",
                                      peer=missing[0] if missing else peer, waited_s=exc.waited_s,
                                      peer_state=node.peer_state(missing[0] if missing else peer)) from None
                view, finite[peer] = _read_view(msg, node.graph.n)
                if node.rank in view:
                    raise ConsensusError(f"rank {node.rank} takes no part in the consensus: rank {peer} counts it "
                                         "gone (it was declared dead or left, and cannot rejoin)")
                views[(round_, peer)] = view
                gone.update(view)
                if values is not None:
                    values[peer] = (msg.meta or {}).get(VALUE)
    finally:
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(list(tasks))
            for task in tasks:
                if not task.cancelled():
                    task.exception()  # retrieved: superseded by what this round decided


def _read_view(msg: Message, world_size: int) -> tuple[frozenset[int], bool]:
    meta = msg.meta or {}
    raw, finite = meta.get(VIEW), meta.get(FINITE)
    if not isinstance(raw, list) or not all(isinstance(r, int) and 0 <= r < world_size for r in raw) \
            or not isinstance(finite, bool):
        raise ConsensusError(f"rank {msg.src} sent a malformed agreement message (meta {msg.meta!r})")
    return frozenset(raw), finite


async def average_model(node: NodeServices, members: Sequence[int], tensors: Iterable[torch.Tensor], *,
                        tag: str, contributes: bool = True, contributors: int | None = None) -> None:
    """Replace each floating-point tensor of ``tensors`` by its mean over ``members``, exactly as
    far as float64 goes: the all-reduce runs on float64 copies, which are written back (cast to
    each tensor's dtype) under the node's model lock once every one of them is reduced.
    Tensors of other dtypes are left as they are. A member that does not ``contribute`` (its
    model is not finite) adds zeros, and the sum is divided by the ``contributors``."""
    model = [t for t in tensors if t.is_floating_point()]
    count = len(members) if contributors is None else contributors
    work = [t.detach().to(torch.float64, copy=True).reshape(-1) if contributes
            else torch.zeros(t.numel(), dtype=torch.float64, device=t.device) for t in model]
    for i, flat in enumerate(work):
        await node.collective.allreduce(members, flat, "sum", tag=f"{tag}/{i}")
        flat.div_(count)
    with node.model_lock:
        for tensor, flat in zip(model, work):
            tensor.copy_(flat.view(tensor.shape))


__all__ = ["ConsensusError", "ConsensusResult", "TAG_PREFIX", "agree_on_members", "average_model", "consensus",
           "gather"]

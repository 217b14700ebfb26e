"""Prague's basic (random) Group Generator (ASPLOS'20, Sec. 4.1, Fig. 8) as a state machine.

State: a lock bit per worker, a FIFO queue of pending groups, the active groups (GO sent,
not every member has acknowledged yet).

* ``{"t": "req", "iter": k}`` from worker ``w`` (sent at the start of its iteration, so the
  round trip overlaps its compute): a new group ``{w}`` plus ``size - 1`` distinct workers
  drawn uniformly (seeded) from the others still in the run. It joins the pending queue,
  and the queue is retried.
* Retrying the queue, in creation order: a group starts when none of its members is locked
  and it overlaps no earlier group still pending (so overlapping groups start in the order
  they were made, and a later group may overtake an earlier one only if they are disjoint).
  Starting sets its members' lock bits and sends ``{"t": "go", "gid", "members", "reply"}``
  to every member, ``reply`` True for the initiator.
* ``{"t": "ack", "gid": g}`` from a member releases its lock bit (its part of the P-Reduce
  is done) and retries the queue; the group is over when every member acknowledged.
* A worker that leaves or dies (``on_worker_gone``) is drawn no more. Its own pending
  request is dropped; a pending group it was drawn into is drawn again for the same
  initiator, as a new group at the back of the queue (so that group ids, creation order
  and queue order stay one order); its lock bit is released.

A group of one (the initiator is the only worker left) still goes through the queue and
is counted as a "no sync".
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hopnet.coordinator.base import BadCoordinatorMessage, Coordinator, Send


@dataclass
class Group:
    gid: int
    initiator: int
    members: tuple[int, ...]  # sorted
    iteration: int
    waiting: set[int] = field(default_factory=set)  # members whose ack is still owed (active groups)


class RandomGroupGenerator(Coordinator):
    name = "prague random group generator"

    def __init__(self, world_size: int, group_size: int = 3, seed: int = 0) -> None:
        super().__init__(world_size)
        if group_size < 1:
            raise ValueError(f"group size must be >= 1 (got {group_size})")
        self.group_size = group_size
        self.rng = random.Random(f"{seed}:prague-random-gg")
        self.locked = [False] * world_size
        self.pending: list[Group] = []
        self.active: dict[int, Group] = {}
        self.gone: set[int] = set()
        self.requested: set[int] = set()  # workers with a request not yet answered by a GO
        self.next_gid = 0
        self.started_order: list[int] = []  # gids in the order their GO went out (tests read it)
        self.counters = {"groups": 0, "went_pending": 0, "no_sync": 0, "redrawn": 0, "dropped_requests": 0,
                         "acks": 0, "max_pending": 0}

    # ------------------------------------------------------------------ messages
    def on_message(self, sender: int, message: Mapping[str, Any]) -> list[Send]:
        self.check_sender(sender)
        kind = message.get("t")
        if kind == "req":
            iteration = message.get("iter")
            if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
                raise BadCoordinatorMessage(f"req from {sender}: iter {iteration!r} is not an iteration number")
            return self._request(sender, iteration)
        if kind == "ack":
            gid = message.get("gid")
            group = self.active.get(gid) if isinstance(gid, int) else None
            if group is None or sender not in group.waiting:
                raise BadCoordinatorMessage(f"ack from {sender} for group {gid!r}, which does not wait on it")
            self.counters["acks"] += 1
            self._release(group, sender)
            return self._retry()
        raise BadCoordinatorMessage(f"{self.name}: unknown message kind {kind!r} from {sender}")

    def on_worker_gone(self, rank: int) -> list[Send]:
        if not 0 <= rank < self.world_size or rank in self.gone:
            return []
        self.gone.add(rank)
        self.requested.discard(rank)
        kept: list[Group] = []
        redrawn: list[Group] = []
        for group in self.pending:
            if group.initiator == rank:
                self.counters["dropped_requests"] += 1
            elif rank in group.members:
                redrawn.append(group)
            else:
                kept.append(group)
        self.pending = kept
        for group in redrawn:  # a new group, made now: it goes to the back of the queue
            self.counters["redrawn"] += 1
            self.pending.append(Group(self.next_gid, group.initiator, self._draw(group.initiator), group.iteration))
            self.next_gid += 1
        for group in list(self.active.values()):
            if rank in group.waiting:
                self._release(group, rank)
        return self._retry()

    def on_worker_rejoined(self, rank: int) -> list[Send]:
        self.gone.discard(rank)
        self.locked[rank] = False
        return []

    # ------------------------------------------------------------------ the algorithm
    def _request(self, worker: int, iteration: int) -> list[Send]:
        if worker in self.gone:
            raise BadCoordinatorMessage(f"req from worker {worker}, which left")
        if worker in self.requested:
            raise BadCoordinatorMessage(f"req from worker {worker} while its previous request is unanswered")
        self.requested.add(worker)
        group = Group(self.next_gid, worker, self._draw(worker), iteration)
        self.next_gid += 1
        self.counters["groups"] += 1
        self.pending.append(group)
        sends = self._retry()
        if any(g is group for g in self.pending):
            self.counters["went_pending"] += 1
        self.counters["max_pending"] = max(self.counters["max_pending"], len(self.pending))
        return sends

    def _draw(self, initiator: int) -> tuple[int, ...]:
        others = [w for w in range(self.world_size) if w != initiator and w not in self.gone]
        picked = self.rng.sample(others, min(self.group_size - 1, len(others)))
        return tuple(sorted([initiator, *picked]))

    def _retry(self) -> list[Send]:
        sends: list[Send] = []
        blocked: set[int] = set()  # members of earlier groups still pending
        still: list[Group] = []
        for group in self.pending:
            if blocked.isdisjoint(group.members) and not any(self.locked[w] for w in group.members):
                sends += self._start(group)
            else:
                blocked.update(group.members)
                still.append(group)
        self.pending = still
        return sends

    def _start(self, group: Group) -> list[Send]:
        for w in group.members:
            self.locked[w] = True
        group.waiting = set(group.members)
        self.active[group.gid] = group
        self.requested.discard(group.initiator)
        self.started_order.append(group.gid)
        if len(group.members) == 1:
            self.counters["no_sync"] += 1
        members = list(group.members)
        return [Send(w, {"t": "go", "gid": group.gid, "members": members, "reply": w == group.initiator})
                for w in members]

    def _release(self, group: Group, worker: int) -> None:
        group.waiting.discard(worker)
        self.locked[worker] = False
        if not group.waiting:
            del self.active[group.gid]

    def summary(self) -> dict[str, Any]:
        return dict(self.counters)

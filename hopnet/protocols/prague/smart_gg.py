"""Prague's smart Group Generator (ASPLOS'20 Sec. 5) as a sans-IO state machine.

Four components, each switchable on its own (options of ``--protocol prague``):

* **Group Buffer** (``group_buffer``): an ordered list per worker of the groups made for it
  that it has not asked for yet. Groups are appended to every member's list when they are
  made, so any two workers see the groups they share in the same (creation) order. A request
  takes the head of the requester's buffer; a new group is made only when it is empty.
* **Global Division** (``global_division``): a new group is made by randomly partitioning
  every *idle* worker (empty buffer; the initiator always counts) into disjoint groups of
  ``group_size``, the leftovers merged into the last group. Only the initiator left: a
  singleton, a counted "no sync".
* **Inter-Intra** (``inter_intra``, workers grouped by the graph's ``machine`` field): each
  division makes two groups per worker: an *Inter* group (one Head Worker per machine, heads
  rotated round-robin per division and split into groups of 2-3; the other workers in random
  groups with workers of their own machine) and then an *Intra* group (the division's workers
  of one machine). A slow initiator (C or more requests behind the furthest worker) heads
  its machine in its own division and stays out of that machine's Intra group, so its
  machine-mates never wait a whole slow iteration for its next request. Off, with a note in
  :meth:`SmartGroupGenerator.summary`, when the graph has no machine labels or Global
  Division is off.
* **Slow-worker filter** (``slow_filter`` = C, 0 = off): ``c_w`` counts the requests of
  ``w``; in a division started by ``i``, ``w`` takes part only if ``c_i - c_w < C``.

Buffers, queues and when a group starts (the lock vector)
---------------------------------------------------------
``GB_w`` holds the groups made for ``w`` that it has not asked for yet, in creation order.
A request *takes* the head of the requester's buffer (Sec. 5.1: "the first existing group
in the worker's GB will serve as the selected group"); so a worker is idle, and can be put
into the next division, from the moment its request took its last buffered group, while it
still computes and runs that group. (Were a group to stay in the buffer until ACKed, the
first worker to finish its group would find nobody idle and divide alone: in random runs of
16 workers three requests in four became a "no sync".)

Each worker also has a *lock queue*: the groups it took (or, with the buffer off, was put
into) and has not finished, in creation order. A group is GO'd, to all its members at once,
when it is the **head of every member's lock queue** and **every member has a request
outstanding** (with the buffer on, every member has taken it by a request). ``lock[w] = 1``
exactly while ``w``'s head has been GO'd and ``w`` has not ACKed it; its ACK pops the head.

* No worker is ever in two concurrent groups: a group is GO'd to ``w`` only as the head of
  ``w``'s lock queue, and the head changes only on ``w``'s ACK.
* Overlapping groups run in creation order: buffers and lock queues are in creation order,
  and a worker takes its buffered groups in order.
* Nothing deadlocks: the unfinished group with the smallest id heads the lock queue of every
  member that took it and the buffer of every member that did not. A member that took it is
  at (or on its way to) its sync point, where it runs its GO'd groups; one that did not is
  computing, or between an ACK and its next request, and its next request takes it (one that
  leaves is dropped from it instead). So the oldest group always starts and finishes, and by
  induction every group, and every request.
* Waiting for every member's request (rather than GO'ing a member as soon as it asks) means
  nobody enters a P-Reduce with a worker that may never come: a worker that leaves with
  groups still in its buffer never asked for them, so on its ``bye`` they go on without it
  (see below) instead of stranding the members already inside them.

With the Group Buffer on, each group answers one request of *every* member (``reply`` is
True for all): a worker runs exactly one group per iteration. With it off, every request
makes new groups as the random GG does: they go straight into their members' lock queues, a
group answers only its initiator's request, and its other members run it at their sync point
(``reply`` False) before their own. A division then takes the workers that have no group
waiting to be GO'd (idle meaning "in no unfinished group" would leave almost nobody idle:
in the simulator 99% of such divisions were a lone initiator).

A worker that leaves
--------------------
``bye`` (or the host's :meth:`on_worker_gone`) removes the worker from every group not yet
GO'd; the others keep them, in order. A group left with one member is cancelled: its member's
request, if that group was to answer it, is served again (from the buffer, or by a new
division). A group already GO'd that contains it cannot change (its members are in the
P-Reduce with it, and will blame it themselves); it counts as ACKed by the leaver.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from hopnet.coordinator.base import BadCoordinatorMessage, Coordinator, Send

GROUP_KINDS = ("random", "division", "inter", "intra")


@dataclass(frozen=True)
class GroupFormed:
    """What a listener hears each time the generator makes a group.

    ``kind`` is ``random`` (Global Division off), ``division`` (one group of a Global
    Division), ``inter`` or ``intra`` (Inter-Intra's two phases); ``division`` numbers the
    Global Division that made it (None for random groups); ``initiator`` is the worker whose
    request made it."""

    gid: int
    members: tuple[int, ...]
    kind: str
    division: int | None
    initiator: int


@dataclass
class _Group:
    gid: int
    members: list[int]
    kind: str
    answers: set[int]
    """Members whose outstanding request this group answers (GO with ``reply`` True)."""
    started: bool = False
    unacked: set[int] = field(default_factory=set)


class SmartGroupGenerator(Coordinator):
    """Prague's smart GG: Group Buffer, Global Division, Inter-Intra and the slow-worker filter.

    ``machines`` holds each rank's machine label (the graph's ``machine`` field) or None.
    ``on_formed``, when given, is called with a :class:`GroupFormed` for every group made
    (a host can log it; the invariant tests check divisions with it).
    """

    name = "prague smart group generator"

    def __init__(self, world_size: int, *, group_size: int = 3, group_buffer: bool = True,
                 global_division: bool = True, inter_intra: bool = True, slow_filter: int = 4,
                 machines: Sequence[str | None] | None = None, seed: int = 0,
                 on_formed: Callable[[GroupFormed], None] | None = None) -> None:
        super().__init__(world_size)
        if group_size < 2:
            raise ValueError(f"group_size must be >= 2 (got {group_size})")
        if slow_filter < 0:
            raise ValueError(f"slow_filter must be >= 0 (got {slow_filter})")
        if machines is not None and len(machines) != world_size:
            raise ValueError(f"machines: expected {world_size} labels, got {len(machines)}")
        self.group_size = group_size
        self.group_buffer = group_buffer
        self.global_division = global_division
        self.slow_filter = slow_filter
        self._rng = random.Random(seed)
        self._on_formed = on_formed
        self._machine_ranks, self.inter_intra_status = self._machine_layout(
            inter_intra, global_division, machines)
        self.inter_intra = self._machine_ranks is not None
        self._head_turn: dict[int, int] = {}

        self._buffer: list[deque[int]] = [deque() for _ in range(world_size)]
        self._queue: list[deque[int]] = [deque() for _ in range(world_size)]
        self._groups: dict[int, _Group] = {}
        self._waiting = [False] * world_size
        self._requests = [0] * world_size
        self._gone: set[int] = set()
        self._next_gid = 0
        self._counters: dict[str, int] = {
            "requests": 0, "buffer_hits": 0, "groups_formed": 0, "random_groups": 0,
            "global_divisions": 0, "inter_groups": 0, "intra_groups": 0, "no_syncs": 0,
            "filtered_out": 0, "groups_started": 0, "groups_cancelled": 0, "workers_gone": 0,
            "max_buffer": 0}
        self._filtered_by_rank: dict[int, int] = {}

    @staticmethod
    def _machine_layout(wanted: bool, global_division: bool, machines: Sequence[str | None] | None
                        ) -> tuple[list[list[int]] | None, str]:
        """Ranks per machine (machines ordered by lowest rank), or None with the reason it is off."""
        if not wanted:
            return None, "off (--no-inter-intra)"
        if not global_division:
            return None, "off: Inter-Intra phases are made by Global Division, which is off"
        if machines is None or any(m is None for m in machines):
            return None, "off: the graph has no machine labels"
        by_label: dict[str, list[int]] = {}
        for rank, label in enumerate(machines):
            assert label is not None
            by_label.setdefault(label, []).append(rank)
        return list(by_label.values()), f"on ({len(by_label)} machines)"

    # -- messages -------------------------------------------------------------------------

    def on_message(self, sender: int, message: Mapping[str, Any]) -> list[Send]:
        self.check_sender(sender)
        if not isinstance(message, Mapping):
            raise BadCoordinatorMessage(f"{self.name}: message from {sender} is not a mapping")
        kind = message.get("t")
        if kind == "req":
            return self._on_request(sender, message)
        if kind == "ack":
            return self._on_ack(sender, message)
        if kind == "bye":
            return self.on_worker_gone(sender)
        raise BadCoordinatorMessage(f"{self.name}: unknown message kind {kind!r} from worker {sender}")

    def _on_request(self, worker: int, message: Mapping[str, Any]) -> list[Send]:
        iteration = message.get("iter")
        if not _is_count(iteration):
            raise BadCoordinatorMessage(f"{self.name}: req from worker {worker} needs an integer 'iter' >= 0 "
                                        f"(got {iteration!r})")
        if worker in self._gone:
            raise BadCoordinatorMessage(f"{self.name}: req from worker {worker}, which has left")
        if self._waiting[worker]:
            raise BadCoordinatorMessage(f"{self.name}: req from worker {worker} while its previous request "
                                        "is still unanswered")
        self._counters["requests"] += 1
        self._requests[worker] += 1
        self._waiting[worker] = True
        sends: list[Send] = []
        self._serve(worker, sends)
        return sends

    def _on_ack(self, worker: int, message: Mapping[str, Any]) -> list[Send]:
        gid = message.get("gid")
        group = self._groups.get(gid) if _is_count(gid) else None
        if group is None or not group.started or worker not in group.unacked:
            raise BadCoordinatorMessage(f"{self.name}: ack from worker {worker} for group {gid!r}, "
                                        "which it is not running")
        sends: list[Send] = []
        self._release(worker, group)
        if self._waiting[worker] and not self._is_answered(worker):
            self._serve(worker, sends)  # it asked again before this ACK, and nothing is left for it
        elif self._queue[worker]:
            self._try_start(self._queue[worker][0], sends)
        return sends

    def on_worker_gone(self, rank: int) -> list[Send]:
        self.check_sender(rank)
        if rank in self._gone:
            return []
        self._gone.add(rank)
        self._counters["workers_gone"] += 1
        self._waiting[rank] = False
        touched: set[int] = set()
        for gid in list(self._queue[rank]) + list(self._buffer[rank]):
            group = self._groups[gid]
            if group.started:
                self._release(rank, group)
                continue
            self._forget(rank, gid)
            group.members.remove(rank)
            group.answers.discard(rank)
            touched.update(group.members)
            if len(group.members) < 2:
                self._cancel(group)
        sends: list[Send] = []
        for worker in sorted(touched):
            if self._waiting[worker] and not self._is_answered(worker):
                self._serve(worker, sends)
        for worker in sorted(touched):
            if self._queue[worker]:
                self._try_start(self._queue[worker][0], sends)
        return sends

    def on_worker_rejoined(self, rank: int) -> list[Send]:
        self.check_sender(rank)
        self._gone.discard(rank)
        self._waiting[rank] = False
        return []

    # -- the lock vector and the queues ---------------------------------------------------

    def _release(self, worker: int, group: _Group) -> None:
        """``worker`` is done with ``group`` (its ACK, or it left while the group ran)."""
        assert self._queue[worker] and self._queue[worker][0] == group.gid
        self._queue[worker].popleft()
        group.unacked.discard(worker)
        if not group.unacked:
            del self._groups[group.gid]

    def _forget(self, worker: int, gid: int) -> None:
        if gid in self._queue[worker]:
            self._queue[worker].remove(gid)
        else:
            self._buffer[worker].remove(gid)

    def _cancel(self, group: _Group) -> None:
        for member in group.members:
            self._forget(member, group.gid)
        del self._groups[group.gid]
        self._counters["groups_cancelled"] += 1

    def _is_answered(self, worker: int) -> bool:
        """Whether a group not yet GO'd in ``worker``'s queue will answer its outstanding request."""
        return any(not self._groups[gid].started and worker in self._groups[gid].answers
                   for gid in self._queue[worker])

    def _try_start(self, gid: int, sends: list[Send]) -> None:
        group = self._groups[gid]
        if group.started:
            return
        for member in group.members:
            if not self._queue[member] or self._queue[member][0] != gid or not self._waiting[member]:
                return
        group.started = True
        group.unacked = set(group.members)
        self._counters["groups_started"] += 1
        for member in group.members:
            reply = member in group.answers
            if reply:
                self._waiting[member] = False
            sends.append(Send(member, {"t": "go", "gid": gid, "members": list(group.members), "reply": reply}))

    # -- making groups ------------------------------------------------------------------

    def _serve(self, worker: int, sends: list[Send]) -> None:
        """Find or make the group that answers ``worker``'s outstanding request, and start what can."""
        if self.group_buffer and self._buffer[worker]:
            self._counters["buffer_hits"] += 1
        else:
            made = self._divide(worker) if self.global_division else [self._random_group(worker)]
            answered = False
            for members, kind in made:
                if self.group_buffer:
                    answers = set(members)
                elif worker in members and not answered:
                    answers, answered = {worker}, True
                else:
                    answers = set()
                self._add_group(members, kind, answers, worker)
        if self.group_buffer:
            self._queue[worker].append(self._buffer[worker].popleft())
            self._try_start(self._queue[worker][0], sends)
        else:
            for member in {m for members, _ in made for m in members}:
                self._try_start(self._queue[member][0], sends)

    def _add_group(self, members: list[int], kind: str, answers: set[int], initiator: int) -> None:
        gid = self._next_gid
        self._next_gid += 1
        members = sorted(members)
        self._groups[gid] = _Group(gid, members, kind, answers)
        for member in members:
            line = self._buffer[member] if self.group_buffer else self._queue[member]
            line.append(gid)
            self._counters["max_buffer"] = max(self._counters["max_buffer"], len(line))
        self._counters["groups_formed"] += 1
        if len(members) == 1:
            self._counters["no_syncs"] += 1
        if kind in ("inter", "intra"):
            self._counters[f"{kind}_groups"] += 1
        if self._on_formed is not None:
            division = self._counters["global_divisions"] if kind != "random" else None
            self._on_formed(GroupFormed(gid, tuple(members), kind, division, initiator))

    def _idle(self, worker: int) -> bool:
        """Whether ``worker`` has no group waiting for it: an empty Group Buffer or, with the
        buffer off, nothing in its lock queue that has not been GO'd yet."""
        if self.group_buffer:
            return not self._buffer[worker]
        return all(self._groups[gid].started for gid in self._queue[worker])

    def _live_others(self, worker: int) -> list[int]:
        return [w for w in range(self.world_size) if w != worker and w not in self._gone]

    def _random_group(self, initiator: int) -> tuple[list[int], str]:
        """Random GG's rule: the initiator and ``group_size - 1`` distinct workers drawn uniformly."""
        others = self._live_others(initiator)
        self._counters["random_groups"] += 1
        return [initiator] + self._rng.sample(others, min(self.group_size - 1, len(others))), "random"

    def _divide(self, initiator: int) -> list[tuple[list[int], str]]:
        """One Global Division started by ``initiator``: its groups, in creation order."""
        self._counters["global_divisions"] += 1
        eligible = [initiator]
        for w in self._live_others(initiator):
            if not self._idle(w):
                continue
            if self.slow_filter and self._requests[initiator] - self._requests[w] >= self.slow_filter:
                self._counters["filtered_out"] += 1
                self._filtered_by_rank[w] = self._filtered_by_rank.get(w, 0) + 1
                continue
            eligible.append(w)
        if self._machine_ranks is None:
            return [(g, "division") for g in self._partition(eligible, self.group_size)]
        return self._divide_inter_intra(initiator, set(eligible))

    def _divide_inter_intra(self, initiator: int, eligible: set[int]) -> list[tuple[list[int], str]]:
        assert self._machine_ranks is not None
        inter: list[list[int]] = []
        intra: list[list[int]] = []
        heads: list[int] = []
        # A lagging initiator heads its machine and stays out of its machine's Intra group:
        # that group would hold its machine-mates until its *next* request, a slow iteration on.
        lagging = self._lagging(initiator)
        for index, ranks in enumerate(self._machine_ranks):
            local = [w for w in ranks if w in eligible]
            if not local:
                continue
            head = initiator if lagging and initiator in local else self._next_head(index, ranks, eligible)
            heads.append(head)
            inter.extend(self._partition([w for w in local if w != head], self.group_size))
            intra.append([w for w in local if not (lagging and w == initiator)])
        self._rng.shuffle(heads)
        count = (len(heads) + 2) // 3
        inter[:0] = [heads[k::count] for k in range(count)]
        # Singletons sync with nobody: a worker left alone in a phase simply has one group
        # fewer, unless it is the initiator and would otherwise go unanswered.
        made = [(g, "inter") for g in inter if len(g) > 1] + [(g, "intra") for g in intra if len(g) > 1]
        if not any(initiator in g for g, _ in made):
            made.append(([initiator], "intra"))
        return made

    def _lagging(self, initiator: int) -> bool:
        """Whether the slow-worker filter counts ``initiator`` as slow: C or more requests
        behind the furthest worker still in the run."""
        if not self.slow_filter:
            return False
        ahead = max(self._requests[w] for w in range(self.world_size) if w not in self._gone)
        return ahead - self._requests[initiator] >= self.slow_filter

    def _next_head(self, machine: int, ranks: list[int], eligible: set[int]) -> int:
        """Round-robin over the machine's workers, one step per division; skips the ineligible."""
        turn = self._head_turn.get(machine, 0)
        self._head_turn[machine] = turn + 1
        for step in range(len(ranks)):
            candidate = ranks[(turn + step) % len(ranks)]
            if candidate in eligible:
                return candidate
        raise AssertionError("a machine with eligible workers has no head")

    def _partition(self, workers: list[int], size: int) -> list[list[int]]:
        """A random partition into groups of ``size``, the leftovers merged into the last group."""
        if not workers:
            return []
        shuffled = list(workers)
        self._rng.shuffle(shuffled)
        count = max(1, len(shuffled) // size)
        groups = [shuffled[k * size:(k + 1) * size] for k in range(count)]
        groups[-1].extend(shuffled[count * size:])
        return groups

    # -- inspection ---------------------------------------------------------------------

    def buffer(self, worker: int) -> tuple[tuple[int, ...], ...]:
        """The member lists of the groups in ``worker``'s Group Buffer (not yet asked for), head first."""
        return tuple(tuple(self._groups[gid].members) for gid in self._buffer[worker])

    def lock_queue(self, worker: int) -> tuple[tuple[int, ...], ...]:
        """The member lists of the groups ``worker`` took or was put into and has not finished, head first."""
        return tuple(tuple(self._groups[gid].members) for gid in self._queue[worker])

    def locked(self) -> frozenset[int]:
        """The lock vector's set bits: workers in a GO'd group they have not ACKed."""
        return frozenset(w for group in self._groups.values() if group.started for w in group.unacked)

    def summary(self) -> dict[str, Any]:
        """Counters (docs/reference/events.md, the coordinator's ``stop`` record) and the settings in force;
        ``inter_intra`` says whether the phases ran and, when not, why."""
        out: dict[str, Any] = dict(self._counters)
        out.update({
            "group_generator": "smart",
            "group_buffer": self.group_buffer,
            "global_division": self.global_division,
            "inter_intra": self.inter_intra_status,
            "slow_filter": self.slow_filter,
            "filtered_out_by_rank": {str(r): n for r, n in sorted(self._filtered_by_rank.items())},
            "unfinished_groups": len(self._groups),
        })
        return out


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0

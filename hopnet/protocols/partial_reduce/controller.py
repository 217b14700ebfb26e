"""Partial Reduce's controller (Miao et al., SIGMOD'21, Alg. 2 and Sec. 4), sans-IO.

Workers send ``{"t": "ready", "iter": k}`` after their local step (``k``: their iteration
counter, which a group sets to the members' maximum) and block until their group. The
controller keeps the ready signals in a FIFO queue; whenever it holds P of them it pops P,
forms a group and sends every member

    {"t": "group", "gid": g, "members": [sorted ranks], "weights": [beta per member], "iter": max_k}

Groups are only ever formed from queued (blocked) workers, and a worker leaves the queue
when its group is formed, so groups that run at the same time are disjoint without any
lock, and a worker is in at most one group between two of its ready signals.

The pipeline of Fig. 6:

* signal queue: FIFO of ``(rank, k)``; a second ready from a worker still queued, or one
  from a worker that left, is refused (:class:`BadCoordinatorMessage`);
* group filter (group-frozen avoidance, Sec. 4): the sync graph joins the members of each
  of the last T groups, the candidate included. If it splits the workers that appear in it
  into several components (the {1,2} / {3,4} split), a candidate member whose component
  another member already covers is swapped for the earliest queued worker of a component
  the candidate does not reach. Since groups form as soon as P workers are queued, the
  queue rarely holds such a worker: the filter then waits for one more ready signal, and
  after that one accepts the group as it is. It never waits longer, so it never stalls;
* weight generator: :mod:`hopnet.protocols.partial_reduce.weights` (``const`` 1/P or ``dynamic``);
* broadcaster: one ``group`` message per member.

Leaving: a worker that says ``{"t": "bye"}`` (or that the host reports gone) leaves the
queue and is never grouped again. When fewer than P workers are left, groups shrink to all
of those left, so the last workers finish rather than wait for partners that will never
come; a lone worker gets a group of itself (weight 1) and trains on alone.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hopnet.coordinator.base import BadCoordinatorMessage, Coordinator, Send
from hopnet.protocols.partial_reduce.weights import MISSING_POLICIES, WEIGHT_MODES, group_weights
from hopnet.protocols.partial_reduce.window import WindowComponents


READY = "ready"
GROUP = "group"
BYE = "bye"
FROZEN_WINDOW_FACTOR = 3
"""The default window is this many times the fewest groups that can connect N workers
(docs/protocols/partial-reduce.md, "Design": at 2x, groups drawn at random leave the window
disconnected 4 to 18 % of the time for N <= 8, so the filter would repair groups that
were never frozen; at 3x, 0.5 to 3 %)."""


def minimum_connecting_groups(world_size: int, group_size: int) -> int:
    """``ceil((N - 1) / (P - 1))``: each group adds at most P - 1 edges to a spanning forest."""
    if world_size <= 1:
        return 0
    return math.ceil((world_size - 1) / (max(2, min(group_size, world_size)) - 1))


def default_frozen_window(world_size: int, group_size: int) -> int:
    """The window T used when none is given: 3 x the minimum (0 when one worker is alone)."""
    return FROZEN_WINDOW_FACTOR * minimum_connecting_groups(world_size, group_size)


@dataclass(frozen=True)
class FormedGroup:
    """One group as the controller formed it (for the run's summary, tests and analysis)."""

    gid: int
    members: tuple[int, ...]  # sorted
    weights: tuple[float, ...]  # same order as members
    iteration: int  # the members' largest counter
    repaired: bool  # the frozen filter changed its membership


class _Components:
    """Union-find over ranks."""

    def __init__(self, size: int) -> None:
        self.parent = list(range(size))

    def find(self, x: int) -> int:
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def join(self, members: Iterable[int]) -> None:
        it = iter(members)
        first = next(it, None)
        if first is None:
            return
        root = self.find(first)
        for other in it:
            self.parent[self.find(other)] = root


class PartialReduceController(Coordinator):
    """The controller of ``--protocol partial-reduce``."""

    name = "partial-reduce controller"

    def __init__(self, world_size: int, group_size: int = 3, *, weights: str = "const", ema_decay: float = 0.9,
                 missing_policy: str = "oldest", frozen_window: int | None = None, keep_log: bool = False) -> None:
        super().__init__(world_size)
        if group_size < 2:
            raise ValueError(f"group_size must be >= 2 (got {group_size})")
        if weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_MODES)} (got {weights!r})")
        if missing_policy not in MISSING_POLICIES:
            raise ValueError(f"missing_policy must be one of {', '.join(MISSING_POLICIES)} (got {missing_policy!r})")
        if frozen_window is not None and frozen_window < 0:
            raise ValueError(f"frozen_window must be >= 0 (got {frozen_window})")
        self.group_size = group_size
        self.weights = weights
        self.ema_decay = float(ema_decay)
        self.missing_policy = missing_policy
        self.frozen_window = (default_frozen_window(world_size, group_size) if frozen_window is None
                              else frozen_window)
        self.queue: deque[tuple[int, int]] = deque()  # (rank, iteration counter), oldest first
        self.queued: set[int] = set()
        self.gone: set[int] = set()
        # The last T - 1 accepted groups; with the candidate they make the window of T.
        self.recent: deque[tuple[int, ...]] = deque(maxlen=max(self.frozen_window - 1, 0))
        self._window = WindowComponents(world_size)  # the components of ``recent``, kept incrementally
        self.log: list[FormedGroup] | None = [] if keep_log else None
        self.next_gid = 0
        self.repairs = 0
        self.holds = 0
        self._held = False  # the head group waits for one more ready signal (see _pick)
        self.frozen_accepted = 0
        self.shrunk_groups = 0
        self.queue_high_water = 0

    # ------------------------------------------------------------------ messages
    def on_message(self, sender: int, message: Mapping[str, Any]) -> list[Send]:
        self.check_sender(sender)
        if not isinstance(message, Mapping):
            raise BadCoordinatorMessage(f"{self.name}: message from worker {sender} is not a map")
        kind = message.get("t")
        if kind == READY:
            return self._ready(sender, message.get("iter"))
        if kind == BYE:
            return self.on_worker_gone(sender)
        raise BadCoordinatorMessage(f"{self.name}: worker {sender} sent a message of unknown kind {kind!r} "
                                    f"(expected {READY!r} or {BYE!r})")

    def on_worker_gone(self, rank: int) -> list[Send]:
        if rank in self.gone or not 0 <= rank < self.world_size:
            return []
        self.gone.add(rank)
        self._window.set_gone(rank, True)
        if rank in self.queued:
            self.queued.discard(rank)
            self.queue = deque(entry for entry in self.queue if entry[0] != rank)
        return self._form_groups()  # fewer workers left: the groups may shrink to what is queued

    def on_worker_rejoined(self, rank: int) -> list[Send]:
        self.gone.discard(rank)
        self._window.set_gone(rank, False)
        return []

    def _ready(self, sender: int, iteration: Any) -> list[Send]:
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise BadCoordinatorMessage(f"{self.name}: worker {sender} sent ready with iter {iteration!r} "
                                        "(expected an integer >= 0)")
        if sender in self.gone:
            raise BadCoordinatorMessage(f"{self.name}: worker {sender} sent ready after it left")
        if sender in self.queued:
            raise BadCoordinatorMessage(f"{self.name}: worker {sender} sent ready while already waiting "
                                        "for a group")
        self.queue.append((sender, iteration))
        self.queued.add(sender)
        self.queue_high_water = max(self.queue_high_water, len(self.queue))
        return self._form_groups()

    # ------------------------------------------------------------------ forming groups
    @property
    def alive(self) -> int:
        return self.world_size - len(self.gone)

    def _form_groups(self) -> list[Send]:
        sends: list[Send] = []
        while True:
            size = min(self.group_size, self.alive)
            if size < 1 or len(self.queue) < size:
                return sends
            pick = self._pick(size)
            if pick is None:
                return sends  # held for one more ready signal (see _pick)
            picked, repaired = pick
            sends.extend(self._broadcast(picked, repaired, shrunk=size < self.group_size))

    def _pick(self, size: int) -> tuple[list[tuple[int, int]], bool] | None:
        """The next group: the first ``size`` queued workers, unless the frozen filter swaps
        some; None to wait for one more ready signal first.

        Frozen means the sync graph over the window (the last T - 1 groups and the candidate)
        splits the workers that appear in it into several components. Workers absent from
        the whole window (slow ones) do not count: they are not cut off by the grouping, and
        waiting for them would stall the others. When no queued worker can repair a frozen
        candidate and the queue holds nothing else, the controller waits for the next ready
        signal (a worker of another component is usually a moment behind: with groups formed
        as soon as P workers are queued, the queue never holds more); after that one it
        accepts the group as it is."""
        queue = list(self.queue)
        chosen = list(range(size))
        repaired = False
        if self._window_full(size):
            window = self._window
            root = {rank: window.find(rank) for rank, _ in queue}
            covered = {root[queue[i][0]] for i in chosen}
            # The components that must be covered: those of the chosen and every live one
            # (holding a worker of the window that has not left). Only queued workers' are
            # ever looked up, so those are all this set needs.
            required = covered | {r for r in root.values() if window.is_live(r)}
            if not self._covers_live(covered):
                repaired = self._repair(queue, chosen, root, covered, required)
                if not repaired and len(queue) == size and not self._held:
                    self._held = True
                    self.holds += 1
                    return None
                if not self._covers_live(covered):
                    self.frozen_accepted += 1  # nothing queued could connect it: accept, never stall
        self._held = False
        picked = [queue[i] for i in chosen]
        taken = set(chosen)
        self.queue = deque(entry for i, entry in enumerate(queue) if i not in taken)
        for rank, _ in picked:
            self.queued.discard(rank)
        if repaired:
            self.repairs += 1
        return picked, repaired

    def _window_full(self, size: int) -> bool:
        """The filter judges only a full window of T groups: before that the graph cannot be
        expected to connect (and a group of everyone left always connects it)."""
        return (self.frozen_window > 0 and 1 < size < self.alive
                and len(self.recent) >= self.frozen_window - 1)

    def _covers_live(self, covered: set[int]) -> bool:
        """Whether the candidate's components include every live component of the window."""
        window = self._window
        return sum(1 for r in covered if window.is_live(r)) == window.live_components

    @staticmethod
    def _repair(queue: Sequence[tuple[int, int]], chosen: list[int], root: dict[int, int],
                covered: set[int], required: set[int]) -> bool:
        """Swap members that reach no new component for the earliest queued workers of
        required components the candidate misses; ``chosen`` and ``covered`` are updated in
        place. Whether anything was swapped."""
        swapped = False
        outside = list(range(len(chosen), len(queue)))
        while True:
            seen: set[int] = set()
            redundant = []
            for position, i in enumerate(chosen):
                component = root[queue[i][0]]
                if component in seen:
                    redundant.append(position)
                seen.add(component)
            newcomer = next((i for i in outside
                             if root[queue[i][0]] in required and root[queue[i][0]] not in covered), None)
            if not redundant or newcomer is None:
                return swapped
            position = redundant[-1]  # the latest arrival among the redundant members waits
            outside.remove(newcomer)
            chosen[position] = newcomer
            covered.add(root[queue[newcomer][0]])
            swapped = True

    def _broadcast(self, picked: list[tuple[int, int]], repaired: bool, *, shrunk: bool) -> list[Send]:
        picked = sorted(picked)
        members = [rank for rank, _ in picked]
        counters = [k for _, k in picked]
        weights = group_weights(self.weights, counters, ema_decay=self.ema_decay,
                                missing_policy=self.missing_policy)
        gid = self.next_gid
        self.next_gid += 1
        newest = max(counters)
        if self.recent.maxlen:
            if len(self.recent) == self.recent.maxlen:
                self._window.pop_oldest()
            self.recent.append(tuple(members))
            self._window.push(members)
        if shrunk:
            self.shrunk_groups += 1
        if self.log is not None:
            self.log.append(FormedGroup(gid, tuple(members), tuple(weights), newest, repaired))
        message = {"t": GROUP, "gid": gid, "members": members, "weights": weights, "iter": newest}
        return [Send(rank, dict(message)) for rank in members]

    # ------------------------------------------------------------------ records
    def summary(self) -> dict[str, Any]:
        return {"groups": self.next_gid, "group_size": self.group_size, "weights": self.weights,
                "frozen_window": self.frozen_window, "repairs": self.repairs, "holds": self.holds,
                "frozen_accepted": self.frozen_accepted, "shrunk_groups": self.shrunk_groups,
                "queue_high_water": self.queue_high_water, "left": sorted(self.gone)}


def sync_graph_connected(groups: Iterable[Sequence[int]], ranks: Iterable[int], world_size: int) -> bool:
    """Whether the groups join all of ``ranks`` into one component (the sync graph's test)."""
    components = _Components(world_size)
    for members in groups:
        components.join(members)
    return len({components.find(r) for r in ranks}) <= 1

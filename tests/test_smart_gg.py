"""Prague's smart Group Generator: its invariants over long random runs, and its components.

The runs drive the state machine through its public messages (req / go / ack / bye) with a
seeded discrete-event scheduler: workers of different speeds, random message latencies (FIFO
per link, as over ZeroMQ), workers that leave early. The harness keeps its own book of which
groups each worker is in and checks every GO and every Global Division against it.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hopnet.config import ProtocolConfig
from hopnet.config_checks import check_config_for_graph
from hopnet.coordinator import BadCoordinatorMessage, make_coordinator
from hopnet.protocols.prague.smart_gg import GROUP_KINDS, GroupFormed, SmartGroupGenerator
from hopnet.graph import Graph


def req(k: int = 0) -> dict[str, Any]:
    return {"t": "req", "iter": k}


def ack(gid: int) -> dict[str, Any]:
    return {"t": "ack", "gid": gid}


def gos(sends: list) -> dict[int, dict[str, Any]]:
    """The GO messages of one reply, by receiver."""
    out = {}
    for send in sends:
        assert send.message["t"] == "go"
        assert send.to not in out
        out[send.to] = send.message
    return out


# -- the random-run harness ---------------------------------------------------------------

@dataclass
class Worker:
    rank: int
    target: int
    speed: float
    leave: str = "bye"  # "bye": says bye; "gone": the host reports it gone (no bye)
    k: int = 0
    state: str = "compute"
    inbox: deque = field(default_factory=deque)
    running: dict[str, Any] | None = None


class Run:
    """One random run of the generator with ``world`` workers."""

    def __init__(self, seed: int, world: int, *, iterations: list[int], speeds: list[float],
                 machines: list[str] | None = None, leave: list[str] | None = None, **options: Any) -> None:
        self.rng = random.Random(seed)
        self.options = options
        self.machines = machines
        self.formed_now: list[GroupFormed] = []
        self.gg = SmartGroupGenerator(world, machines=machines, seed=seed, on_formed=self.formed_now.append,
                                      **options)
        self.group_buffer = options.get("group_buffer", True)
        self.inter_intra = self.gg.inter_intra
        self.world = world
        self.workers = [Worker(r, iterations[r], speeds[r], (leave or ["bye"] * world)[r]) for r in range(world)]
        self.events: list[tuple[float, int, Any]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.link_free: dict[tuple[str, int], float] = {}
        # the harness's own book
        self.requests = [0] * world
        self.members: dict[int, list[int]] = {}      # unfinished groups -> current members
        self.started: set[int] = set()
        self.in_groups: list[set[int]] = [set() for _ in range(world)]  # unfinished groups of each worker
        self.assigned: list[list[int]] = [[] for _ in range(world)]    # its Group Buffer: made, not yet taken
        self.taken: list[int | None] = [None] * world                  # the group its pending request took
        self.unacked_go: list[int | None] = [None] * world
        self.last_go = [-1] * world
        self.entered: dict[int, set[int]] = {}
        self.gone: set[int] = set()
        self.divisions = 0
        self.replies = 0
        self.max_buffer = 0

    # scheduling
    def at(self, delay: float, action: Any) -> None:
        heapq.heappush(self.events, (self.now + delay, next(self.seq), action))

    def send(self, link: tuple[str, int], action: Any) -> None:
        """Deliver ``action`` after a random latency, in order on its link."""
        due = max(self.now + self.rng.uniform(0.001, 0.05), self.link_free.get(link, 0.0) + 1e-9)
        self.link_free[link] = due
        heapq.heappush(self.events, (due, next(self.seq), action))

    def run(self) -> None:
        for w in self.workers:
            self.start_iteration(w)
        steps = 0
        while self.events:
            self.now, _, action = heapq.heappop(self.events)
            action()
            steps += 1
            assert steps < 2_000_000
        stuck = [(w.rank, w.k, w.state, list(w.inbox)) for w in self.workers if w.state != "done"]
        assert not stuck, f"deadlock: workers never finished: {stuck[:4]} buffers " \
                          f"{[self.gg.buffer(r) for r, *_ in stuck[:4]]}"
        assert self.gg.summary()["unfinished_groups"] == 0
        assert self.gg.locked() == frozenset()

    # the workers
    def start_iteration(self, w: Worker) -> None:
        if w.k == w.target:
            w.state = "done"
            assert not w.inbox, f"worker {w.rank} leaves with GO'd groups it never ran: {list(w.inbox)}"
            if w.leave == "bye":
                self.send(("up", w.rank), lambda: self.to_gg(w.rank, {"t": "bye"}))
            else:
                self.send(("up", w.rank), lambda: self.worker_gone(w.rank))
            return
        w.state = "compute"
        self.send(("up", w.rank), lambda: self.to_gg(w.rank, req(w.k)))
        self.at(self.rng.uniform(0.5, 1.5) * w.speed, lambda: self.compute_done(w))

    def compute_done(self, w: Worker) -> None:
        w.state = "sync"
        self.try_run(w)

    def receive_go(self, w: Worker, go: dict[str, Any]) -> None:
        assert w.state != "done", f"GO {go} for worker {w.rank}, which has left"
        w.inbox.append(go)
        self.try_run(w)

    def try_run(self, w: Worker) -> None:
        if w.state != "sync" or not w.inbox:
            return
        go = w.inbox.popleft()
        w.state, w.running = "in", go
        gid = go["gid"]
        self.entered.setdefault(gid, set()).add(w.rank)
        if self.entered[gid] == set(go["members"]):  # the P-Reduce completes when all are in
            del self.entered[gid]
            for member in go["members"]:
                worker = self.workers[member]
                self.at(self.rng.uniform(0.01, 0.2), lambda worker=worker: self.finish_group(worker))

    def finish_group(self, w: Worker) -> None:
        go = w.running
        assert go is not None
        w.running = None
        self.send(("up", w.rank), lambda: self.to_gg(w.rank, ack(go["gid"])))
        if go["reply"]:
            self.replies += 1
            w.k += 1
            self.start_iteration(w)
        else:
            w.state = "sync"
            self.try_run(w)

    # the generator, and the checks on what it says
    def idle(self) -> set[int]:
        """Workers with no group waiting for them (with the buffer off: none made and not yet GO'd)."""
        if self.group_buffer:
            return {r for r in range(self.world) if not self.assigned[r] and r not in self.gone}
        return {r for r in range(self.world) if r not in self.gone and self.in_groups[r] <= self.started}

    def take(self, worker: int) -> None:
        """With the Group Buffer, a request takes the oldest group made for the worker."""
        if self.group_buffer and worker not in self.gone:
            assert self.assigned[worker], f"worker {worker}'s request found no group"
            self.taken[worker] = self.assigned[worker].pop(0)

    def to_gg(self, sender: int, message: dict[str, Any]) -> None:
        retake: list[int] = []
        if message["t"] == "req":
            self.requests[sender] += 1
            retake = [sender]
        elif message["t"] == "ack":
            gid = message["gid"]
            assert self.unacked_go[sender] == gid
            self.unacked_go[sender] = None
            self.in_groups[sender].discard(gid)
        elif message["t"] == "bye":
            retake = self.book_gone(sender)
        buffered = {w for w in retake if self.assigned[w]}
        for w in buffered:
            self.take(w)
        idle_before = self.idle()
        self.formed_now.clear()
        sends = self.gg.on_message(sender, message)
        self.check_formed(idle_before)
        for w in retake:
            if w not in buffered:
                self.take(w)
        self.deliver(sends)

    def worker_gone(self, rank: int) -> None:
        retake = self.book_gone(rank)
        buffered = {w for w in retake if self.assigned[w]}
        for w in buffered:
            self.take(w)
        idle_before = self.idle()
        self.formed_now.clear()
        sends = self.gg.on_worker_gone(rank)
        self.check_formed(idle_before)
        for w in retake:
            if w not in buffered:
                self.take(w)
        self.deliver(sends)

    def book_gone(self, rank: int) -> list[int]:
        """Our model of a departure: dropped from groups not yet GO'd; a group left alone is
        cancelled. Returns the workers whose taken group was cancelled (they take another)."""
        self.gone.add(rank)
        retake = []
        for gid in sorted(self.in_groups[rank]):
            if gid in self.started:
                continue
            self.members[gid].remove(rank)
            if len(self.members[gid]) < 2:
                for member in self.members.pop(gid):
                    self.in_groups[member].discard(gid)
                    if gid in self.assigned[member]:
                        self.assigned[member].remove(gid)
                    if self.taken[member] == gid:
                        self.taken[member] = None
                        retake.append(member)
        self.in_groups[rank] = set()
        self.assigned[rank] = []
        self.taken[rank] = None
        return retake

    def check_formed(self, idle: set[int]) -> None:
        """Check the groups one message made, one random group or one division at a time."""
        batches: dict[tuple[int, int | None, int], list[GroupFormed]] = {}
        for group in self.formed_now:
            key = (group.initiator, group.division, group.gid if group.division is None else -1)
            batches.setdefault(key, []).append(group)
        for (initiator, _, _), formed in batches.items():
            self.check_batch(initiator, formed, idle)
            idle -= set().union(*(g.members for g in formed))
            if self.group_buffer and sum(initiator in g.members for g in formed) == 1:
                # Its one group answers its request at once (buffer -> queue): its buffer is empty
                # again, so a later division of the same message (several workers served after a
                # departure) may take it, as the generator's idle rule says.
                idle.add(initiator)

    def check_batch(self, initiator: int, formed: list[GroupFormed], idle_before: set[int]) -> None:
        for group in formed:
            members = list(group.members)
            assert members == sorted(set(members)), f"members not distinct and sorted: {group}"
            assert not self.gone.intersection(members), f"a group with a worker that left: {group}"
            assert group.kind in GROUP_KINDS
            self.members[group.gid] = members
            for member in members:
                self.in_groups[member].add(group.gid)
                if self.group_buffer:
                    self.assigned[member].append(group.gid)
        assert any(initiator in g.members for g in formed), f"the initiator {initiator} is in none of {formed}"
        kinds = {g.kind for g in formed}
        if kinds == {"random"}:
            assert len(formed) == 1
            assert len(formed[0].members) == min(self.gg.group_size, self.world - len(self.gone))
            return
        self.divisions += 1
        assert {g.division for g in formed} == {self.divisions}
        filt = self.gg.slow_filter
        for group in formed:
            for member in group.members:
                if member != initiator:
                    assert member in idle_before, f"division {group} took busy worker {member}"
                    assert not filt or self.requests[initiator] - self.requests[member] < filt, \
                        f"worker {member} passed the filter with c_i={self.requests[initiator]}, " \
                        f"c_w={self.requests[member]}, C={filt}"
        eligible = {initiator} | {w for w in idle_before
                                  if not filt or self.requests[initiator] - self.requests[w] < filt}
        union = set().union(*(g.members for g in formed))
        assert union <= eligible
        if not self.inter_intra:
            assert kinds == {"division"}
            assert sum(len(g.members) for g in formed) == len(union), f"division not disjoint: {formed}"
            assert union == eligible, f"division left out eligible workers: {eligible - union}"
            sizes = [len(g.members) for g in formed]
            size = self.gg.group_size
            assert all(s == size for s in sizes[:-1]) and (len(sizes) == 1 or size <= sizes[-1] < 2 * size), \
                f"division sizes {sizes}: groups of {size}, leftovers merged into the last"
        else:
            self.check_inter_intra(formed, initiator)
        limit = 2 if self.inter_intra else 1
        if self.group_buffer:
            for member in union:
                assert len(self.assigned[member]) <= limit, \
                    f"worker {member} buffers {len(self.assigned[member])} groups (limit {limit})"
                self.max_buffer = max(self.max_buffer, len(self.assigned[member]))

    def check_inter_intra(self, formed: list[GroupFormed], initiator: int) -> None:
        assert self.machines is not None
        inter = [g for g in formed if g.kind == "inter"]
        intra = [g for g in formed if g.kind == "intra"]
        assert len(inter) + len(intra) == len(formed)
        assert max((g.gid for g in inter), default=-1) < min((g.gid for g in intra), default=1 << 60), \
            "intra groups made before inter groups"
        for phase in (inter, intra):
            assert sum(len(g.members) for g in phase) == len(set().union(*(g.members for g in phase))), \
                f"one phase's groups overlap: {phase}"
        heads: dict[str, list[int]] = {}
        for group in inter:
            machines = {self.machines[m] for m in group.members}
            if len(machines) > 1:
                assert len(machines) == len(group.members), f"two workers of one machine cross machines: {group}"
                assert 2 <= len(group.members) <= 3, f"heads in a group of {len(group.members)}"
                for member in group.members:
                    heads.setdefault(self.machines[member], []).append(member)
        assert all(len(h) == 1 for h in heads.values()), f"more than one head on a machine: {heads}"
        division = set().union(*(g.members for g in formed))
        live = [w for w in range(self.world) if w not in self.gone]
        filt = self.gg.slow_filter
        lagging = bool(filt) and max(self.requests[w] for w in live) - self.requests[initiator] >= filt
        if lagging and any(initiator in g.members and len(g.members) > 1 for g in inter):
            assert initiator in heads.get(self.machines[initiator], [initiator]), "a lagging initiator heads"
        for group in intra:
            machines = {self.machines[m] for m in group.members}
            assert len(machines) == 1, f"an intra group across machines: {group}"
            on_machine = {w for w in division if self.machines[w] in machines}
            if lagging:  # it stays out of its machine's Intra group
                on_machine.discard(initiator)
            assert set(group.members) == on_machine or group.members == (initiator,), \
                f"intra group {group.members} is not all of the division's workers on its machine {on_machine}"

    def deliver(self, sends: list) -> None:
        by_gid: dict[int, list[int]] = {}
        for send in sends:
            go = send.message
            assert go["t"] == "go"
            gid, w = go["gid"], send.to
            assert self.unacked_go[w] is None, \
                f"worker {w} GO'd group {gid} while still in group {self.unacked_go[w]}: two concurrent groups"
            assert gid > self.last_go[w], f"worker {w} GO'd group {gid} after group {self.last_go[w]}"
            assert self.in_groups[w] and min(self.in_groups[w]) == gid, \
                f"worker {w} GO'd group {gid} before its older group {min(self.in_groups[w])}"
            assert go["members"] == self.members[gid]
            self.unacked_go[w], self.last_go[w] = gid, gid
            by_gid.setdefault(gid, []).append(w)
            if self.group_buffer:
                assert go["reply"] is True
                assert self.taken[w] == gid, f"group {gid} GO'd to worker {w}, whose request took {self.taken[w]}"
                self.taken[w] = None
            worker = self.workers[w]
            self.send(("down", w), lambda worker=worker, go=go: self.receive_go(worker, go))
        for gid, receivers in by_gid.items():
            assert gid not in self.started, f"group {gid} GO'd twice"
            assert sorted(receivers) == self.members[gid], f"group {gid} GO'd to {receivers} only"
            self.started.add(gid)


def one_run(seed: int, world: int, *, slow: bool, leaving: bool, labelled: bool, per_machine: int = 4,
            **options: Any) -> Run:
    rng = random.Random(seed ^ 0x5EED)
    iterations = [30] * world
    leave = ["bye"] * world
    if leaving:
        for r in rng.sample(range(world), max(1, world // 4)):
            iterations[r] = rng.randint(0, 20)
            leave[r] = rng.choice(["bye", "gone"])
    speeds = [1.0] * world
    if slow:
        speeds[rng.randrange(world)] = 5.0
    machines = [f"host{r // per_machine}" for r in range(world)] if labelled else None
    run = Run(seed, world, iterations=iterations, speeds=speeds, machines=machines, leave=leave, **options)
    run.run()
    assert run.replies == sum(iterations), "a request went unanswered"
    return run


# -- invariants over long random runs ------------------------------------------------------

@settings(max_examples=40, deadline=None)
@example(seed=76348415, world=10, group_size=2, group_buffer=True, global_division=True, inter_intra=True,
         slow_filter=2, slow=False, leaving=False, per_machine=3)  # two divisions on one departure
@given(seed=st.integers(0, 2**32 - 1), world=st.integers(2, 16), group_size=st.integers(2, 4),
       group_buffer=st.booleans(), global_division=st.booleans(), inter_intra=st.booleans(),
       slow_filter=st.sampled_from([0, 1, 2, 4]), slow=st.booleans(), leaving=st.booleans(),
       per_machine=st.integers(1, 5))
def test_random_runs_keep_every_invariant(seed: int, world: int, group_size: int, group_buffer: bool,
                                          global_division: bool, inter_intra: bool, slow_filter: int,
                                          slow: bool, leaving: bool, per_machine: int) -> None:
    run = one_run(seed, world, slow=slow, leaving=leaving, labelled=True, per_machine=per_machine,
                  group_size=group_size, group_buffer=group_buffer, global_division=global_division,
                  inter_intra=inter_intra, slow_filter=slow_filter)
    summary = run.gg.summary()
    assert summary["requests"] == sum(r.k for r in run.workers)
    assert summary["global_divisions"] == run.divisions
    if group_buffer and global_division:
        assert summary["max_buffer"] <= (2 if run.inter_intra else 1)


def test_sixteen_workers_on_four_machines_with_a_slow_one_and_every_component_on() -> None:
    run = one_run(7, 16, slow=True, leaving=False, labelled=True)
    summary = run.gg.summary()
    assert summary["inter_intra"] == "on (4 machines)"
    assert run.max_buffer == 2 and summary["max_buffer"] == 2
    assert summary["inter_groups"] > 0 and summary["intra_groups"] > 0
    assert summary["filtered_out"] > 0  # the 5x slower worker is left out of fast workers' divisions
    assert summary["buffer_hits"] > summary["global_divisions"]  # most requests are served from the buffer


def test_leaving_workers_do_not_strand_the_others() -> None:
    for seed in range(8):
        run = one_run(seed, 12, slow=False, leaving=True, labelled=True)
        assert run.gg.summary()["workers_gone"] == run.world


# -- the components, one by one -------------------------------------------------------------

def test_global_division_of_figure_11() -> None:
    """4 workers, empty buffers: W0's request divides everyone into two disjoint pairs."""
    formed: list[GroupFormed] = []
    gg = SmartGroupGenerator(4, group_size=2, inter_intra=False, slow_filter=0, on_formed=formed.append)
    assert gg.on_message(0, req()) == []  # its partner has not asked yet
    assert len(formed) == 2 and {g.kind for g in formed} == {"division"}
    assert sorted(m for g in formed for m in g.members) == [0, 1, 2, 3]
    partner = next(m for g in formed if 0 in g.members for m in g.members if m != 0)
    others = next(g.members for g in formed if 0 not in g.members)
    sent = gos(gg.on_message(partner, req()))
    assert sorted(sent) == sorted([0, partner])
    assert all(go["reply"] and go["members"] == sorted([0, partner]) for go in sent.values())
    assert gg.on_message(others[0], req()) == []
    assert sorted(gos(gg.on_message(others[1], req()))) == list(others)  # from the buffer, no new division
    summary = gg.summary()
    assert (summary["global_divisions"], summary["groups_formed"], summary["buffer_hits"]) == (1, 2, 3)
    assert gg.locked() == frozenset(range(4))


def test_a_group_starts_only_when_every_member_asked_and_an_ack_releases_the_lock() -> None:
    gg = SmartGroupGenerator(3, group_size=3, inter_intra=False, slow_filter=0)
    assert gg.on_message(0, req()) == [] and gg.on_message(1, req()) == []
    sent = gos(gg.on_message(2, req()))
    gid = sent[0]["gid"]
    assert sorted(sent) == [0, 1, 2] and gg.locked() == {0, 1, 2}
    assert gg.on_message(0, ack(gid)) == [] and gg.locked() == {1, 2}
    # 0's next request: its buffer is empty, so a new division of the idle workers, i.e. of
    # everyone whose buffer is empty (1 and 2 took theirs, though they still run it)
    assert gg.on_message(0, req(1)) == []
    new = (0, 1, 2)
    assert gg.buffer(1) == gg.buffer(2) == (new,) and gg.lock_queue(0) == (new,)
    assert gg.on_message(1, ack(gid)) == [] and gg.on_message(1, req(1)) == []
    assert gg.on_message(2, req(1)) == []  # asked before its ACK: took the group, which waits for that ACK
    assert gg.lock_queue(2) == ((0, 1, 2), new) and gg.locked() == {2}
    sent = gos(gg.on_message(2, ack(gid)))
    assert sorted(sent) == [0, 1, 2] and all(go["gid"] > gid and go["reply"] for go in sent.values())
    summary = gg.summary()
    assert (summary["requests"], summary["global_divisions"], summary["buffer_hits"]) == (6, 2, 4)


class Driver:
    """Workers that ask when told to and run every GO'd group at once (each member ACKs)."""

    def __init__(self, gg: SmartGroupGenerator) -> None:
        self.gg = gg
        self.waiting: set[int] = set()
        self.iteration = [0] * gg.world_size
        self.asked = [0] * gg.world_size
        self.ran: list[list[int]] = []

    def ask(self, worker: int) -> None:
        assert worker not in self.waiting
        self.waiting.add(worker)
        self.asked[worker] += 1
        self.run(self.gg.on_message(worker, req(self.iteration[worker])))

    def run(self, sends: list) -> None:
        by_gid: dict[int, list[int]] = {}
        for send in sends:
            by_gid.setdefault(send.message["gid"], send.message["members"])
            if send.message["reply"]:
                self.waiting.discard(send.to)
                self.iteration[send.to] += 1
        for gid, members in by_gid.items():
            self.ran.append(members)
            for member in members:
                self.run(self.gg.on_message(member, ack(gid)))


def slow_run(slow_filter: int, seed: int) -> tuple[list[int], dict[str, int]]:
    """Workers 0-4 ask whenever their last request is answered; worker 5 every 4th round."""
    gg = SmartGroupGenerator(6, group_size=2, inter_intra=False, slow_filter=slow_filter, seed=seed)
    driver = Driver(gg)
    for round_ in range(40):
        for w in range(5):
            if w not in driver.waiting:
                driver.ask(w)
        if round_ % 4 == 3 and 5 not in driver.waiting:
            driver.ask(5)
    return driver.iteration, gg.summary()["filtered_out_by_rank"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_slow_filter_keeps_fast_workers_from_waiting_on_a_slow_one(seed: int) -> None:
    """Sec. 5.3: with C = 2 a fast initiator leaves the slow worker out of its divisions, so the
    fast workers stop waiting on it; the slow worker still syncs, with whoever is idle."""
    unfiltered, none_out = slow_run(0, seed)
    filtered, out = slow_run(2, seed)
    assert none_out == {}
    assert max(out, key=out.get) == "5"  # the slow worker is the one left out, most of all
    assert sum(filtered[:5]) >= 1.2 * sum(unfiltered[:5])  # fast workers run more iterations
    assert filtered[5] >= 8  # 10 requests in 40 rounds, nearly all answered with a group


def test_inter_intra_on_sixteen_workers_of_four_machines() -> None:
    machines = [f"m{r // 4}" for r in range(16)]
    formed: list[GroupFormed] = []
    gg = SmartGroupGenerator(16, machines=machines, slow_filter=0, on_formed=formed.append)
    driver = Driver(gg)
    heads_seen = []
    for round_ in range(4):
        formed.clear()
        for w in range(16):
            driver.ask(w)  # the first request divides everyone; the others come from the buffers
        assert gg.summary()["global_divisions"] == round_ + 1
        inter = [g.members for g in formed if g.kind == "inter"]
        intra = sorted(g.members for g in formed if g.kind == "intra")
        assert intra == [tuple(range(4 * m, 4 * m + 4)) for m in range(4)]
        crossing = [g for g in inter if len({r // 4 for r in g}) > 1]
        assert sorted(len(g) for g in crossing) == [2, 2]  # 4 heads in groups of 2-3
        heads = sorted(r for g in crossing for r in g)
        assert sorted(len(g) for g in inter if g not in crossing) == [3, 3, 3, 3]  # the non-heads, locally
        heads_seen.append(heads)
        assert all(len(gg.buffer(w)) == 1 for w in range(16))  # each ran its inter group; intra is next
        for w in range(16):
            driver.ask(w)
        assert all(gg.buffer(w) == () for w in range(16))
    # head workers rotate round-robin: each GD moves every machine's head to its next local worker
    assert heads_seen == [[4 * m + k for m in range(4)] for k in range(4)]


def test_a_slow_initiator_heads_its_machine_and_leaves_the_intra_group_to_its_mates() -> None:
    """Rank 1 asks every 4th round, the others whenever they can. Once it is C = 2 requests
    behind, its own divisions make it its machine's head and keep it out of the Intra group,
    so its machine-mates keep pace with the other machine."""
    formed: list[GroupFormed] = []
    machines = [f"m{r // 4}" for r in range(8)]
    gg = SmartGroupGenerator(8, machines=machines, slow_filter=2, seed=4, on_formed=formed.append)
    driver = Driver(gg)
    slow_divisions = 0
    for round_ in range(40):
        for w in [0, 2, 3, 4, 5, 6, 7]:
            if w not in driver.waiting:
                driver.ask(w)
        if round_ % 4 == 3 and 1 not in driver.waiting:
            formed.clear()
            lagging = max(driver.asked) - (driver.asked[1] + 1) >= 2
            driver.ask(1)
            if formed and lagging:
                slow_divisions += 1
                intra = [g.members for g in formed if g.kind == "intra"]
                assert all(1 not in g for g in intra if len(g) > 1), f"rank 1 in an intra group: {intra}"
                crossing = [g.members for g in formed if g.kind == "inter" and len({m // 4 for m in g.members}) > 1]
                assert all(1 in g for g in crossing if any(m < 4 for m in g)), "rank 1 is not machine 0's head"
    assert slow_divisions >= 3
    mates, others = driver.iteration[0] + driver.iteration[2] + driver.iteration[3], sum(driver.iteration[4:])
    assert mates / 3 >= 0.7 * others / 4, (driver.iteration, "rank 1's mates kept at its pace")


def test_inter_intra_is_off_without_machine_labels_and_says_so() -> None:
    gg = SmartGroupGenerator(8, machines=[None] * 8)
    assert not gg.inter_intra
    assert gg.summary()["inter_intra"] == "off: the graph has no machine labels"
    config = ProtocolConfig(protocol="prague")
    notes = check_config_for_graph(config, Graph.ring(8))
    assert any("Inter-Intra is off" in note for note in notes)
    assert not check_config_for_graph(config, Graph.hierarchical([4, 4]))
    off = SmartGroupGenerator(8, machines=[f"m{r // 4}" for r in range(8)], global_division=False)
    assert off.summary()["inter_intra"].startswith("off: Inter-Intra phases are made by Global Division")


def test_group_buffer_off_answers_only_the_initiator_and_others_run_it_before_their_own() -> None:
    gg = SmartGroupGenerator(3, group_size=3, group_buffer=False, global_division=False, inter_intra=False)
    assert gg.on_message(0, req()) == []  # group {0,1,2} answers 0; it starts when all three wait
    assert gg.on_message(1, req()) == []  # 1's own group {0,1,2} queues behind the first
    sent = gos(gg.on_message(2, req()))
    assert {w: go["reply"] for w, go in sent.items()} == {0: True, 1: False, 2: False}
    first = sent[0]["gid"]
    for w in (0, 1):
        assert gg.on_message(w, ack(first)) == []
    sent = gos(gg.on_message(2, ack(first)))  # 1's group: 0 is no longer waiting, so it waits for 0
    assert sent == {}
    sent = gos(gg.on_message(0, req(1)))
    assert sorted(sent) == [0, 1, 2] and sent[1]["reply"] and not sent[0]["reply"]
    assert sent[1]["gid"] > first


def test_a_worker_that_leaves_is_dropped_from_buffered_groups_and_a_lone_member_is_served_again() -> None:
    formed: list[GroupFormed] = []
    gg = SmartGroupGenerator(4, group_size=2, inter_intra=False, slow_filter=0, on_formed=formed.append)
    assert gg.on_message(0, req()) == []
    partner = next(m for g in formed if 0 in g.members for m in g.members if m != 0)
    formed.clear()
    sent = gos(gg.on_message(partner, {"t": "bye"}))  # 0's pair is cancelled; 0 is served by a new division
    assert gg.summary()["groups_cancelled"] == 1
    new = [g for g in formed if 0 in g.members]
    assert len(new) == 1 and partner not in new[0].members
    if len(new[0].members) == 1:
        assert sent[0]["members"] == [0] and sent[0]["reply"]
    # a group of three loses one member and goes on with two
    formed.clear()
    gg = SmartGroupGenerator(3, group_size=3, inter_intra=False, slow_filter=0, on_formed=formed.append)
    assert gg.on_message(0, req()) == [] and gg.on_message(1, req()) == []
    sent = gos(gg.on_worker_gone(2))
    assert sorted(sent) == [0, 1] and sent[0]["members"] == [0, 1]
    with pytest.raises(BadCoordinatorMessage):
        gg.on_message(2, req(1))
    assert gg.on_worker_gone(2) == []  # twice is harmless


def test_a_worker_gone_inside_a_running_group_counts_as_acked() -> None:
    gg = SmartGroupGenerator(2, group_size=2, inter_intra=False, slow_filter=0)
    gg.on_message(0, req())
    gid = gos(gg.on_message(1, req()))[0]["gid"]
    assert gg.on_worker_gone(1) == []
    assert gg.locked() == {0}
    gg.on_message(0, ack(gid))
    assert gg.locked() == frozenset() and gg.summary()["unfinished_groups"] == 0
    assert gos(gg.on_message(0, req(1)))[0]["members"] == [0]  # alone: a counted no sync
    assert gg.summary()["no_syncs"] == 1


@pytest.mark.parametrize("message", [
    {"t": "nope"}, {"t": "req"}, {"t": "req", "iter": -1}, {"t": "req", "iter": True}, {"t": "ack", "gid": 99},
    {"t": "ack"}, ["req"]])
def test_bad_messages_are_refused_and_change_nothing(message: Any) -> None:
    gg = SmartGroupGenerator(2, group_size=2, inter_intra=False)
    gg.on_message(0, req())
    before = (gg.summary(), gg.buffer(0), gg.buffer(1))
    with pytest.raises(BadCoordinatorMessage):
        gg.on_message(1, message)
    assert (gg.summary(), gg.buffer(0), gg.buffer(1)) == before
    with pytest.raises(BadCoordinatorMessage, match="still unanswered"):
        gg.on_message(0, req(1))
    with pytest.raises(BadCoordinatorMessage):
        gg.on_message(5, req())
    assert sorted(gos(gg.on_message(1, req()))) == [0, 1]


def test_make_coordinator_picks_the_smart_generator() -> None:
    graph = Graph.hierarchical([4, 4])
    gg = make_coordinator(ProtocolConfig(protocol="prague", group_size=4, slow_filter=3, seed=5), graph)
    assert isinstance(gg, SmartGroupGenerator)
    assert (gg.world_size, gg.group_size, gg.slow_filter, gg.inter_intra) == (8, 4, 3, True)
    assert make_coordinator(ProtocolConfig(protocol="prague", group_generator="static"), graph) is None
    assert make_coordinator(ProtocolConfig(protocol="hop"), graph) is None


# -- end to end, in the simulator -------------------------------------------------------------

def test_prague_smart_and_static_run_sixteen_workers_on_four_machines_in_the_simulator() -> None:
    """The protocol (coord's prague.py) with this generator and with the static schedule, on the
    simulator's virtual loop; one smart worker leaves early. P-Reduce keeps the models' sum, and
    what each worker ran is what the schedule, or the generator's rules, say."""
    import torch

    from hopnet.protocols.prague.static_schedule import static_group
    from hopnet.sim.engine import ComputeModel, SimSpec, simulate
    from hopnet.transports.inproc import LinkModel

    graph = Graph.hierarchical([4, 4, 4, 4])
    iterations, dim = 8, 16
    for generator in ("smart", "static"):
        config = ProtocolConfig(protocol="prague", group_generator=generator, seed=3)
        stop_at = {5: 3} if generator == "smart" else {}
        result = simulate(SimSpec(graph, config, iterations, ComputeModel.parse("uniform:5:15"), param_dim=dim,
                                  link=LinkModel(latency_s=2e-4), stop_at=stop_at, keep_events=True))
        before = [torch.randn(dim, generator=torch.Generator().manual_seed(config.seed * 1_000_003 + r),
                              dtype=torch.float64) for r in range(16)]
        assert result.iterations == [stop_at.get(r, iterations) for r in range(16)]
        assert result.params is not None
        assert torch.allclose(sum(result.params), sum(before), rtol=0, atol=1e-9)
        assert result.events is not None
        for rank, records in enumerate(result.events):
            groups = [r["group"] for r in records if r["event"] == "iteration"]
            assert len(groups) == stop_at.get(rank, iterations)
            for k, group in enumerate(groups):
                assert rank in group and group == sorted(set(group))
                if generator == "static":
                    assert group == list(static_group(rank, k, graph.machines) or [rank])
                else:  # a group that crosses machines holds one head per machine
                    machines = [graph.machine(m) for m in group]
                    assert len(set(machines)) in (1, len(group)), f"rank {rank} iteration {k}: {group}"
        if generator == "smart":
            summary = result.coordinator
            assert summary is not None
            assert summary["inter_intra"] == "on (4 machines)" and summary["max_buffer"] == 2
            assert summary["unfinished_groups"] == 0 and summary["workers_gone"] == 16
            # the early leaver asked for the iteration it then did not run
            assert summary["requests"] == sum(result.iterations) + len(stop_at)
            # it ran the group GO'd for that request while leaving; its ACK came after its bye
            assert set(summary["dropped"]) <= {"from_gone_worker"}
        else:
            assert result.coordinator is None

"""The coordinator host and Prague's random Group Generator, without processes.

The GG's invariants (Prague, ASPLOS'20, Sec. 4.1; specs B8) are checked after every message
of long random runs driven by a model of the workers; the host's handling of bad input,
goodbyes and silent workers with a fake clock.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from hopnet.coordinator.base import BadCoordinatorMessage, Send
from hopnet.coordinator.host import CoordinatorHost
from hopnet.protocols.prague.random_gg import RandomGroupGenerator
from hopnet.coordinator.wire import BadFrame, decode, encode, rank_of


class GGRun:
    """Drives a RandomGroupGenerator the way workers would, checking invariants at each step."""

    def __init__(self, n: int, size: int, seed: int) -> None:
        self.gg = RandomGroupGenerator(n, size, seed)
        self.n, self.size = n, size
        self.rng = random.Random(seed)
        self.inbox: dict[int, list[dict]] = defaultdict(list)  # GOs not yet run, per worker
        self.waiting_own: set[int] = set()  # workers with a request out
        self.gone: set[int] = set()
        self.go_order: dict[int, list[int]] = defaultdict(list)  # gids each worker was GO'd, in order
        self.members: dict[int, tuple[int, ...]] = {}
        self.initiator: dict[int, int] = {}
        self.active: dict[int, set[int]] = {}  # gid -> members that still owe the ack (the model's view)

    def deliver(self, sends: list[Send]) -> None:
        for send in sends:
            message = decode(encode(send.message))  # what goes on the wire
            assert message["t"] == "go"
            gid, members = message["gid"], tuple(message["members"])
            assert send.to in members and send.to not in self.gone
            if gid not in self.members:
                # size s, or every worker left when fewer remain (drawn before later departures)
                assert min(self.size, self.n - len(self.gone)) <= len(members) <= self.size, members
                self.members[gid] = members
                self.active[gid] = set(members)
            assert self.members[gid] == members
            if message["reply"]:
                self.initiator[gid] = send.to
            self.go_order[send.to].append(gid)
            self.inbox[send.to].append(message)
        self.check()

    def step(self) -> None:
        alive = [w for w in range(self.n) if w not in self.gone]
        w = self.rng.choice(alive)
        roll = self.rng.random()
        if roll < 0.002 and len(self.gone) < self.n // 2:  # leaves (or dies): the host tells the GG
            self.gone.add(w)
            self.waiting_own.discard(w)
            self.inbox.pop(w, None)
            for gid, owed in self.active.items():
                owed.discard(w)
            self.deliver(self.gg.on_worker_gone(w))
        elif w not in self.waiting_own and roll < 0.5:
            self.waiting_own.add(w)
            self.deliver(self.gg.on_message(w, {"t": "req", "iter": 0}))
        elif self.inbox[w]:  # at its sync point: run the first GO'd group, then ack
            message = self.inbox[w].pop(0)
            if message["reply"]:
                self.waiting_own.discard(w)
            self.active[message["gid"]].discard(w)
            self.deliver(self.gg.on_message(w, {"t": "ack", "gid": message["gid"]}))

    def check(self) -> None:
        gg = self.gg
        locked_by_groups = set()
        for gid, group in gg.active.items():
            assert not (group.waiting & locked_by_groups), "a worker in two active groups"
            locked_by_groups |= group.waiting
        for w in range(self.n):
            assert gg.locked[w] == (w in locked_by_groups), f"lock bit of {w}"
            assert len(self.inbox.get(w, [])) <= 1, "a worker GO'd a second group before acking the first"
        started = set(gg.active)
        for group in gg.pending:
            assert group.gid not in started

    def check_history(self) -> None:
        for gid, members in self.members.items():
            assert self.initiator[gid] in members, "every group contains its initiator"
            assert len(set(members)) == len(members), members
        for w, gids in self.go_order.items():
            # overlapping groups run in creation order: every worker sees its groups in gid order
            assert gids == sorted(gids), (w, gids)
        # a later group overtakes an earlier one only if they are disjoint: the groups of any
        # one worker started in creation order
        position = {gid: i for i, gid in enumerate(self.gg.started_order)}
        by_worker: dict[int, list[int]] = defaultdict(list)
        for gid in sorted(self.members):
            for w in self.members[gid]:
                by_worker[w].append(position[gid])
        for w, positions in by_worker.items():
            assert positions == sorted(positions), w


@pytest.mark.parametrize("n,size,seed", [(8, 3, 0), (5, 2, 1), (16, 3, 2), (4, 4, 3), (6, 3, 4)])
def test_random_gg_invariants_hold_over_long_random_runs(n: int, size: int, seed: int) -> None:
    run = GGRun(n, size, seed)
    for _ in range(5000):
        run.step()
    run.check_history()
    assert len(run.members) > 400
    # uniform draws: every two workers that stayed were grouped together at some point
    stayed = [w for w in range(n) if w not in run.gone]
    pairs = {(a, b) for m in run.members.values() for a in m for b in m if a < b}
    assert {(a, b) for a in stayed for b in stayed if a < b} <= pairs


def test_the_paper_example_group_waits_for_the_locks_and_starts_on_release() -> None:
    """Fig. 8: [0,4,5] runs; [4,5,7] waits; it starts once 4 and 5 are released."""
    gg = RandomGroupGenerator(8, 3, 0)
    gg._draw = lambda initiator: {0: (0, 4, 5), 7: (4, 5, 7), 1: (1, 2, 3)}[initiator]  # type: ignore[method-assign]
    first = gg.on_message(0, {"t": "req", "iter": 0})
    assert sorted(s.to for s in first) == [0, 4, 5] and all(s.message["t"] == "go" for s in first)
    assert [s.message["reply"] for s in sorted(first, key=lambda s: s.to)] == [True, False, False]
    assert gg.on_message(7, {"t": "req", "iter": 0}) == []  # pending: 4 and 5 are locked
    disjoint = gg.on_message(1, {"t": "req", "iter": 0})  # a later, disjoint group may overtake it
    assert sorted(s.to for s in disjoint) == [1, 2, 3]
    assert gg.on_message(0, {"t": "ack", "gid": 0}) == []
    assert gg.on_message(4, {"t": "ack", "gid": 0}) == []  # 5 still locked
    started = gg.on_message(5, {"t": "ack", "gid": 0})
    assert sorted(s.to for s in started) == [4, 5, 7] and started[0].message["gid"] == 1
    assert gg.locked == [False, True, True, True, True, True, False, True]


def test_a_worker_that_leaves_is_drawn_no_more_and_its_pending_groups_are_redrawn() -> None:
    gg = RandomGroupGenerator(4, 3, 0)
    gg._draw_real = gg._draw  # type: ignore[attr-defined]
    gg._draw = lambda i: {0: (0, 1, 2), 3: (1, 2, 3)}.get(i) or gg._draw_real(i)  # type: ignore[method-assign]
    gg.on_message(0, {"t": "req", "iter": 0})
    assert gg.on_message(3, {"t": "req", "iter": 0}) == []  # waits for 1 and 2
    gg._draw = gg._draw_real  # type: ignore[method-assign]
    assert gg.on_worker_gone(1) == []  # 1's lock is released, but 0 and 2 still hold theirs
    assert 1 not in gg.pending[0].members and 3 in gg.pending[0].members and gg.pending[0].gid == 2
    gg.on_message(0, {"t": "ack", "gid": 0})
    sends = gg.on_message(2, {"t": "ack", "gid": 0})
    assert sorted(s.to for s in sends) == [0, 2, 3] and sends[0].message["gid"] == 2
    assert gg.summary()["redrawn"] == 1
    for _ in range(50):  # nobody draws 1 again
        for w in (0, 2, 3):
            for s in gg.on_message(w, {"t": "req", "iter": 1}):
                assert 1 not in s.message["members"]
            for gid in list(gg.active):
                for m in list(gg.active[gid].waiting):
                    gg.on_message(m, {"t": "ack", "gid": gid})


@pytest.mark.parametrize("message", [{"t": "req"}, {"t": "req", "iter": -1}, {"t": "req", "iter": True},
                                     {"t": "ack", "gid": 99}, {"t": "nope"}])
def test_random_gg_refuses_bad_messages_without_changing_state(message: dict) -> None:
    gg = RandomGroupGenerator(4, 3, 0)
    with pytest.raises(BadCoordinatorMessage):
        gg.on_message(1, message)
    assert gg.pending == [] and not any(gg.locked) and gg.next_gid == 0
    with pytest.raises(BadCoordinatorMessage):
        gg.on_message(7, {"t": "req", "iter": 0})  # not a worker rank


def test_a_second_request_before_the_first_is_answered_is_refused() -> None:
    gg = RandomGroupGenerator(4, 3, 0)
    gg.on_message(0, {"t": "req", "iter": 0})
    gg.on_message(1, {"t": "req", "iter": 0})  # pending behind 0's group (it overlaps)
    with pytest.raises(BadCoordinatorMessage):
        gg.on_message(1, {"t": "req", "iter": 1})


# ---------------------------------------------------------------------------- the host
def test_host_answers_pings_drops_bad_messages_and_says_bye_ok_after_earlier_gos() -> None:
    records: list[tuple[str, dict]] = []
    host = CoordinatorHost(RandomGroupGenerator(3, 3, 0), now=0.0, peer_timeout_s=5.0,
                           record=lambda event, **f: records.append((event, f)))
    assert host.handle(0, {"t": "ping"}, 0.0) == [Send(0, {"t": "pong"})]
    assert host.handle(1, {"t": "bogus"}, 0.0) == []
    assert host.dropped["bad_message"] == 1
    gos = host.handle(0, {"t": "req", "iter": 0}, 0.1)
    assert sorted(s.to for s in gos) == [0, 1, 2]
    assert [e for e, _ in records].count("group") == 1
    # 2 leaves before acking: its lock goes, and the last thing it hears is bye_ok
    assert host.handle(2, {"t": "bye"}, 0.2) == [Send(2, {"t": "bye_ok"})]
    assert host.handle(2, {"t": "req", "iter": 1}, 0.3) == []  # from a worker that left: dropped
    assert host.dropped["from_gone_worker"] == 1
    assert not host.machine.locked[2]
    summary = host.summary()
    assert summary["workers_left"] == [2] and summary["groups_formed"] == 1


def test_host_declares_a_silent_worker_dead_and_tells_the_others() -> None:
    host = CoordinatorHost(RandomGroupGenerator(3, 3, 0), now=0.0, peer_timeout_s=2.0)
    for w in range(3):
        host.handle(w, {"t": "hello"}, 0.0)
    host.handle(0, {"t": "req", "iter": 0}, 0.0)  # 0, 1, 2 locked in group 0
    host.handle(0, {"t": "beat"}, 1.5)
    host.handle(1, {"t": "beat"}, 1.5)
    assert host.check(1.9) == []
    assert host.next_check(1.9) == pytest.approx(2.0)
    sends = host.check(2.0)  # 2 was last heard at 0.0
    assert sends == [Send(0, {"t": "peer_dead", "rank": 2, "silent_s": 2.0}),
                     Send(1, {"t": "peer_dead", "rank": 2, "silent_s": 2.0})]
    assert host.summary()["workers_dead"] == [2] and not host.machine.locked[2]
    # 2 was only blocked: whatever it says next is answered by "you are out", not ignored
    assert host.handle(2, {"t": "ping"}, 2.5) == [
        Send(2, {"t": "expelled", "why": "it was silent for 2.0s and was declared dead"})]


def test_a_go_names_the_restart_of_each_member_once_one_was_replaced() -> None:
    """--max-restarts: a GO the machine forms names which process of each member it is for, so that a
    worker that has taken a later process back runs no group formed for the earlier one (Prague)."""
    host = CoordinatorHost(RandomGroupGenerator(3, 3, 0), now=0.0, peer_timeout_s=5.0)
    for w in range(3):
        host.handle(w, {"t": "hello"}, 0.0)
    first = host.handle(0, {"t": "req", "iter": 0}, 0.0)
    assert first and all("restarts" not in send.message for send in first)  # nobody replaced: as before
    for w in range(3):
        host.handle(w, {"t": "ack", "gid": first[0].message["gid"]}, 0.1)
    host.handle(2, {"t": "hello", "restart": 1}, 0.2)  # a new process of rank 2
    host.handle(2, {"t": "rejoin"}, 0.3)
    gos = host.handle(0, {"t": "req", "iter": 1}, 0.4)
    assert gos and all(send.message["restarts"] == [{2: 1}.get(m, 0) for m in send.message["members"]]
                       for send in gos)


@pytest.mark.parametrize("payload", [b"", b"\xc1", b"\x93\x01\x02\x03", b"\x81\xa1x\x01", b"\x81\xa1t\x05",
                                     b"\x81\x01\xa1t", b"\x82\xa1t\xa1a\xa1v\x81\xa1k\x01", b"\xc4\x01a",
                                     encode({"t": "x", "v": [[1]]}), b"\x81\xa1t" + b"\xda\xff\xff" + b"a" * 10])
def test_bad_frames_are_refused_by_the_decoder(payload: bytes) -> None:
    with pytest.raises(BadFrame):
        decode(payload)


def test_routing_ids_name_worker_ranks_only() -> None:
    assert rank_of(b"w3", 4) == 3
    for bad in (b"w4", b"w-1", b"w01", b"x1", b"", b"w" + b"9" * 20):
        with pytest.raises(BadFrame):
            rank_of(bad, 4)


def test_a_worker_that_leaves_failing_is_reported_to_the_others_and_a_clean_one_is_not() -> None:
    host = CoordinatorHost(RandomGroupGenerator(4, 3, 0), now=0.0, peer_timeout_s=5.0)
    for w in range(4):
        host.handle(w, {"t": "hello"}, 0.0)
    assert host.handle(3, {"t": "bye"}, 0.1) == [Send(3, {"t": "bye_ok"})]
    sends = host.handle(1, {"t": "bye", "failed": True}, 0.2)
    assert sends == [Send(0, {"t": "peer_failed", "rank": 1}), Send(2, {"t": "peer_failed", "rank": 1}),
                     Send(1, {"t": "bye_ok"})]


def test_a_message_asking_for_sync_is_answered_after_what_the_machine_sent_for_it() -> None:
    host = CoordinatorHost(RandomGroupGenerator(3, 2, 0), now=0.0)
    host.machine._draw = lambda i: {0: (0, 1), 2: (1, 2)}[i]  # type: ignore[method-assign]
    host.handle(0, {"t": "req", "iter": 0}, 0.0)
    assert host.handle(2, {"t": "req", "iter": 0}, 0.0) == []  # waits for 1
    host.handle(0, {"t": "ack", "gid": 0}, 0.1)
    sends = host.handle(1, {"t": "ack", "gid": 0, "sync": 0}, 0.2)  # the GG never sees "sync"
    assert sends == [Send(1, {"t": "go", "gid": 1, "members": [1, 2], "reply": False}),
                     Send(2, {"t": "go", "gid": 1, "members": [1, 2], "reply": True}),
                     Send(1, {"t": "synced", "id": 0})]

"""The liveness state machine, driven by a fake clock (no sockets, no sleeping)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import pytest
import torch

from hopnet.config import ProtocolConfig
from hopnet.errors import ConfigError
from hopnet.graph import Graph
from hopnet.protocols import make_protocol
from hopnet.protocols.base import Protocol
from hopnet.runtime.clock import Clock
from hopnet.runtime.liveness import Liveness, beat_interval_for
from hopnet.runtime.node import Node
from hopnet.transports.base import Receiver, Transport
from hopnet.wire import Message


def test_a_peer_heard_from_stays_alive_and_a_silent_one_is_declared_dead_once() -> None:
    live = Liveness([1, 2], timeout_s=5.0, now=0.0)
    for t in range(1, 5):
        live.heard(1, float(t))
    assert live.silent_peers(4.9) == []
    dead = live.silent_peers(5.0)
    assert dead == [(2, 5.0)]                  # 2 said nothing since the start
    assert live.silent_peers(8.9) == []        # 1 was last heard at 4; 2 is reported only once
    assert live.watched == frozenset({1})
    assert live.silent_peers(9.5) == [(1, 5.5)]
    assert live.watched == frozenset()


def test_silence_is_measured_from_the_last_sign_of_life() -> None:
    live = Liveness([7], timeout_s=2.0, now=10.0)
    live.heard(7, 11.5)
    live.heard(7, 11.0)  # an older stamp never moves the clock back
    assert live.silence(7, 12.0) == pytest.approx(0.5)
    assert live.silent_peers(13.4) == []
    assert live.silent_peers(13.5) == [(7, 2.0)]
    assert live.silence(7, 20.0) is None


def test_a_watcher_that_was_stopped_itself_gives_every_peer_a_fresh_limit() -> None:
    # A worker SIGSTOPped for 6 s and continued: the silence it sees is its own, not its peers'.
    live = Liveness([1, 2], timeout_s=3.0, now=0.0)
    assert live.look(0.5) == 0.0
    live.heard(1, 0.5)
    assert live.look(6.5) == pytest.approx(6.0)
    assert live.silent_peers(6.5) == []        # without look(): both would be declared dead here
    assert live.silent_peers(9.4) == []
    assert live.silent_peers(9.5) == [(1, 3.0), (2, 3.0)]  # still silent a whole limit after it woke


def test_short_pauses_of_the_watcher_change_nothing() -> None:
    live = Liveness([1], timeout_s=3.0, now=0.0)
    for t in (0.6, 1.2, 2.6):                  # each gap under half the limit
        assert live.look(t) == 0.0
    assert live.silent_peers(3.0) == [(1, 3.0)]


def test_beats_go_only_to_peers_nothing_was_sent_to_lately() -> None:
    live = Liveness([1, 2, 3], timeout_s=5.0, now=0.0)
    assert live.beat_interval_s == 1.0
    assert live.beat_due(0.5) == []
    live.sent(1, 0.8)                          # an update went to 1
    assert sorted(live.beat_due(1.0)) == [2, 3]
    assert live.beat_due(1.5) == []            # 2 and 3 just got their beat
    assert live.beat_due(1.8) == [1]
    assert sorted(live.beat_due(2.0)) == [2, 3]


def test_forgotten_peers_get_no_beats_and_are_never_declared_dead() -> None:
    live = Liveness([1, 2], timeout_s=1.0, now=0.0)
    live.forget(2)                             # it said bye
    live.heard(2, 0.5)
    live.sent(2, 0.5)
    assert live.beat_due(10.0) == [1]
    assert live.silent_peers(10.0) == [(1, 10.0)]


def test_next_check_is_the_earliest_beat_or_deadline() -> None:
    live = Liveness([1, 2], timeout_s=5.0, now=0.0, beat_interval_s=2.0)
    assert live.next_check(0.0) == 2.0
    live.sent(1, 1.5)
    live.sent(2, 1.5)
    assert live.next_check(1.5) == 3.5
    live.heard(1, 3.0)
    live.sent(1, 4.0)
    live.sent(2, 4.0)
    assert live.next_check(4.0) == 5.0         # peer 2's silence reaches the limit at 5
    assert live.next_check(6.0) == 6.0         # overdue checks are due now, not in the past
    for peer in (1, 2):
        live.forget(peer)
    assert live.next_check(6.0) == math.inf


def test_a_live_peer_beating_on_schedule_is_never_declared_dead() -> None:
    """Two state machines, one per side, exchanging only beats every check: nobody dies."""
    a = Liveness([1], timeout_s=0.5, now=0.0)
    b = Liveness([0], timeout_s=0.5, now=0.0)
    t = 0.0
    while t < 30.0:
        t = min(a.next_check(t), b.next_check(t))
        for peer in a.beat_due(t):
            b.heard(0, t)
        for peer in b.beat_due(t):
            a.heard(1, t)
        assert a.silent_peers(t) == [] and b.silent_peers(t) == []
    # Once b stops beating, a declares it dead within the limit.
    deadline = t + 0.5
    while not (dead := a.silent_peers(t)):
        t = a.next_check(t)
        a.beat_due(t)
    assert dead[0][0] == 1 and t <= deadline + 1e-9


@pytest.mark.parametrize("timeout", [5.0, 0.5, 20.0])
def test_the_beat_interval_leaves_several_beats_per_timeout(timeout: float) -> None:
    interval = beat_interval_for(timeout)
    assert 0 < interval <= 1.0 and timeout / interval >= 5


@pytest.mark.parametrize("timeout", [0.0, -1.0, math.inf, math.nan])
def test_bad_timeouts_are_refused(timeout: float) -> None:
    with pytest.raises(ConfigError, match="peer timeout"):
        Liveness([1], timeout_s=timeout, now=0.0)
    with pytest.raises(ConfigError, match="beat interval"):
        Liveness([1], timeout_s=1.0, now=0.0, beat_interval_s=1.0)


class _SteppedClock(Clock):
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        super().__init__(default_timeout_s=5.0)
        self.t = 0.0

    def now(self) -> float:
        return self.t


class _NetworkStub(Transport):
    """A transport whose peers can die unannounced (so the node watches them); sends go nowhere."""

    heartbeats = True

    def __init__(self) -> None:
        super().__init__(0, frozenset({1, 2}))

    async def start(self, receiver: Receiver) -> str:
        return "stub://0"

    async def connect(self, addresses: Mapping[int, str]) -> None:
        return None

    async def send(self, msg: Message) -> None:
        return None

    async def close(self) -> None:
        return None


POSTS: dict[str, Callable[[Node[Protocol], Message], object]] = {
    "post": lambda node, msg: node.post(msg),
    "post_latest": lambda node, msg: node.post_latest(msg),
    "post_express": lambda node, msg: node.post_express(msg),
    "post_tracked": lambda node, msg: node.post_tracked(msg),
}


@pytest.mark.parametrize("how", sorted(POSTS))
async def test_every_way_of_posting_is_a_sign_of_life_to_the_receiver(how: str) -> None:
    clock = _SteppedClock()
    node = Node(0, Graph.ring(3), _NetworkStub(), make_protocol(ProtocolConfig(), torch.zeros(4)), clock=clock,
                peer_timeout_s=30.0)
    await node.open()
    try:
        liveness = node.liveness
        assert liveness is not None
        interval = liveness.beat_interval_s
        clock.t = 0.9 * interval
        POSTS[how](node, Message("ack", 0, 1, 0))
        await node.flush()
        clock.t = 1.5 * interval
        assert liveness.beat_due(clock.t) == [2]  # rank 1 heard from this node lately; rank 2 did not
    finally:
        await node.close(leave=False)

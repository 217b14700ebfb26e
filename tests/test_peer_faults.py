"""Peer failures staged in one process: workers on ZeroMQ, faults injected with FaultyTransport.

A silenced rank says and hears nothing, as a SIGSTOPped or SIGKILLed process would, but
its failure costs a fraction of a second (a short --peer-timeout) instead of process
starts and a kill. The real-process versions that users meet are kept in test_dead_peers.py,
test_eager_processes.py, test_pipesgd_processes.py and test_blame.py.
"""

from __future__ import annotations

from hopnet import Graph, PeerFailure, ProtocolConfig, WaitTimeout

from support.cluster import FaultyCluster, within

PEER_TIMEOUT_S = 0.5
TIMEOUT_S = 30.0


def _config(**options: object) -> ProtocolConfig:
    return ProtocolConfig(timeout_s=TIMEOUT_S, peer_timeout_s=PEER_TIMEOUT_S, **options)


async def test_a_silent_worker_is_named_dead_by_its_neighbours_and_the_rest_stop() -> None:
    """Ring of 4, rank 2 falls silent (SIGSTOP or SIGKILL, seen from its peers): its neighbours 1
    and 3 fail on their own, naming it dead, long before the wait timeout; rank 0, which needs
    1 and 3, fails once they leave."""
    config = _config()
    async with FaultyCluster(Graph.ring(4), config) as c:
        silent, *outcomes = await within(c.fall_silent(2, 10), *(c.train(r, 100_000) for r in (0, 1, 3)))
        ended = dict(zip((0, 1, 3), outcomes))
        for rank in (1, 3):
            error = ended[rank].error
            assert isinstance(error, PeerFailure), error
            assert (error.peer, error.peer_state) == (2, "dead")
            assert str(error).startswith(f"rank {rank} cannot finish iteration ") and "peer 2 went silent" in str(error)
            assert ended[rank].at - silent < TIMEOUT_S
            silent_s = c.workers[rank].node.dead[2]
            assert PEER_TIMEOUT_S <= silent_s < TIMEOUT_S
        error = ended[0].error
        assert isinstance(error, PeerFailure) and error.peer in (1, 3) and error.peer_state in ("departed", "dead")
        assert c.faults[2].injected["drop", "beat"] > 0  # its heartbeats were what it stopped sending


async def test_survivors_with_backup_workers_finish_after_a_worker_falls_silent() -> None:
    """ring_based:6 with a backup worker each: rank 3 falls silent; its neighbours declare it
    dead and, like ranks 1 and 5 (which never talk to it), train to the end."""
    iterations, victim = 60, 3
    config = _config(backup_workers=1)
    async with FaultyCluster(Graph.ring_based(6), config) as c:
        survivors = [r for r in range(6) if r != victim]
        _, *outcomes = await within(c.fall_silent(victim, 15), *(c.train(r, iterations) for r in survivors))
        for rank, outcome in zip(survivors, outcomes):
            assert outcome.error is None and outcome.iteration == iterations - 1, (rank, outcome)
            stats = c.workers[rank].node.transport.stats
            assert "send_timeout" not in stats.dropped, (rank, stats.dropped)
        for rank in c.graph.peers(victim):
            assert c.workers[rank].node.dead.keys() == {victim} and c.workers[rank].node.dead[victim] >= PEER_TIMEOUT_S
        for rank in (1, 5):
            assert c.workers[rank].node.dead == {}


async def test_a_peer_that_beats_but_sends_no_updates_is_stalled_not_dead() -> None:
    """Rank 1's updates are lost on the way but its heartbeats arrive: rank 0 waits into the
    wait timeout and names rank 1 stalled, not dead."""
    config = ProtocolConfig(timeout_s=1.5, peer_timeout_s=0.3)
    async with FaultyCluster(Graph.ring(2), config) as c:
        c.faults[1].drop(kinds={"update"}, direction="out")
        first, second = await within(c.train(0, 5), c.train(1, 5))
    error = first.error
    assert isinstance(error, WaitTimeout), first
    assert (error.peer, error.peer_state) == (1, "stalled")
    assert c.workers[0].node.dead == {}
    assert c.faults[1].injected["drop", "update"] >= 1


async def test_a_cut_link_fails_only_the_ranks_at_its_ends() -> None:
    """The link 0-1 of a ring of 4 fails both ways while both processes live: ranks 0 and 1
    name each other dead; neither 2 nor 3 is named dead by anyone."""
    config = _config()
    async with FaultyCluster(Graph.ring(4), config) as c:
        c.faults[0].cut(1)
        ended = await within(*(c.train(r, 100_000) for r in range(4)))
    for rank, peer in ((0, 1), (1, 0)):
        error = ended[rank].error
        assert isinstance(error, PeerFailure) and (error.peer, error.peer_state) == (peer, "dead"), ended[rank]
    for rank in (2, 3):
        error = ended[rank].error
        assert isinstance(error, PeerFailure) and error.peer_state == "departed", ended[rank]
    assert all(set(c.workers[r].node.dead) <= {0, 1} for r in range(4))


async def test_a_lost_goodbye_is_caught_by_the_heartbeats() -> None:
    """Rank 1 finishes early and closes, but its ``bye`` is lost: rank 0 learns of its going
    from the silence instead (dead, not departed), within the peer timeout."""
    config = _config()
    async with FaultyCluster(Graph.ring(2), config) as c:
        c.faults[1].drop(kinds={"bye"}, direction="out")
        first, second = await within(c.train(0, 100_000), c.train(1, 10))
    assert second.error is None and second.iteration == 9
    error = first.error
    assert isinstance(error, PeerFailure) and (error.peer, error.peer_state) == (1, "dead"), first
    assert first.at - second.at < TIMEOUT_S
    assert c.faults[1].injected["drop", "bye"] >= 1


async def test_a_silent_passive_fails_the_actives_waiting_on_it_naming_it_dead() -> None:
    """AD-PSGD on ring:4: passive 1 falls silent; actives 0 and 2 soon pick it, wait for its
    reply, and fail once their heartbeats declare it dead; passive 3 waits on no one."""
    passive = 1
    config = _config(protocol="ad-psgd")
    async with FaultyCluster(Graph.ring(4), config) as c:
        silent, *ended = await within(c.fall_silent(passive, 10), c.train(0, 100_000),
                                              c.train(2, 100_000))
        for outcome in ended:
            error = outcome.error
            assert isinstance(error, PeerFailure), outcome
            assert (error.peer, error.peer_state) == (passive, "dead")
            assert f"passive partner {passive} went silent (dead) during the averaging" in str(error)
            assert outcome.at - silent < TIMEOUT_S

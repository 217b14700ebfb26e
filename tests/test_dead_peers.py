"""Dead and silent peers, detected by each worker itself through heartbeats.

The process tests start the workers without `hopnet launch` (:class:`support.cluster.Cluster`),
so no launcher notices a death and stops the others; whatever the survivors do, they do on
their own.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from hopnet import Graph, PeerFailure, ProtocolConfig, WaitTimeout
from hopnet.analysis import load_run
from hopnet.cli.main import main as cli
from hopnet.errors import ConfigError
from hopnet.protocols import make_protocol
from hopnet.runtime.clock import Clock
from hopnet.runtime.node import Node
from hopnet.sim.vloop import Deadlock, VirtualTimeLoop
from hopnet.transports.inproc import InprocNetwork

from support.cluster import START_TIMEOUT_S, Cluster, failure_after_a_peer_vanishes, start_workers, train


def _peer_dead_records(run_dir: Path, rank: int) -> list[dict]:
    return [rec for rec in load_run(run_dir)[rank] if rec["event"] == "peer_dead"]


# ----------------------------------------------------------------------------- real processes
@pytest.mark.slow
def test_survivors_with_backup_workers_finish_after_a_worker_is_killed(tmp_path: Path) -> None:
    """SIGKILL one worker of ring_based:6 with a backup worker each: the rest train to the end.

    Updates of 1.6 MB go zero-copy; the survivors' sends to the dead worker must be released
    when it is declared dead, not wait out the transport's send timeout."""
    iterations, victim = 150, 3
    config = ProtocolConfig(backup_workers=1, timeout_s=60.0, peer_timeout_s=3.0)
    with Cluster(Graph.ring_based(6), config, tmp_path / "run",
                 ["--iterations", str(iterations), "--compute-ms", "10", "--dim", "200000"]) as c:
        c.wait_for_iteration(victim, 30)
        c.signal(victim, signal.SIGKILL)
        survivors = [r for r in range(6) if r != victim]
        assert c.wait(survivors, timeout_s=180.0) == {r: 0 for r in survivors}, c.report()
        events = load_run(c.run_dir)
        for rank in survivors:
            stop = next(rec for rec in events[rank] if rec["event"] == "stop")
            assert stop["iter"] == iterations - 1, (rank, stop)
            assert "send_timeout" not in stop["dropped"], (rank, stop["dropped"])
            done = [rec["iter"] for rec in events[rank] if rec["event"] == "iteration"]
            assert max(done) == iterations - 1
        for rank in c.graph.peers(victim):  # 0, 2 and 4 noticed; 1 and 5 never talk to it
            (dead,) = _peer_dead_records(c.run_dir, rank)
            assert dead["peer"] == victim and dead["silent_s"] >= config.peer_timeout_s, dead
        for rank in (1, 5):
            assert _peer_dead_records(c.run_dir, rank) == []


@pytest.mark.slow
def test_ranks_that_run_different_iteration_counts_are_told_so(tmp_path: Path) -> None:
    config = ProtocolConfig(timeout_s=60.0)
    with Cluster(Graph.ring(3), config, tmp_path / "run",
                 ["--iterations", "40", "--iterations-rank", "0:20", "--compute-ms", "2"]) as c:
        assert c.wait([0, 1, 2], timeout_s=START_TIMEOUT_S) == {0: 0, 1: 1, 2: 1}, c.report()
        for rank in (1, 2):
            failure = c.failure(rank)
            assert failure["message"] == (f"peer 0 finished at iteration 19 but rank {rank} runs to iteration 39: "
                                          "every rank must run the same number of iterations"), failure
            assert (failure["error"], failure["peer"], failure["peer_state"]) == ("PeerFailure", 0, "departed")
        left = [rec for rec in load_run(c.run_dir)[1] if rec["event"] == "peer_left" and rec["peer"] == 0]
        assert [(rec["last_iter"], rec["final_iter"]) for rec in left] == [(19, 19)]


# ----------------------------------------------------------------------------- one process, ZeroMQ
async def test_a_peer_that_is_alive_but_owes_an_update_is_stalled_not_dead() -> None:
    """Rank 1 never steps, for longer than the peer timeout, but its node still beats: rank 0's
    wait runs into --timeout and names rank 1 as stalled, not dead."""
    config = ProtocolConfig(timeout_s=1.5, peer_timeout_s=0.3)
    workers = await start_workers(Graph.ring(2), config)
    workers[1].plan(5)  # it starts its loop (its update of iteration 0 goes out), then never steps
    try:
        with pytest.raises(WaitTimeout) as info:
            await train(workers[0], 5)
    finally:
        await asyncio.gather(*(w.close() for w in workers))
    error = info.value
    assert (error.peer, error.peer_state, error.iteration) == (1, "stalled", 1)
    assert "from peer 1 (stalled) in iteration 1" in str(error)
    assert workers[0].node.dead == {}


async def test_a_peer_that_vanishes_without_a_word_is_declared_dead() -> None:
    """Rank 1 shuts its sockets without a bye (as a crash would): rank 0 fails naming it dead,
    long before its wait timeout."""
    config = ProtocolConfig(timeout_s=30.0, peer_timeout_s=0.3)
    workers = await start_workers(Graph.ring(2), config)
    error, took = await failure_after_a_peer_vanishes(workers)
    assert took < config.timeout_s
    assert (error.peer, error.peer_state) == (1, "dead")
    assert "peer 1 went silent" in str(error)
    assert config.peer_timeout_s <= workers[0].node.dead[1] < config.timeout_s


def test_the_simulator_runs_no_heartbeats_so_deadlocks_are_still_found() -> None:
    """In-process peers cannot die unannounced: nodes on that transport arm no beat timers,
    which would otherwise keep virtual time running and turn a Deadlock into a hang."""
    graph = Graph.ring(2)
    network = InprocNetwork()
    nodes = [Node(r, graph, network.transport(r, frozenset(graph.peers(r))),
                  make_protocol(ProtocolConfig(), None), clock=Clock(60.0), peer_timeout_s=1.0)
             for r in range(2)]

    async def wait_forever() -> None:
        for node in nodes:
            await node.open()
        assert all(node.liveness is None for node in nodes)
        await asyncio.Event().wait()  # nothing will ever set it, and nothing else is scheduled

    loop = VirtualTimeLoop()
    try:
        with pytest.raises(Deadlock):
            loop.run_until_complete(wait_forever())
    finally:
        loop.close()


def test_peer_timeout_flag_is_validated_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["simulate", "--graph", "ring:4", "--iterations", "2", "--peer-timeout", "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "--peer-timeout must be a positive number of seconds" in err[0], err
    with pytest.raises(ConfigError, match="--peer-timeout"):
        ProtocolConfig(peer_timeout_s=float("nan"))
    assert ProtocolConfig.from_json(ProtocolConfig(peer_timeout_s=2.5).to_json()).peer_timeout_s == 2.5

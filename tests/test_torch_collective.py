"""TorchCollective between real processes over gloo: groups formed by their members alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hopnet.collectives.torchdist import TorchCollective
from hopnet.errors import ConfigError
from hopnet.rendezvous.store import connect_store, host_store

from support.paths import WORKERS
from support.launch import run_launch

WORKER = str(WORKERS / "torch_collective_worker.py")


def _run(tmp_path: Path, schedule: list[list[int]], *extra: str) -> Path:
    run_dir = tmp_path / "run"
    result = run_launch(["--nproc", "4", "--run-dir", str(run_dir), WORKER, "--schedule", json.dumps(schedule),
                         *extra], timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def _check_round(run_dir: Path, rnd: int, group: list[int], world: int, op: str = "mean") -> None:
    inputs = [torch.load(run_dir / f"r{rnd}_rank{r}_in.pt") for r in range(world)]
    outputs = [torch.load(run_dir / f"r{rnd}_rank{r}_out.pt") for r in range(world)]
    total = torch.stack([inputs[r].double() for r in group]).sum(0)
    expected = total / len(group) if op == "mean" else total
    first = outputs[group[0]]
    assert torch.allclose(first.double(), expected, rtol=1e-5, atol=1e-5), (rnd, group)
    for r in group:  # members agree bit for bit
        assert torch.equal(outputs[r].view(torch.int32), first.view(torch.int32)), (rnd, group, r)
    for r in set(range(world)) - set(group):  # non-members untouched
        assert torch.equal(outputs[r], inputs[r]), (rnd, group, r)


@pytest.mark.slow
def test_groups_of_two_three_and_all_reduce_to_the_mean(tmp_path: Path) -> None:
    # Round 0 and 1: disjoint pairs at the same time; then a triple (rank 3 out), then all in a
    # rank order of their own, then a pair again (its communicator comes from the cache).
    schedule = [[0, 1], [2, 3], [0, 1, 2], [3, 1, 0, 2], [2, 3]]
    # Rounds [0,1] and [2,3] are separate rounds in the schedule but every rank is in only one
    # of them, so ranks 0,1 and ranks 2,3 run their pair's all-reduce concurrently.
    run_dir = _run(tmp_path, schedule)
    for rnd, group in enumerate(schedule):
        _check_round(run_dir, rnd, group, 4)
    for rank in range(4):
        info = json.loads((run_dir / f"cache_rank{rank}.json").read_text())
        distinct = {tuple(g) for g in schedule if rank in g}
        assert info["built"] == len(distinct) and info["uncached_calls"] == 0  # formed once, then reused


@pytest.mark.slow
def test_past_the_cache_bound_groups_are_formed_per_call_by_agreement(tmp_path: Path) -> None:
    # Rank 0 is in every group and caches 2: (0,1) and (0,2) are cached; (0,3) and the
    # group of all are not, for every member, although ranks 1..3 have room left.
    schedule = [[0, 1], [0, 2], [0, 3], [0, 1], [0, 2], [0, 1, 2, 3], [0, 3], [0, 1], [0, 1, 2, 3]]
    run_dir = _run(tmp_path, schedule, "--max-cached", "2", "--op", "sum")
    for rnd, group in enumerate(schedule):
        _check_round(run_dir, rnd, group, 4, op="sum")
    infos = [json.loads((run_dir / f"cache_rank{r}.json").read_text()) for r in range(4)]
    assert max(infos[0]["sizes"]) == 2
    assert infos[0]["uncached_calls"] == 4 and infos[0]["built"] == 2 + 4
    for rank in range(4):  # all members agree on what is not cached
        assert sorted(map(tuple, infos[rank]["uncached_groups"])) == sorted(
            g for g in [(0, 3), (0, 1, 2, 3)] if rank in g)
    assert infos[3]["uncached_calls"] == 4 and max(infos[3]["sizes"], default=0) == 0


async def test_bad_calls_are_refused_in_one_line() -> None:
    hosted = host_store("127.0.0.1")
    try:
        coll = TorchCollective(0, 4, connect_store(hosted.endpoint, 10))
        x = torch.ones(4)
        with pytest.raises(ConfigError, match="not a member"):
            await coll.allreduce([1, 2], x, tag="t")
        with pytest.raises(ConfigError, match="reduce op"):
            await coll.allreduce([0, 1], x, "max", tag="t")  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="names a rank twice"):
            await coll.allreduce([0, 0], x, tag="t")
        assert torch.equal(await coll.allreduce([0], x, tag="solo"), torch.ones(4))  # a group of one
        with pytest.raises(ConfigError, match="max_cached"):
            TorchCollective(0, 4, coll.store, max_cached=0)
        await coll.close()
    finally:
        hosted.close()


async def test_a_member_that_never_comes_is_named_after_the_timeout() -> None:
    from hopnet.errors import WaitTimeout

    hosted = host_store("127.0.0.1")
    try:
        coll = TorchCollective(0, 3, connect_store(hosted.endpoint, 10), timeout_s=2.0)
        x = torch.ones(8)
        with pytest.raises(WaitTimeout, match=r"group \[0, 2\].*missing ranks \[2\]") as info:
            await coll.allreduce([0, 2], x, tag="lonely")
        assert info.value.peer == 2
        assert torch.equal(x, torch.ones(8))  # nothing was reduced
        await coll.close()
    finally:
        hosted.close()


def test_blocking_calls_reduce_in_the_callers_thread_once_the_group_is_cached() -> None:
    # Two ranks as two threads of this process, each with a collective of its own.
    import asyncio
    import threading

    from hopnet.errors import HopnetError

    hosted = host_store("127.0.0.1")
    colls = [TorchCollective(r, 2, connect_store(hosted.endpoint, 10), timeout_s=1.5) for r in range(2)]
    inputs = [torch.randn(1000, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    fast: list[tuple[int, bool]] = []

    def rank(r: int) -> None:
        coll = colls[r]
        for call in range(3):
            x = inputs[r].clone()
            done = coll.allreduce_blocking([0, 1], x, tag=f"b/{call}")
            fast.append((call, done is x))
            if done is None:  # the group's first call meets through the store, on a loop
                asyncio.run(coll.allreduce([0, 1], x, tag=f"b/{call}"))
            outputs[(r, call)] = x

    try:
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(fast) == [(0, False), (0, False), (1, True), (1, True), (2, True), (2, True)]
        expected = (inputs[0] + inputs[1]) / 2
        for call in range(3):
            assert torch.allclose(outputs[(0, call)], expected)
            assert torch.equal(outputs[(0, call)], outputs[(1, call)])
        # Rank 1 stops calling: rank 0's blocking call fails after the timeout, naming the group.
        with pytest.raises(HopnetError, match=r"all-reduce 'alone' of group \[0, 1\]"):
            colls[0].allreduce_blocking([0, 1], torch.ones(4), tag="alone")
        # A group not cached yet, or a group of one, is left to the caller / done at once.
        assert colls[0].allreduce_blocking([0], torch.ones(2), tag="solo") is not None
    finally:
        for coll in colls:
            asyncio.run(coll.close())
        hosted.close()


class _Peers:
    """What a collective reads of its node: the peers declared dead (and what the transport said)."""

    def __init__(self) -> None:
        self.dead: dict[int, float] = {}
        self.death_causes: dict[int, str] = {}


async def test_a_call_waiting_for_a_member_declared_dead_fails_naming_the_group_and_it() -> None:
    """Rank 2 never comes to the group's first call (the members meet through the store): once the
    node declares it dead (its heartbeats, --peer-timeout), the call fails at once naming the group and
    rank 2, not after the collective's timeout; a later call on the group fails the same way. The call's
    thread, left waiting in the store for rank 2, ends at that timeout: the test waits for it, so that
    it does not wait on into the tests after this one (and c10d's complaint about the store it lost
    shows here, not there)."""
    import asyncio
    import threading
    import time

    from hopnet.errors import PeerFailure

    before = set(threading.enumerate())
    hosted = host_store("127.0.0.1")
    peers = _Peers()
    try:
        coll = TorchCollective(0, 3, connect_store(hosted.endpoint, 10), timeout_s=5.0, node=peers)  # type: ignore[arg-type]
        asyncio.get_running_loop().call_later(0.3, peers.dead.__setitem__, 2, 3.1)
        started = time.monotonic()
        with pytest.raises(PeerFailure, match=r"all-reduce 'lonely' of group \[0, 2\]: rank 2 went silent for 3.1s") as info:
            await coll.allreduce([0, 2], torch.ones(8), tag="lonely")
        assert time.monotonic() - started < 5.0  # before the collective's own timeout
        assert (info.value.peer, info.value.peer_state) == (2, "dead")
        with pytest.raises(PeerFailure, match=r"all-reduce 'again' of group \[0, 2\]: rank 2 went silent"):
            await coll.allreduce([0, 2], torch.ones(8), tag="again")
        await coll.close()
    finally:
        for thread in set(threading.enumerate()) - before:
            await asyncio.get_running_loop().run_in_executor(None, thread.join, 15.0)
        hosted.close()


def test_a_blocking_reduce_whose_member_is_declared_dead_ends_inside_gloo() -> None:
    """The group is cached; rank 1 stops calling. Rank 0's blocking call waits inside gloo, in slices,
    and fails naming rank 1 as soon as its node declares rank 1 dead (the timeout is 60 s). Then the
    process is still free to close the collective (the group's op is left behind, its group kept)."""
    import asyncio
    import threading
    import time

    from hopnet.errors import PeerFailure

    hosted = host_store("127.0.0.1")
    peers = [_Peers(), _Peers()]
    colls = [TorchCollective(r, 2, connect_store(hosted.endpoint, 10), timeout_s=60.0, node=peers[r])  # type: ignore[arg-type]
             for r in range(2)]
    try:
        threads = [threading.Thread(target=lambda r=r: asyncio.run(colls[r].allreduce([0, 1], torch.ones(4), tag="c")))
                   for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        threading.Timer(0.3, peers[0].dead.__setitem__, (1, 2.5)).start()
        started = time.monotonic()
        with pytest.raises(PeerFailure, match=r"all-reduce 'alone' of group \[0, 1\]: rank 1 went silent for 2.5s"):
            colls[0].allreduce_blocking([0, 1], torch.ones(4), tag="alone")
        assert time.monotonic() - started < 10.0
    finally:
        for coll in colls:
            asyncio.run(coll.close())
        hosted.close()

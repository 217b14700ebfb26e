"""Hop's update queue and token queue (Sec. 4.1, 4.2, 6.1) through their public methods."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hopnet.errors import ProtocolError
from hopnet.protocols.hop.queues import BufferPool, TokenCredits, Update, UpdateQueue


def test_dequeue_by_iteration_and_sender_tags() -> None:
    q = UpdateQueue(num_slots=3)
    for it, src in [(0, 1), (0, 2), (1, 1), (2, 2)]:
        q.enqueue(Update(it, src, None))
    assert q.size() == 4
    assert q.size(iter=0) == 2 and q.size(w_id=1) == 2 and q.size(iter=1, w_id=2) == 0
    first = q.take(1, iter=0)
    assert [(u.iter, u.src) for u in first] == [(0, 1)]  # arrival order within an iteration
    assert [(u.iter, u.src) for u in q.take(w_id=2)] == [(0, 2), (2, 2)]  # oldest first
    assert q.size() == 1


async def test_dequeue_blocks_until_enough_updates_of_that_iteration() -> None:
    q = UpdateQueue(num_slots=2)
    q.enqueue(Update(1, 5, None))  # a newer iteration must not satisfy a wait for iteration 0
    waiter = asyncio.create_task(q.dequeue(2, iter=0))
    await asyncio.sleep(0)
    q.enqueue(Update(0, 1, None))
    await asyncio.sleep(0)
    assert not waiter.done()
    q.enqueue(Update(0, 2, None))
    got = await asyncio.wait_for(waiter, 1)
    assert sorted(u.src for u in got) == [1, 2]
    assert q.size(iter=1) == 1


def test_rotating_slots_refuse_two_live_iterations_in_one_slot() -> None:
    q = UpdateQueue(num_slots=3)
    q.enqueue(Update(4, 1, None))
    with pytest.raises(ProtocolError, match="capacity"):
        q.enqueue(Update(7, 2, None))  # 7 mod 3 == 4 mod 3 while iteration 4 is still held
    q.discard_older_than(5)
    assert q.enqueue(Update(7, 2, None))


def test_duplicates_are_refused_and_high_water_is_tracked() -> None:
    q = UpdateQueue(num_slots=2)
    assert q.enqueue(Update(0, 1, None))
    assert not q.enqueue(Update(0, 1, None))
    q.enqueue(Update(1, 1, None))
    assert q.high_water == 2
    assert q.newest_iter(1) == 1 and q.newest_iter(9) == -1


def test_buffers_are_recycled_not_reallocated() -> None:
    pool = BufferPool(lambda: [torch.empty(4)], senders=[1, 2], per_sender=1)
    q = UpdateQueue(num_slots=2, pool=pool)
    for it in range(50):
        for src in (1, 2):
            q.enqueue(Update(it, src, pool.acquire(src)))
        q.release(q.take(iter=it))
    assert pool.allocated == pool.preallocated == 2


async def test_token_credits_keep_theorem_2_invariant() -> None:
    """tokens(j -> i) == Iter(j) - Iter(i) + max_ig, and i cannot run more than max_ig ahead."""
    max_ig = 2
    tokens = TokenCredits(out_peers=[1], max_ig=max_ig)
    iter_i = iter_j = 0
    tokens.grant(1, 1, 0)  # j enters iteration 0
    assert tokens.tokens(1) == iter_j - iter_i + max_ig
    for _ in range(max_ig):
        await asyncio.wait_for(tokens.acquire(), 1)
        iter_i += 1
        assert tokens.tokens(1) == iter_j - iter_i + max_ig
    blocked = asyncio.create_task(tokens.acquire())
    await asyncio.sleep(0)
    assert not blocked.done()  # i is max_ig ahead of j
    tokens.grant(1, 1, 1)
    iter_j += 1
    await asyncio.wait_for(blocked, 1)
    iter_i += 1
    assert tokens.tokens(1) == iter_j - iter_i + max_ig
    assert tokens.known_iter[1] == 1


async def test_a_departed_peer_stops_holding_tokens_back() -> None:
    tokens = TokenCredits(out_peers=[1, 2], max_ig=1)
    tokens.grant(1, 1, 0)
    tokens.grant(2, 1, 0)
    await tokens.acquire()
    blocked = asyncio.create_task(tokens.acquire())
    tokens.grant(1, 1, 1)
    await asyncio.sleep(0)
    assert not blocked.done() and tokens.missing() == [2]
    tokens.depart(2)
    await asyncio.wait_for(blocked, 1)

"""A replica that comes back takes every lane's state at one iteration from one replica
(:mod:`hopnet.replica.handover`), and a donor answers a request for a later iteration only once it
gets there (:meth:`hopnet.runtime.replacement.Replacements.take_handover_requests`)."""

from __future__ import annotations

import asyncio
import functools
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hopnet.errors import HopnetError
from hopnet.replica.handover import ATTEMPTS, one_handover, state_key
from hopnet.runtime.rejoin import BLOCKED, HANDOVER_REQUEST, Handover
from hopnet.runtime.replacement import Replacements
from hopnet.wire import Message

from support.lanes import InprocLanes, Meeting


def _handover(donor: int, iteration: int, weight: float = 0.0, blocked: bool = False) -> Handover:
    return Handover(donor, iteration, {BLOCKED: blocked}, {"model": {"w": torch.full((3,), weight)}}, 0.0)


def _agree(first: list[Handover], answer, key=lambda h: 0) -> tuple[list[Handover], list[list[tuple[int, int]]]]:  # type: ignore[no-untyped-def]
    """Every lane's agreed handover, and what each lane asked again (donor, at)."""
    meeting = Meeting(len(first))
    asked: list[list[tuple[int, int]]] = [[] for _ in first]

    async def lane(member: int) -> Handover:
        async def ask_again(donor: int, at: int) -> Handover:
            asked[member].append((donor, at))
            return answer(member, donor, at, len(asked[member]))

        return await one_handover(InprocLanes(meeting, member), first[member], ask_again, key, replica=1)  # type: ignore[arg-type]

    async def main() -> list[Handover]:
        return list(await asyncio.gather(*(lane(m) for m in range(len(first)))))

    return asyncio.run(main()), asked


def test_lanes_handed_the_same_iteration_by_one_replica_load_it_without_asking_again() -> None:
    agreed, asked = _agree([_handover(0, 53), _handover(0, 53)], lambda *a: pytest.fail("asked again"))
    assert [h.iteration for h in agreed] == [53, 53] and asked == [[], []]


def test_lanes_handed_iterations_apart_ask_again_for_one_past_the_newest() -> None:
    """The race of a donor that goes on training: lane 0 was handed 241, lane 1 240."""
    agreed, asked = _agree([_handover(0, 241), _handover(0, 240)], lambda member, donor, at, n: _handover(donor, at))
    assert asked == [[(0, 243)], [(0, 243)]]
    assert [(h.donor, h.iteration) for h in agreed] == [(0, 243), (0, 243)]


def test_lanes_handed_states_by_two_replicas_take_the_first_ones() -> None:
    agreed, asked = _agree([_handover(2, 80), _handover(0, 80)], lambda member, donor, at, n: _handover(donor, at))
    assert asked == [[(0, 82)], [(0, 82)]]
    assert {(h.donor, h.iteration) for h in agreed} == {(0, 82)}


def test_a_donor_past_the_target_is_asked_again_with_twice_the_margin() -> None:
    """Lane 1's donor is past 243 when asked: it answers 245; the lanes meet at 245 + 4."""
    def answer(member: int, donor: int, at: int, n: int) -> Handover:
        return _handover(donor, at + 2 if (member, n) == (1, 1) else at)

    agreed, asked = _agree([_handover(0, 241), _handover(0, 240)], answer)
    assert asked == [[(0, 243), (0, 249)], [(0, 243), (0, 249)]]
    assert [h.iteration for h in agreed] == [249, 249]


def test_whole_models_that_differ_at_one_iteration_are_asked_again() -> None:
    """Under ddp: lane 1's donor was blocked after its apply, lane 0's at the step boundary."""
    key = functools.partial(state_key, parameters=frozenset({"w"}))
    agreed, asked = _agree([_handover(0, 50, 1.0), _handover(0, 50, 2.0, blocked=True)],
                           lambda member, donor, at, n: _handover(donor, at, 3.0), key)
    assert asked == [[(0, 52)], [(0, 52)]] and [h.iteration for h in agreed] == [52, 52]
    same, asked = _agree([_handover(0, 50, 1.0), _handover(0, 50, 1.0, blocked=True)],
                         lambda *a: pytest.fail("asked again"), key)
    assert asked == [[], []]  # blocked before its apply: the boundary's model


def test_shards_handed_at_a_boundary_and_by_a_blocked_donor_are_asked_again() -> None:
    key = functools.partial(state_key, parameters=None)
    agreed, asked = _agree([_handover(0, 50, 1.0), _handover(0, 50, 2.0, blocked=True)],
                           lambda member, donor, at, n: _handover(donor, at, 3.0 + member), key)
    assert asked == [[(0, 52)], [(0, 52)]] and [h.iteration for h in agreed] == [52, 52]


def test_lanes_that_never_meet_fail_in_one_line() -> None:
    with pytest.raises(HopnetError, match=f"different states {ATTEMPTS} times"):
        _agree([_handover(0, 1), _handover(0, 2)], lambda member, donor, at, n: _handover(donor, at + member))


def _donor() -> tuple[Replacements, Any]:
    node = SimpleNamespace(handover_requests=[], dead={}, departed={}, max_restarts=1, epoch=0,
                           restarts_seen={5: 1}, handover_now=None, quiesced=False,
                           protocol=SimpleNamespace(iteration=100), record=lambda *a, **k: None)
    return Replacements(node), node  # type: ignore[arg-type]


def test_a_donor_answers_a_request_for_a_later_iteration_at_that_boundary() -> None:
    replacements, node = _donor()
    replacements.on_message(Message(HANDOVER_REQUEST, 5, 0, 0, meta={"restart": 1, "at": 103}))
    assert replacements.take_handover_requests(101) == []
    assert replacements.take_handover_requests(102) == []
    assert replacements.take_handover_requests(103) == [5]
    assert node.handover_requests == []


def test_a_donor_already_past_the_iteration_or_blocked_answers_at_once() -> None:
    replacements, _ = _donor()
    replacements.on_message(Message(HANDOVER_REQUEST, 5, 0, 0, meta={"restart": 1, "at": 103}))
    assert replacements.take_handover_requests(110) == [5]
    replacements.on_message(Message(HANDOVER_REQUEST, 5, 0, 0, meta={"restart": 1, "at": 120}))
    assert replacements.take_handover_requests() == [5]  # blocked where the model is consistent, or done
    replacements.on_message(Message(HANDOVER_REQUEST, 5, 0, 0, meta={"restart": 1}))
    assert replacements.take_handover_requests(100) == [5]  # a single replacement takes the next boundary

"""Partial Reduce's controller (hopnet/protocols/partial_reduce/controller.py) and weights
(hopnet/protocols/partial_reduce/weights.py): pure tests, driven by a small event simulation of workers."""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hopnet.coordinator.base import BadCoordinatorMessage, Send
from hopnet.protocols.partial_reduce.mixing import mixing_matrix, spectral_rho
from hopnet.protocols.partial_reduce.controller import (FormedGroup, PartialReduceController, default_frozen_window,
                                               sync_graph_connected)
from hopnet.protocols.partial_reduce.weights import constant_weights, dynamic_weights

# ---------------------------------------------------------------------------- a driver

ComputeTime = Callable[[int, random.Random], float]


@dataclass
class Trace:
    groups: list[FormedGroup] = field(default_factory=list)
    spans: list[tuple[float, float, tuple[int, ...]]] = field(default_factory=list)  # (formed, done, members)
    readies: list[tuple[int, int]] = field(default_factory=list)  # (rank, gid count when sent), arrival order
    events: list[tuple[str, int, int]] = field(default_factory=list)  # ("ready", rank, -1) / ("group", rank, gid)


def drive(controller: PartialReduceController, compute: ComputeTime, groups: int, *, seed: int = 0,
          group_s: float = 0.001, stop: dict[int, int] | None = None) -> Trace:
    """Workers compute (``compute(rank, rng)`` seconds), send ready, block until their group, spend
    ``group_s`` averaging, and go again; until ``groups`` groups were formed. ``stop``: rank -> after
    how many groups it says bye instead of its next ready. Ties in time go by rank."""
    n = controller.world_size
    rng = random.Random(seed)
    trace = Trace()
    counters = [0] * n
    done_groups = [0] * n
    clock: list[tuple[float, int, int]] = []  # (time, rank, seq) of the next ready
    seq = 0
    for rank in range(n):
        heapq.heappush(clock, (compute(rank, rng), rank, seq))
        seq += 1

    def handle(sends: list[Send], now: float) -> None:
        nonlocal seq
        by_gid: dict[int, list[Send]] = {}
        for send in sends:
            by_gid.setdefault(send.message["gid"], []).append(send)
        for gid, batch in by_gid.items():
            message = batch[0].message
            assert sorted(s.to for s in batch) == message["members"]
            trace.groups.append(FormedGroup(gid, tuple(message["members"]), tuple(message["weights"]),
                                            message["iter"], False))
            trace.spans.append((now, now + group_s, tuple(message["members"])))
            for send in batch:
                trace.events.append(("group", send.to, gid))
                counters[send.to] = message["iter"]
                done_groups[send.to] += 1
                heapq.heappush(clock, (now + group_s + compute(send.to, rng), send.to, seq))
                seq += 1

    while clock and len(trace.groups) < groups:
        now, rank, _ = heapq.heappop(clock)
        if stop is not None and rank in stop and done_groups[rank] >= stop[rank]:
            handle(controller.on_message(rank, {"t": "bye"}), now)
            continue
        counters[rank] += 1  # the local step
        trace.readies.append((rank, len(trace.groups)))
        trace.events.append(("ready", rank, -1))
        handle(controller.on_message(rank, {"t": "ready", "iter": counters[rank]}), now)
    return trace


def homogeneous(mean_s: float = 0.01) -> ComputeTime:
    return lambda rank, rng: rng.expovariate(1.0 / mean_s)


def constant(seconds: float = 0.01) -> ComputeTime:
    return lambda rank, rng: seconds


# ---------------------------------------------------------------------------- groups


@pytest.mark.parametrize("n, p", [(4, 2), (7, 3), (9, 4), (5, 5)])
def test_groups_have_p_distinct_members_and_concurrent_groups_are_disjoint(n: int, p: int) -> None:
    controller = PartialReduceController(n, p)
    # averaging takes as long as a compute on average, so many groups overlap in time
    trace = drive(controller, homogeneous(0.01), 600, seed=n * 10 + p, group_s=0.01)
    assert len(trace.groups) == 600
    for group in trace.groups:
        assert len(group.members) == p and len(set(group.members)) == p
        assert all(0 <= r < n for r in group.members)
    overlapping = 0
    for a, (start_a, end_a, members_a) in enumerate(trace.spans):
        for start_b, end_b, members_b in trace.spans[a + 1:]:
            if start_b >= end_a:
                break
            overlapping += 1
            assert not set(members_a) & set(members_b)
    if p < n:
        assert overlapping > 50  # the property was exercised


def test_each_worker_is_in_at_most_one_group_between_two_of_its_readies() -> None:
    controller = PartialReduceController(8, 3)
    trace = drive(controller, lambda rank, rng: rng.expovariate(1.0 / (0.01 * (1 + rank % 3))), 500, seed=3)
    state: dict[int, str] = {}
    for kind, rank, _gid in trace.events:
        if kind == "ready":
            assert state.get(rank) != "waiting"
            state[rank] = "waiting"
        else:
            assert state.get(rank) == "waiting", f"rank {rank} grouped without a ready signal"
            state[rank] = "grouped"


def test_without_the_filter_groups_follow_fifo_arrival_order() -> None:
    controller = PartialReduceController(7, 3, frozen_window=0)
    trace = drive(controller, homogeneous(), 400, seed=11)
    queue: list[int] = []
    formed = iter(trace.groups)
    for kind, rank, _gid in trace.events:
        if kind == "ready":
            queue.append(rank)
            if len(queue) == 3:
                assert next(formed).members == tuple(sorted(queue))
                queue = []
    assert controller.repairs == controller.holds == 0


def test_a_ready_while_waiting_or_after_bye_and_unknown_kinds_are_refused() -> None:
    controller = PartialReduceController(4, 2)
    assert controller.on_message(0, {"t": "ready", "iter": 1}) == []
    with pytest.raises(BadCoordinatorMessage, match="already waiting"):
        controller.on_message(0, {"t": "ready", "iter": 2})
    controller.on_message(1, {"t": "bye"})
    with pytest.raises(BadCoordinatorMessage, match="after it left"):
        controller.on_message(1, {"t": "ready", "iter": 1})
    for bad in ({"t": "ready"}, {"t": "ready", "iter": -1}, {"t": "ready", "iter": True}, {"t": "hello"}, {}):
        with pytest.raises(BadCoordinatorMessage):
            controller.on_message(2, bad)
    with pytest.raises(BadCoordinatorMessage, match="not a worker rank"):
        controller.on_message(9, {"t": "ready", "iter": 1})
    sends = controller.on_message(2, {"t": "ready", "iter": 5})  # the refused messages changed nothing
    assert [s.to for s in sends] == [0, 2]
    assert sends[0].message == {"t": "group", "gid": 0, "members": [0, 2], "weights": [0.5, 0.5], "iter": 5}


def test_groups_shrink_to_the_workers_left_rather_than_stall() -> None:
    controller = PartialReduceController(4, 3)
    assert controller.on_message(0, {"t": "ready", "iter": 1}) == []
    assert controller.on_message(1, {"t": "ready", "iter": 1}) == []
    sends = controller.on_worker_gone(3)  # 3 workers left, 2 queued: still waiting for rank 2
    assert sends == []
    sends = controller.on_message(2, {"t": "bye"})  # 2 left, both queued: they go together
    assert {s.to for s in sends} == {0, 1} and sends[0].message["weights"] == [0.5, 0.5]
    sends = controller.on_message(0, {"t": "bye"})
    assert sends == []
    sends = controller.on_message(1, {"t": "ready", "iter": 2})  # alone: a group of itself
    assert [(s.to, s.message["members"], s.message["weights"]) for s in sends] == [(1, [1], [1.0])]
    assert controller.summary()["shrunk_groups"] == 2


def test_a_long_run_with_departures_never_stalls() -> None:
    controller = PartialReduceController(6, 3)
    trace = drive(controller, homogeneous(), 400, seed=5, stop={1: 20, 4: 60, 5: 61})
    assert len(trace.groups) == 400  # the last three carry on in groups of three
    assert all({1, 4, 5}.isdisjoint(g.members) for g in trace.groups[200:])


# ---------------------------------------------------------------------------- group-frozen avoidance


def split_sequence(n: int, p: int, frozen_window: int | None, groups: int) -> tuple[PartialReduceController, Trace]:
    """Identical workers: FIFO order repeats every round, the worst case for freezing."""
    controller = PartialReduceController(n, p, frozen_window=frozen_window)
    return controller, drive(controller, constant(0.01), groups)


def test_the_four_worker_split_freezes_without_the_filter() -> None:
    _, trace = split_sequence(4, 2, 0, 60)
    assert {g.members for g in trace.groups} == {(0, 1), (2, 3)}


def test_the_four_worker_split_is_detected_and_repaired() -> None:
    controller, trace = split_sequence(4, 2, None, 200)
    window = controller.frozen_window
    assert window == default_frozen_window(4, 2) == 9
    members = [g.members for g in trace.groups]
    assert members[:window - 1] == [(0, 1), (2, 3)] * ((window - 1) // 2)  # frozen until the window filled
    assert controller.repairs > 0
    assert {g for g in members[window:]} - {(0, 1), (2, 3)}  # cross groups appear
    for end in range(2 * window, len(members) + 1):  # from then on every window is connected
        assert sync_graph_connected(members[end - window:end], range(4), 4), members[end - window:end]
    assert controller.frozen_accepted == 0


def test_identical_workers_in_larger_clusters_stay_connected() -> None:
    controller, trace = split_sequence(9, 3, None, 400)
    window = controller.frozen_window
    members = [g.members for g in trace.groups]
    for end in range(3 * window, len(members) + 1, 7):
        assert sync_graph_connected(members[end - window:end], range(9), 9)


def test_a_slow_worker_absent_from_the_window_does_not_hold_the_others() -> None:
    # rank 5 is 50x slower: it misses whole windows; that is no frozen split, nobody waits for it
    compute = lambda rank, rng: (0.5 if rank == 5 else 0.01) * rng.uniform(0.9, 1.1)  # noqa: E731
    controller = PartialReduceController(6, 2)
    drive(controller, compute, 500, seed=2)
    assert controller.holds == 0


# ---------------------------------------------------------------------------- weights


def test_constant_weights_preserve_the_sum_of_the_models() -> None:
    gen = torch.Generator().manual_seed(0)
    models = torch.randn(6, 1000, generator=gen, dtype=torch.float64)
    total = models.sum(0)
    controller = PartialReduceController(6, 3, keep_log=True)
    drive(controller, homogeneous(), 100, seed=1)
    assert controller.log is not None
    for group in controller.log:
        assert group.weights == tuple(constant_weights(3))
        idx = list(group.members)
        models[idx] = sum(beta * models[i] for beta, i in zip(group.weights, idx))
    assert (models.sum(0) - total).abs().max() < 1e-10


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 60), min_size=1, max_size=8), st.floats(0.0, 0.99),
       st.sampled_from(["oldest", "nearest", "renormalize"]))
def test_dynamic_weights_are_a_distribution(counters: list[int], alpha: float, policy: str) -> None:
    betas = dynamic_weights(counters, alpha, policy)
    assert len(betas) == len(counters)
    assert all(b >= 0 for b in betas)
    assert sum(betas) == pytest.approx(1.0, abs=1e-12)
    for i, j in [(i, j) for i in range(len(counters)) for j in range(len(counters))]:
        if counters[i] == counters[j]:
            assert betas[i] == pytest.approx(betas[j], abs=1e-15)  # a shared level is split equally
    if policy == "renormalize":  # the one policy where a staler member never outweighs a fresher one
        for i in range(len(counters)):
            for j in range(len(counters)):
                if counters[i] > counters[j]:
                    assert betas[i] >= betas[j]


@pytest.mark.parametrize("policy", ["oldest", "nearest", "renormalize"])
def test_dynamic_weights_are_uniform_when_all_counters_are_equal(policy: str) -> None:
    assert dynamic_weights([7, 7, 7], 0.9, policy) == pytest.approx([1 / 3] * 3, abs=1e-15)
    assert dynamic_weights([3, 3], 0.0, policy) == pytest.approx([0.5, 0.5], abs=1e-15)


def test_dynamic_weights_follow_eq9_and_the_missing_level_policies() -> None:
    alpha = 0.9
    # levels (relative iterations) 1, 1, 4: w_r = 0.1 * 0.9^(r-1) / (1 - 0.9^4)
    w = [0.1 * alpha ** (r - 1) / (1 - alpha ** 4) for r in range(1, 5)]
    oldest = dynamic_weights([10, 10, 7], alpha, "oldest")
    assert oldest == pytest.approx([w[0] / 2, w[0] / 2, w[1] + w[2] + w[3]])
    assert oldest[2] == pytest.approx(0.709, abs=5e-4)  # the digest's example: the stalest gains
    nearest = dynamic_weights([10, 10, 7], alpha, "nearest")  # level 2 is nearest 1, level 3 nearest 4
    assert nearest == pytest.approx([(w[0] + w[1]) / 2, (w[0] + w[1]) / 2, w[2] + w[3]])
    renormalize = dynamic_weights([10, 10, 7], alpha, "renormalize")
    assert renormalize == pytest.approx([1 / (2 + alpha ** 3)] * 2 + [alpha ** 3 / (2 + alpha ** 3)])
    # consecutive levels: no policy has anything to move
    assert dynamic_weights([5, 4], alpha, "oldest") == pytest.approx([1 / (1 + alpha), alpha / (1 + alpha)])
    # a gap of a million iterations in closed form, no loop over the levels
    assert dynamic_weights([10 ** 6, 0], alpha, "nearest") == pytest.approx([1.0, 0.0], abs=1e-12)


def test_the_controller_sends_dynamic_weights_and_the_newest_counter() -> None:
    counters = [9, 3, 9, 1]
    controller = PartialReduceController(4, 4, weights="dynamic", ema_decay=0.9)
    sends: list[Send] = []
    for rank, k in enumerate(counters):
        sends += controller.on_message(rank, {"t": "ready", "iter": k})
    assert [s.to for s in sends] == [0, 1, 2, 3]
    message = sends[0].message
    assert message["iter"] == 9 and message["members"] == [0, 1, 2, 3]
    assert message["weights"] == pytest.approx(dynamic_weights(counters, 0.9, "oldest"))
    assert all(s.message == message for s in sends)


# ---------------------------------------------------------------------------- the mixing matrix


def test_homogeneous_three_workers_in_pairs_give_rho_one_half() -> None:
    controller = PartialReduceController(3, 2, keep_log=True)
    drive(controller, homogeneous(), 5_000, seed=42)
    assert controller.log is not None
    pairs = [g.members for g in controller.log]
    for pair in [(0, 1), (0, 2), (1, 2)]:
        assert pairs.count(pair) / len(pairs) == pytest.approx(1 / 3, abs=0.025)
    rho = spectral_rho(mixing_matrix(((g.members, g.weights) for g in controller.log), 3))
    assert rho == pytest.approx(0.5, abs=0.03)


def test_rho_of_the_paper_pair_frequencies() -> None:
    # Fig. 4(b): one worker 2x slower, pairs with frequencies 1/2, 1/4, 1/4 give rho = 0.625
    groups = [((0, 1), None)] * 2 + [((0, 2), None), ((1, 2), None)]
    assert spectral_rho(mixing_matrix(groups, 3)) == pytest.approx(0.625, abs=1e-12)
    assert spectral_rho(mixing_matrix([((0, 1, 2), None)], 3)) == pytest.approx(0.0, abs=1e-12)

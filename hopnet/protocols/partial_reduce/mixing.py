"""The mixing matrix of a group-averaging run, from its logged groups (Partial Reduce Sec. 3.2).

Counting each group operation as one step, ``X_{k+1} = X_k W_k`` with (Eq. 4, weights
``beta``): ``W_k(i, j) = beta_i`` when ``i, j`` are both members, ``W_k(i, i) = 1`` for a
non-member, 0 elsewhere (``beta = 1/P`` for constant weights, which makes ``W_k`` doubly
stochastic and symmetric). The theory's ``rho`` is the spectral gap bound of the empirical
mean ``E[W] = (1/K) sum_k W_k``: ``max(|lambda_2|, |lambda_N|)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

GROUP_RECORD = "p_reduce"
"""The event record a partial-reduce worker writes for each group it averaged in."""
COORDINATOR_GROUP_RECORD = "group"
"""The record the coordinator host writes for each group it sent out (``coordinator.jsonl``)."""


def group_matrix(members: Sequence[int], weights: Sequence[float] | None, world_size: int) -> torch.Tensor:
    """``W_k`` of one group (float64)."""
    w = torch.eye(world_size, dtype=torch.float64)
    betas = weights if weights is not None else [1.0 / len(members)] * len(members)
    for i, beta in zip(members, betas):
        for j in members:
            w[i, j] = beta
    return w


def mixing_matrix(groups: Iterable[tuple[Sequence[int], Sequence[float] | None]], world_size: int) -> torch.Tensor:
    """The empirical ``E[W]`` over ``(members, weights)`` pairs (weights None: 1/P)."""
    total = torch.zeros(world_size, world_size, dtype=torch.float64)
    count = 0
    for members, weights in groups:
        total += group_matrix(members, weights, world_size)
        count += 1
    if count == 0:
        raise ValueError("no groups to average")
    return total / count


def spectral_rho(matrix: torch.Tensor) -> float:
    """``max(|lambda_2|, |lambda_N|)`` of a stochastic matrix: the largest eigenvalue
    magnitude once the eigenvalue 1 of the consensus direction is set aside."""
    magnitudes = sorted(torch.linalg.eigvals(matrix).abs().tolist(), reverse=True)
    return magnitudes[1] if len(magnitudes) > 1 else 0.0


def groups_from_records(records: Iterable[Mapping[str, Any]]) -> list[tuple[list[int], list[float] | None]]:
    """The groups of a run, once each and in the order formed (by gid), from its event
    records: the workers' ``p_reduce`` records (of any or all ranks) or the coordinator's
    ``group`` records (``coordinator.jsonl``). Weights are None where a record has none (1/P)."""
    by_gid: dict[int, tuple[list[int], list[float] | None]] = {}
    for record in records:
        if record.get("event") not in (GROUP_RECORD, COORDINATOR_GROUP_RECORD) or "members" not in record:
            continue
        gid = record["gid"]
        if gid not in by_gid:
            weights = record.get("weights")
            by_gid[gid] = (list(record["members"]), list(weights) if weights is not None else None)
    return [by_gid[gid] for gid in sorted(by_gid)]

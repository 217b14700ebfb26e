"""Partial Reduce's aggregation weights: constant 1/P, or staleness-aware (Eq. 9 of Miao et
al., SIGMOD'21, Sec. 3.3). Pure functions of the members' iteration counters.

Dynamic weights, formalised (docs/protocols/partial-reduce.md, "Design"): a member with counter
``k_j`` has relative iteration (staleness level) ``r_j = max(k) - k_j + 1``, so the freshest
member is at level 1 and the stalest at ``K = max(r)``. Eq. 9 with ``k := K`` gives level
``r`` the weight

    w_r = (1 - a) a^(r-1) / (1 - a^K),   r = 1 .. K,   sum_r w_r = 1

(``a`` = ``ema_decay``). Levels no member holds are *missing*; their weight goes to a level
that is present, as ``missing_policy`` says:

* ``oldest``: all of it to the stalest level ``K`` (the paper's "use the initial model x_1
  for the versions not stored": x_1 is the oldest version in Eq. 9's indexing);
* ``nearest``: each missing level to the closest present level, a tie to the fresher one
  (the paper's alternative, "the version of the closest iteration number");
* ``renormalize``: dropped, the present members renormalised: ``beta_j ~ a^(r_j - 1)``
  per member.

Under ``oldest`` and ``nearest`` the members that share a level split its weight equally
(the paper's rule). All three give ``1/P`` to everyone when all counters are equal.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

WEIGHT_MODES = ("const", "dynamic")
MISSING_POLICIES = ("oldest", "nearest", "renormalize")


def constant_weights(size: int) -> list[float]:
    """``1/P`` for each of the ``size`` members."""
    if size < 1:
        raise ValueError(f"a group needs at least one member (got {size})")
    return [1.0 / size] * size


def staleness_levels(iterations: Sequence[int]) -> list[int]:
    """Each member's relative iteration ``max(k) - k_j + 1`` (1 = freshest)."""
    if not iterations:
        raise ValueError("a group needs at least one member")
    newest = max(iterations)
    return [newest - k + 1 for k in iterations]


def dynamic_weights(iterations: Sequence[int], ema_decay: float, missing_policy: str = "oldest") -> list[float]:
    """The staleness-aware weight of each member, in the order of ``iterations``.

    Non-negative, summing to 1 (up to rounding), and ``1/P`` each when all counters are equal."""
    if not 0 <= ema_decay < 1:
        raise ValueError(f"ema_decay must be in [0, 1) (got {ema_decay})")
    if missing_policy not in MISSING_POLICIES:
        raise ValueError(f"missing_policy must be one of {', '.join(MISSING_POLICIES)} (got {missing_policy!r})")
    levels = staleness_levels(iterations)
    a = ema_decay
    if missing_policy == "renormalize":
        raw = [a ** (r - 1) for r in levels]  # the freshest member has a^0 = 1, so the total is >= 1
        total = sum(raw)
        return [x / total for x in raw]
    deepest = max(levels)
    norm = 1.0 - a ** deepest

    def mass(lo: int, hi: int) -> float:
        """Sum of w_r for r in [lo, hi], in closed form (K may be large)."""
        if hi < lo:
            return 0.0
        return (a ** (lo - 1) - a ** hi) / norm

    present = sorted(set(levels))
    level_mass = {r: mass(r, r) for r in present}
    for fresher, staler in zip(present, present[1:]):
        if staler - fresher < 2:
            continue  # no level missing in between
        if missing_policy == "oldest":
            level_mass[deepest] += mass(fresher + 1, staler - 1)
        else:  # nearest: up to the midpoint to the fresher level (a tie too), the rest to the staler
            middle = (fresher + staler) // 2
            level_mass[fresher] += mass(fresher + 1, middle)
            level_mass[staler] += mass(middle + 1, staler - 1)
    sharing = Counter(levels)
    weights = [level_mass[r] / sharing[r] for r in levels]
    total = sum(weights)
    return [w / total for w in weights]


def group_weights(mode: str, iterations: Sequence[int], *, ema_decay: float = 0.9,
                  missing_policy: str = "oldest") -> list[float]:
    """The weights ``mode`` (``const`` or ``dynamic``) gives members with these counters."""
    if mode == "const":
        return constant_weights(len(iterations))
    if mode == "dynamic":
        return dynamic_weights(iterations, ema_decay, missing_policy)
    raise ValueError(f"weights must be one of {', '.join(WEIGHT_MODES)} (got {mode!r})")

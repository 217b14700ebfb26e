"""How often Partial Reduce's group-frozen filter acts, by window size (docs/protocols/partial-reduce.md).

Drives the controller (no torch, no network) with workers whose compute times are
exponential: homogeneous, or rank 0 five times slower. A worker computes, sends ready,
waits for its group, averages for 1 ms and goes again. Prints repairs/holds per 4000
groups for T = 1x, 2x and 3x the paper's minimum ceil((N-1)/(P-1)).

    python bench/frozen_window.py            # ~10 s
"""

from __future__ import annotations

import heapq
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hopnet.protocols.partial_reduce.controller import PartialReduceController, minimum_connecting_groups  # noqa: E402

GROUPS = 4000
AVERAGE_S = 0.001


def run(n: int, p: int, window: int, slow_factor: float, seed: int = 1) -> PartialReduceController:
    controller = PartialReduceController(n, p, frozen_window=window)
    rng = random.Random(seed)

    def compute(rank: int) -> float:
        return rng.expovariate(1.0 / (0.01 * (slow_factor if rank == 0 else 1.0)))

    counters = [0] * n
    clock = [(compute(rank), rank) for rank in range(n)]
    heapq.heapify(clock)
    while controller.next_gid < GROUPS:
        now, rank = heapq.heappop(clock)
        counters[rank] += 1
        for send in controller.on_message(rank, {"t": "ready", "iter": counters[rank]}):
            counters[send.to] = send.message["iter"]
            heapq.heappush(clock, (now + AVERAGE_S + compute(send.to), send.to))
    return controller


def main() -> None:
    print(f"repairs/holds per {GROUPS} groups (homogeneous, rank 0 5x slower)")
    print("| N, P | 1x (paper's minimum) | 2x | 3x |")
    print("| --- | --- | --- | --- |")
    for n, p in [(4, 2), (8, 3), (16, 3), (16, 4)]:
        minimum = minimum_connecting_groups(n, p)
        cells = []
        for factor in (1, 2, 3):
            same = run(n, p, factor * minimum, 1.0)
            slow = run(n, p, factor * minimum, 5.0)
            cells.append(f"{same.repairs}/{same.holds}, {slow.repairs}/{slow.holds}")
        print(f"| {n}, {p} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

"""Hop mixes by accumulation (hopnet/runtime/mix_sums.py): the mix equals the weighted average of
the model and the updates used, computed directly, with backup workers and with staleness."""

from __future__ import annotations

import threading

import pytest
import torch

from hopnet import Graph, ProtocolConfig
from hopnet.runtime.mix_sums import MixSums, mix_into

from support.threaded import Start, run_ranks

SIZE = 1000


def test_summed_updates_mix_as_the_weighted_average_computed_directly() -> None:
    gen = torch.Generator().manual_seed(0)
    model = [torch.randn(SIZE, generator=gen), torch.randn(7, generator=gen, dtype=torch.float64)]
    updates = {k: [[torch.randn(SIZE, generator=gen), torch.randn(7, generator=gen, dtype=torch.float64)]
                   for _ in range(3)] for k in (4, 5)}
    weights = [0.2, 0.5, 1.5]  # e.g. graph weight x staleness factor
    own = 0.75
    released: list[list[torch.Tensor]] = []
    sums = MixSums(released.append)
    for k, received in updates.items():
        for update, weight in zip(received, weights):
            sums.add(k, [t.clone() for t in update], weight)
    assert len(sums) == 2 and len(released) == 4  # all but the first update of each iteration given back

    expected = [(own * m + sum(w * u[i] for w, u in zip(weights, updates[5]))) / (own + sum(weights))
                for i, m in enumerate(model)]
    summed = sums.pop(5)
    assert summed is not None and summed.count == 3
    mixed = [m.clone() for m in model]
    mix_into(mixed, own, summed)
    for got, want in zip(mixed, expected):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    sums.discard_older_than(6)
    assert len(sums) == 0 and len(released) == 5


# With --staleness S >= 1 iteration 0 would not wait (an update of iteration -1 is fresh enough): S = 0
# takes the staleness path (the newest update of each sender kept until the reduce) and still waits.
@pytest.mark.parametrize("flags", [{"backup_workers": 1}, {"backup_workers": 1, "staleness": 0}],
                         ids=["backup-workers", "backup-workers+staleness"])
def test_a_worker_mixes_the_updates_that_came_as_their_weighted_average(flags: dict[str, int]) -> None:
    """Rank 0 of complete:4 needs 2 of its 3 in-neighbours' updates: rank 3 sends its own only once
    rank 0 has mixed (serial approach: the update leaves after the step), so rank 0 mixes itself,
    rank 1 and rank 2."""
    graph = Graph.complete(4)
    config = ProtocolConfig(protocol="hop", serial=True, timeout_s=30.0, **flags)
    mixed = threading.Event()
    initial = {r: torch.randn(SIZE, generator=torch.Generator().manual_seed(r)) for r in range(4)}

    def body(rank: int, start: Start) -> torch.Tensor:
        model = torch.nn.Linear(SIZE, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(initial[rank].view(1, SIZE))
        worker = start(model)
        for _ in worker.iterations(1):
            if rank == 3:
                assert mixed.wait(30.0)
            worker.step()
        if rank == 0:
            mixed.set()
        return model.weight.detach().view(SIZE).clone()

    results = run_ranks(4, config, body, graph=graph)
    used = (0, 1, 2)
    weights = {j: graph.weight(j, 0) for j in used}
    expected = sum(weights[j] * initial[j] for j in used) / sum(weights.values())
    assert torch.allclose(results[0], expected, rtol=1e-5, atol=1e-6)

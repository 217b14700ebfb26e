"""Hop holds its neighbours' updates of the next iteration back, unread, until it has mixed the current
one (issue 18: at most the model, one sum and the update being received), on a transport that can
(tests/support/holding.py stands in for the torch bulk plane: held messages and their senders wait)."""

from __future__ import annotations

import time

import pytest
import torch

from hopnet import Graph, ProtocolConfig
from hopnet.protocols.hop.protocol import STREAM_WINDOW
from hopnet.transports.base import Transport

from support.holding import HoldingLinks, HoldingTransport
from support.threaded import Start, run_ranks

SIZE = 1000
ITERATIONS = 6


def _initial(n: int) -> dict[int, torch.Tensor]:
    return {r: torch.randn(SIZE, generator=torch.Generator().manual_seed(r)) for r in range(n)}


def _run(config: ProtocolConfig, graph: Graph, *, hold: bool, slow: int | None = 0, pause_s: float = 0.02,
         pause_at: range = range(ITERATIONS), heartbeats: bool = False) -> tuple[list[torch.Tensor], list[dict[str, int]], list[list[dict]]]:
    """Hop for ITERATIONS iterations; rank ``slow`` pauses ``pause_s`` before the steps ``pause_at`` (its neighbours
    run ahead of it, so their updates of the next iteration come before it mixed the current one).
    Returns each rank's model, protocol summary and event records."""
    initial = _initial(graph.n)
    links = HoldingLinks()

    def wrap(rank: int, inner: Transport) -> Transport:
        if not hold:
            return inner
        transport = HoldingTransport(inner, links)
        transport.heartbeats = heartbeats
        return transport

    def body(rank: int, start: Start) -> tuple[torch.Tensor, dict[str, int], list[dict]]:
        model = torch.nn.Linear(SIZE, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(initial[rank].view(1, SIZE))
        worker = start(model)
        for k in worker.iterations(ITERATIONS):
            if rank == slow and k in pause_at:
                time.sleep(pause_s)
            worker.step()
        return model.weight.detach().view(SIZE).clone(), worker.node.protocol.summary(), worker.node.events.records

    results = run_ranks(graph.n, config, body, graph=graph, wrap=wrap)
    return [r[0] for r in results], [r[1] for r in results], [r[2] for r in results]


@pytest.mark.parametrize("stream_mib", [0.0, 1 / 1024], ids=["whole", "streamed"])
def test_the_next_iterations_updates_wait_until_this_one_is_mixed(stream_mib: float) -> None:
    """ring:4, rank 0 slower: its neighbours' updates of iteration k + 1 reach it before it mixed k, and
    wait unread (but for one that fits in a buffer freed once k's updates are all in). A worker holds
    one sum and the updates (chunks) being received; without holding, k + 1's sum on top. The models
    end as without holding."""
    config = ProtocolConfig(protocol="hop", timeout_s=30.0, stream_mib=stream_mib)
    held_models, held, _ = _run(config, Graph.ring(4), hold=True)
    free_models, free, _ = _run(config, Graph.ring(4), hold=False)
    assert sum(s["updates_held"] for s in held) > 0  # rank 0's neighbours ran ahead and were held back
    # buffers of the model's regions: 1 whole; 4 chunks of 1 KiB, at most STREAM_WINDOW per sender in flight
    bound = 2 if not stream_mib else 4 + STREAM_WINDOW * 2
    assert max(s["buffers_allocated"] for s in held) <= bound < max(s["buffers_allocated"] for s in free)
    for got, want in zip(held_models, free_models):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_no_hold_back_takes_every_update_in_as_it_comes() -> None:
    """``--no-hold-back``: on a transport that could hold, nothing is held, and the next iteration's
    updates take buffers of their own as before."""
    config = ProtocolConfig(protocol="hop", timeout_s=30.0, hold_back=False)
    _, summaries, _ = _run(config, Graph.ring(4), hold=True)
    assert sum(s["updates_held"] for s in summaries) == 0
    assert max(s["buffers_allocated"] for s in summaries) > 2


@pytest.mark.parametrize("graph, flags", [
    (Graph.ring(4), {"serial": True}),
    (Graph.ring(4), {"max_ig": 1}),
    (Graph.complete(4), {"backup_workers": "0:1"}),  # rank 0 need not wait for anyone: its updates are not held
    (Graph(4, [(i, (i + 1) % 4) for i in range(4)] + [(0, 2), (2, 0)]), {}),  # directed, one two-way pair
], ids=["ring-serial", "ring-max-ig-1", "complete-backup-rank-0", "directed"])
def test_holding_back_ends_without_deadlock(graph: Graph, flags: dict[str, object]) -> None:
    """Workers that hold updates back and senders that wait for them finish, whatever the graph, the
    approach, the token bound or a mix of workers with and without backup workers."""
    config = ProtocolConfig(protocol="hop", timeout_s=30.0, **flags)  # type: ignore[arg-type]
    models, summaries, _ = _run(config, graph, hold=True, slow=1)
    stacked = torch.stack(list(_initial(graph.n).values()))
    low, high = stacked.min(0).values - 1e-6, stacked.max(0).values + 1e-6
    assert all(bool(((low <= m) & (m <= high)).all()) for m in models)  # weighted averages of the models
    assert all(s["sums_high_water"] >= 1 for s in summaries)


def test_a_peer_whose_update_is_held_back_is_not_taken_for_dead() -> None:
    """ring:4, peer timeout 0.5 s, rank 2 pauses 1.2 s once: rank 1 holds rank 0's next update while it waits
    for rank 2, and rank 0's beats queue behind it. Rank 0 waits on rank 1 and is alive: nobody is
    declared dead (rank 2, slow but beating, neither)."""
    config = ProtocolConfig(protocol="hop", timeout_s=30.0, peer_timeout_s=0.5)
    _, summaries, records = _run(config, Graph.ring(4), hold=True, slow=2, pause_s=1.2, pause_at=range(1, 2),
                                 heartbeats=True)
    assert sum(s["updates_held"] for s in summaries) > 0
    assert not [r for rank in records for r in rank if r["event"] == "peer_dead"]


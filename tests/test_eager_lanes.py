"""eager-SGD between replica groups, in one process on virtual time: each lane of a replica runs its
own ring of eager-SGD ranks (one per replica), and the lanes of a replica agree through an
in-process stand-in for their gloo groups. The lanes of a replica see activations and the trainer's
calls at different moments; given the same gradients, their parameters must stay identical."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from hopnet import Graph, ProtocolConfig
from hopnet.protocols import make_protocol
from hopnet.protocols.eager.protocol import EagerProtocol
from hopnet.runtime.clock import Clock
from hopnet.runtime.node import Node
from hopnet.sim.vloop import VirtualTimeLoop
from hopnet.transports.inproc import InprocNetwork, LinkModel

from support.lanes import InprocLanes, Meeting


def run_replicas(replicas: int, lanes: int, steps: int, mode: str, slow_replica_s: float,
                 seed: int) -> tuple[list[list[torch.Tensor]], list[list[list[int | None]]], list[list[EagerProtocol]]]:
    """Every lane's parameters at the end, the round each step of each lane took, and the protocols.
    Replica ``r``'s lanes get the same gradient at step ``k``; each lane's compute time has a jitter
    of its own (what makes the lanes see the rounds apart); replica 0 is ``slow_replica_s`` slower."""
    config = ProtocolConfig(protocol="eager-sgd", eager_mode=mode, timeout_s=60)  # type: ignore[call-arg]
    graph = Graph.ring(replicas)
    jitter = random.Random(seed)
    compute = {(r, m, k): 0.01 + (slow_replica_s if r == 0 else 0.0) + jitter.uniform(0, 0.004)
               for r in range(replicas) for m in range(lanes) for k in range(steps)}

    async def main() -> tuple[list[list[torch.Tensor]], list[list[list[int | None]]], list[list[EagerProtocol]]]:
        meetings = [(Meeting(lanes), Meeting(lanes)) for _ in range(replicas)]
        params = [[torch.zeros(29, dtype=torch.float64) for _ in range(lanes)] for _ in range(replicas)]
        grads = [[torch.zeros_like(p) for p in row] for row in params]
        taken: list[list[list[int | None]]] = [[[] for _ in range(lanes)] for _ in range(replicas)]
        nodes: list[list[Node]] = [[] for _ in range(replicas)]
        for m in range(lanes):
            network = InprocNetwork(LinkModel(latency_s=1e-3))
            for r in range(replicas):
                agree, side = meetings[r]
                nodes[r].append(Node(r, graph, network.transport(r, frozenset(graph.peers(r))),
                                     make_protocol(config, params[r][m], grads[r][m]), clock=Clock(config.timeout_s),
                                     timer=asyncio.get_running_loop().time,
                                     lanes=InprocLanes(agree, m, side=InprocLanes(side, m))))
        for row in nodes:
            for node in row:
                await node.open()

        async def trainer(r: int, m: int) -> None:
            node = nodes[r][m]
            await node.protocol.start()
            for k in range(steps):
                await asyncio.sleep(compute[r, m, k])
                gen = torch.Generator().manual_seed(7919 * r + k)
                grads[r][m].copy_(torch.randint(-64, 65, (29,), generator=gen).to(torch.float64))

                def apply(r: int = r, m: int = m) -> None:
                    params[r][m].sub_(0.25 * grads[r][m])

                await node.run_step(apply, last=k == steps - 1)
                taken[r][m].append(node.protocol.last_round)  # type: ignore[attr-defined]
            await node.close()

        await asyncio.gather(*(trainer(r, m) for r in range(replicas) for m in range(lanes)))
        protocols = [[node.protocol for node in row] for row in nodes]
        return params, taken, protocols  # type: ignore[return-value]

    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


@pytest.mark.parametrize("mode", ["solo", "majority"])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_lanes_of_a_replica_put_the_same_calls_in_each_round_and_take_the_same_results(
        mode: str, seed: int) -> None:
    params, taken, protocols = run_replicas(replicas=3, lanes=3, steps=40, mode=mode, slow_replica_s=0.02, seed=seed)
    for r in range(3):
        assert taken[r][0] == taken[r][1] == taken[r][2], (r, taken[r])
        assert all(torch.equal(params[r][0], p) for p in params[r][1:]), f"replica {r}'s lanes parted"
        rounds = [p.active_per_round[: p.executed] for p in protocols[r]]
        assert rounds[0] == rounds[1] == rounds[2]
    # the slow replica was left behind as one: rounds ran without its gradient, and it skipped results
    assert any(active < 3 for active in protocols[1][0].active_per_round)
    assert protocols[0][0].rounds_skipped > 0 or protocols[0][0].stale_calls > 0

"""Two workers in one process, without `hopnet launch`, never closed: `python unclosed_workers.py RUN_DIR MODE`.

MODE ``return``: the script just ends; ``raise``: it ends with an uncaught exception.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import torch

from hopnet import Graph, ProtocolConfig, Worker
from hopnet.runtime.events import JsonlEventLog
from hopnet.transports.inproc import InprocNetwork

run_dir, mode = Path(sys.argv[1]), sys.argv[2]
graph = Graph.ring(2)
network = InprocNetwork()
barrier = threading.Barrier(2)
workers: dict[int, Worker] = {}


async def exchange(address: str) -> dict[int, str]:
    await asyncio.to_thread(barrier.wait)
    return {r: f"inproc://{r}" for r in range(2)}


def train(rank: int) -> None:
    worker = Worker(rank=rank, graph=graph, config=ProtocolConfig(timeout_s=30), params=torch.zeros(4),
                    transport=network.transport(rank, frozenset(graph.peers(rank))), exchange=exchange,
                    events=JsonlEventLog(run_dir / f"rank{rank}.jsonl"))
    for _ in worker.iterations(5):
        worker.step()
    workers[rank] = worker  # kept open on purpose


threads = [threading.Thread(target=train, args=(r,)) for r in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert len(workers) == 2
if mode == "raise":
    raise RuntimeError("the trainer broke after training")

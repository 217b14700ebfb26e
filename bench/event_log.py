"""Cost of the event log on the hot path: a step with its timed iteration record vs. a step
that logs nothing.

    python bench/event_log.py [--steps 3000] [--repeat 5] [--dim 1000]

Two AsyncWorkers on one asyncio loop over the in-process transport, no compute, so a step
is nothing but the protocol (receive, mix, send) and, when logging, the timings and the
JSON line. Modes alternate within one process: ``quiet`` (``EventLog(keep=False)``:
``Node.run_step`` takes its untimed path and writes nothing) and ``logged``
(``JsonlEventLog``: every step timed, an ``enter`` and an ``iteration`` record written,
flushed every 0.5 s). Prints microseconds per step (median over repeats) and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from hopnet import AsyncWorker, Graph, ProtocolConfig  # noqa: E402
from hopnet.runtime.events import EventLog, JsonlEventLog  # noqa: E402
from hopnet.transports.inproc import InprocNetwork  # noqa: E402


async def run_once(steps: int, dim: int, logged: bool, directory: Path) -> float:
    graph = Graph.ring(2)
    network = InprocNetwork()
    config = ProtocolConfig(timeout_s=60)
    barrier = asyncio.Barrier(2)

    async def exchange(address: str) -> dict[int, str]:
        await barrier.wait()
        return {r: f"inproc://{r}" for r in range(2)}

    logs = [JsonlEventLog(directory / f"rank{r}.jsonl") if logged else EventLog(keep=False) for r in range(2)]
    workers = await asyncio.gather(*(
        AsyncWorker.start(rank=r, graph=graph, config=config, params=torch.zeros(dim),
                          transport=network.transport(r, frozenset(graph.peers(r))), exchange=exchange,
                          events=logs[r]) for r in range(2)))

    async def train(worker: AsyncWorker) -> None:
        for k in range(steps):
            await worker.step(last=k == steps - 1)

    began = time.perf_counter()
    await asyncio.gather(*(train(w) for w in workers))
    elapsed = time.perf_counter() - began
    await asyncio.gather(*(w.close() for w in workers))
    return elapsed / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dim", type=int, default=1000)
    args = parser.parse_args()
    results: dict[str, list[float]] = {"quiet": [], "logged": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            for mode in ("quiet", "logged"):
                directory = Path(tmp) / f"{mode}{i}"
                directory.mkdir()
                results[mode].append(asyncio.run(run_once(args.steps, args.dim, mode == "logged", directory)))
    quiet, logged = statistics.median(results["quiet"]), statistics.median(results["logged"])
    print(f"steps {args.steps} x {args.repeat}, dim {args.dim} (2 workers on one loop, no compute)")
    print(f"quiet  (nothing logged)      {quiet:8.1f} us/step (min {min(results['quiet']):.1f})")
    print(f"logged (timings + records)   {logged:8.1f} us/step (min {min(results['logged']):.1f})")
    print(f"logged / quiet               {logged / quiet:8.2f}x  (+{logged - quiet:.1f} us per step, both workers)")


if __name__ == "__main__":
    main()

"""All-reduce benchmark: hopnet over torch and over ZeroMQ against torch.distributed gloo, same run.

    python bench/collectives.py [--sizes 1,16,64] [--nprocs 2,4,8] [--repeat 5] [--total-mib 256]

For each number of processes P, P worker processes are started on 127.0.0.1. The parent
hosts a torch TCPStore; the workers join a gloo process group through it and also trade
their hopnet addresses through it. Each worker runs a hopnet Node (ZmqTransport, ring
collective) on an event-loop thread, as a trainer does; ``TorchCollective`` (hopnet over
torch.distributed, its groups built from the same store) runs on that loop too, and is
also timed through ``allreduce_blocking`` (issued and waited for in the main thread, as
``hopnet.Worker.allreduce`` does); gloo's ``all_reduce`` is called directly from the main thread.

For every size the four methods take turns, ``--repeat`` times, after one untimed warm-up
each: a gloo barrier, then N back-to-back mean all-reduces of one float32 tensor (N is
about --total-mib / size, at least 3), timed on rank 0 from the barrier to the end of the
N-th (N at most --max-count). gloo's mean is ``all_reduce(SUM)`` then a division, as DDP does it. The table
shows the median time per all-reduce, the bus bandwidth (``2 (P-1)/P * bytes / time``,
what each link carries) and each hopnet collective's throughput as a ratio of gloo's.
Point to point (1 to 64 MiB, torch plane against ZeroMQ) is bench/bulk.py's job.
See docs/performance/index.md ("All-reduce against torch.distributed") for results.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hopnet.collectives.ring import DEFAULT_CHUNK_BYTES  # noqa: E402

MiB = 1 << 20
METHODS = ("gloo", "hopnet-torch", "hopnet-torch-blocking", "hopnet-ring")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def repetitions(size_bytes: int, total_mib: float, max_count: int) -> int:
    return max(3, min(max_count, int(total_mib * MiB // size_bytes)))


def worker(rank: int, world: int, port: int, sizes: list[int], repeat: int, total_mib: float,
           max_count: int, chunk_bytes: int, results: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from hopnet.collectives.ring import RingCollective
    from hopnet.collectives.torchdist import TorchCollective
    from hopnet.config import ProtocolConfig
    from hopnet.graph import Graph
    from hopnet.protocols import make_protocol
    from hopnet.runtime.clock import Clock
    from hopnet.runtime.loop_thread import EventLoopThread
    from hopnet.runtime.node import Node
    from hopnet.transports.zmq import ZmqTransport

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=rank, world_size=world)

    graph = Graph.ring(world)
    config = ProtocolConfig(protocol="allreduce", timeout_s=120)
    transport = ZmqTransport(rank, frozenset(graph.peers(rank)))
    node = Node(rank, graph, transport, make_protocol(config, None), clock=Clock(config.timeout_s),
                collective_factory=lambda n: RingCollective(n, chunk_bytes=chunk_bytes))

    async def exchange(address: str) -> dict[int, str]:
        store.set(f"hopnet/{rank}", address)
        return {r: store.get(f"hopnet/{r}").decode() for r in range(world)}

    thread = EventLoopThread(name=f"bench-rank{rank}")
    thread.run(node.open(exchange))
    everyone = tuple(range(world))
    rounds = [0]

    def hopnet_allreduce(t: torch.Tensor) -> None:
        rounds[0] += 1
        thread.run(node.collective.allreduce(everyone, t, "mean", tag=f"b/{rounds[0]}"))

    torch_collective = TorchCollective(rank, world, store, timeout_s=120)

    def hopnet_torch_allreduce(t: torch.Tensor) -> None:
        rounds[0] += 1
        thread.run(torch_collective.allreduce(everyone, t, "mean", tag=f"t/{rounds[0]}"))

    def hopnet_torch_blocking(t: torch.Tensor) -> None:
        # What hopnet.Worker.allreduce does: the calling thread's fast path once the group is cached.
        rounds[0] += 1
        tag = f"t/{rounds[0]}"
        if torch_collective.allreduce_blocking(everyone, t, "mean", tag=tag) is None:
            thread.run(torch_collective.allreduce(everyone, t, "mean", tag=tag))

    def gloo_allreduce(t: torch.Tensor) -> None:
        dist.all_reduce(t)
        t.div_(world)

    run = {"gloo": gloo_allreduce, "hopnet-torch": hopnet_torch_allreduce,
           "hopnet-torch-blocking": hopnet_torch_blocking, "hopnet-ring": hopnet_allreduce}
    try:
        for size in sizes:
            tensor = torch.randn(size // 4, generator=torch.Generator().manual_seed(rank))
            count = repetitions(size, total_mib, max_count)
            times: dict[str, list[float]] = {m: [] for m in METHODS}
            for method in METHODS:  # warm-up: connections, buffers
                run[method](tensor)
            for i in range(repeat):
                for method in METHODS[i % len(METHODS):] + METHODS[:i % len(METHODS)]:  # no method always first
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(count):
                        run[method](tensor)
                    times[method].append((time.perf_counter() - start) / count)
            # Agree on the slowest rank's time (an all-reduce ends when its last member is done).
            for method in METHODS:
                slowest = torch.tensor(times[method], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                times[method] = slowest.tolist()
            if rank == 0:
                results.put({"world": world, "size": size, "count": count, "times": times})
        dist.barrier()
    finally:
        thread.run(torch_collective.close())
        thread.run(node.close(leave=False))
        thread.stop()
        dist.destroy_process_group()


def run_world(world: int, sizes: list[int], repeat: int, total_mib: float, max_count: int,
              chunk_bytes: int) -> list[dict]:
    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, sizes, repeat, total_mib, max_count,
                                                    chunk_bytes, results))
             for r in range(world)]
    for p in procs:
        p.start()
    rows = []
    printed = False
    try:
        for _ in sizes:
            rows.append(results.get(timeout=1800))
            print(table(rows[-1:], header=not printed), flush=True)
            printed = True
        for p in procs:
            p.join(timeout=120)
        failed = [p.exitcode for p in procs if p.exitcode != 0]
        if failed:
            raise SystemExit(f"a worker failed (exit codes {failed})")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        del store
    return rows


def fmt_size(size: int) -> str:
    return f"{size // 1024} KiB" if size < MiB else f"{size // MiB} MiB"


def table(rows: list[dict], header: bool = True) -> str:
    lines = ["| P | size | N | gloo ms | hopnet torch ms | torch blocking ms | hopnet ring ms | gloo bus GB/s | "
             "torch / gloo | blocking / gloo | ring / gloo | ring / torch |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"] if header else []
    for row in rows:
        world, size = row["world"], row["size"]
        med = {m: statistics.median(row["times"][m]) for m in METHODS}
        bus = {m: 2 * (world - 1) / world * size / med[m] / 1e9 for m in METHODS}
        lines.append(f"| {world} | {fmt_size(size)} | {row['count']} | {med['gloo'] * 1e3:.3f} | "
                     f"{med['hopnet-torch'] * 1e3:.3f} | {med['hopnet-torch-blocking'] * 1e3:.3f} | "
                     f"{med['hopnet-ring'] * 1e3:.3f} | {bus['gloo']:.2f} | "
                     f"{med['gloo'] / med['hopnet-torch']:.3f}x | {med['gloo'] / med['hopnet-torch-blocking']:.3f}x | "
                     f"{med['gloo'] / med['hopnet-ring']:.2f}x | {med['hopnet-torch'] / med['hopnet-ring']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,16,64", help="tensor sizes in MiB (default: 1,16,64)")
    parser.add_argument("--nprocs", default="2,4,8", help="numbers of processes (default: 2,4,8)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--total-mib", type=float, default=256, help="about this much data per timed block")
    parser.add_argument("--max-count", type=int, default=200, help="at most this many all-reduces per timed block")
    parser.add_argument("--chunk-kib", type=int, default=DEFAULT_CHUNK_BYTES // 1024,
                        help=f"the ring's chunk size (default: {DEFAULT_CHUNK_BYTES // 1024})")
    parser.add_argument("--json", default=None, help="also write the raw times to this file")
    args = parser.parse_args()
    sizes = [int(float(s) * MiB) for s in args.sizes.split(",")]
    rows: list[dict] = []
    for world in (int(w) for w in args.nprocs.split(",")):
        rows.extend(run_world(world, sizes, args.repeat, args.total_mib, args.max_count,
                              args.chunk_kib * 1024))
    print("\nall rows:\n" + table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Bulk-plane benchmark: update tensors over ZeroMQ against torch.distributed p2p.

    python bench/bulk.py [--sizes 0.0625,0.25,1,4,16,64] [--repeat 5] [--device cpu|cuda]

Two processes (multiprocessing spawn) on 127.0.0.1 and a c10d store hosted by the
parent, as `hopnet launch` does. Side by side in the same run, for each message size:

- ``zmq``: :class:`~hopnet.transports.zmq.ZmqTransport` (CPU only);
- ``torch``: :class:`~hopnet.transports.torchdist.TorchBulkTransport` (header over
  ZeroMQ, tensor over the pair's gloo / NCCL process group);
- ``raw``: ``send`` / ``recv`` on a pair process group called directly (the floor the
  torch plane is measured against).

One-way throughput: the sender sends N messages of one float32 tensor back to back
(each ``send`` returns when the tensor may be reused), the receiver receives each into
the same preallocated tensor and after the N-th acknowledges over ZeroMQ (raw: a
1-element recv). N is about --total-mib / size (at least 4). Every configuration runs
--repeat times, interleaved, after one untimed warm-up; the table shows the median.

``--allreduce`` adds :class:`~hopnet.collectives.torchdist.TorchCollective` against
``ProcessGroup.allreduce`` called directly on the same backend (2 ranks).
See docs/performance/index.md ("The bulk plane: gloo against ZeroMQ") for results.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MiB = 1 << 20


class _Sink:
    """Receiver: lands every tensor in one preallocated slot, counts, signals after the N-th."""

    def __init__(self) -> None:
        self.slot = None
        self.expect = 0
        self.count = 0
        self.done: asyncio.Future | None = None

    def buffers_for(self, header):
        return [self.slot]

    def deliver(self, msg) -> None:
        if msg.tensors:
            self.count += 1
            if self.count == self.expect and self.done is not None and not self.done.done():
                self.done.set_result(None)
        elif self.done is not None and not self.done.done():
            self.done.set_result(msg)


def worker(role: int, conn, args: argparse.Namespace, store_endpoint: str) -> None:
    try:
        asyncio.run(_worker(role, conn, args, store_endpoint))
    except BaseException as exc:
        import traceback
        conn.send(("error", f"rank {role}: {exc!r}\n{traceback.format_exc()}"))
        raise


async def _worker(role: int, conn, args: argparse.Namespace, store_endpoint: str) -> None:
    import torch
    import torch.distributed as dist

    from hopnet.launch.store import connect_store
    from hopnet.transports.torchdist import TorchBulkTransport, backend_for, build_group, wait_work
    from hopnet.wire import Message
    from hopnet.transports.zmq import ZmqTransport

    torch.set_num_threads(1)
    device = torch.device(args.device if args.device == "cpu" else f"cuda:{role % torch.cuda.device_count()}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    peer = 1 - role
    loop = asyncio.get_running_loop()
    store = connect_store(store_endpoint, 60)

    def exchange(value):
        conn.send(("addr", value))
        return conn.recv()

    def barrier() -> None:
        conn.send(("sync", role))
        assert conn.recv() == "go"

    planes = {}
    sinks = {}
    for name in (["zmq"] if device.type == "cpu" else []) + ["torch"]:
        control = ZmqTransport(role, frozenset({peer}))
        transport = control if name == "zmq" else TorchBulkTransport(control, store, device=device,
                                                                     timeout_s=300)
        sinks[name] = _Sink()
        address = await transport.start(sinks[name])
        await transport.connect({peer: exchange(address)})
        planes[name] = transport
    backend = backend_for(device)
    raw = await loop.run_in_executor(None, lambda: build_group(
        dist.PrefixStore("bench/raw", store), backend, role, 2, timeout_s=300))

    async def hopnet_bulk(name: str, payload, n: int) -> float | None:
        transport, sink = planes[name], sinks[name]
        sink.done = loop.create_future()
        if role == 0:
            msg = Message("update", 0, 1, 0, tensors=[payload])
            barrier()
            t0 = time.perf_counter()
            for i in range(n):
                msg.iter = i
                await transport.send(msg)
            await sink.done
            return time.perf_counter() - t0
        sink.slot, sink.expect, sink.count = payload, n, 0
        barrier()
        await sink.done
        await transport.send(Message("ack", 1, 0, 0))
        return None

    def raw_bulk(payload, n: int) -> float | None:
        ack = torch.zeros(1, device=device)
        other = 1 if role == 0 else 0
        barrier()
        t0 = time.perf_counter()
        if role == 0:
            for _ in range(n):
                wait_work(raw.send([payload], other, 0), device, 300)
            wait_work(raw.recv([ack], other, 1), device, 300)
            return time.perf_counter() - t0
        for _ in range(n):
            wait_work(raw.recv([payload], other, 0), device, 300)
        wait_work(raw.send([ack], other, 1), device, 300)
        return None

    results: dict = {}
    for size in args.sizes:
        numel = int(size * MiB) // 4
        n = max(4, int(args.total_mib / size))
        payload = torch.ones(numel, device=device)
        for rnd in range(args.repeat + 1):
            for method in list(planes) + ["raw"]:
                if method == "raw":
                    dt = await loop.run_in_executor(None, raw_bulk, payload, n)
                else:
                    dt = await hopnet_bulk(method, payload, n)
                if dt is not None and rnd > 0:
                    results.setdefault((method, size), []).append(n * numel * 4 / dt / 1e9)

    if args.allreduce:
        from hopnet.collectives.torchdist import TorchCollective

        coll = TorchCollective(role, 2, store, timeout_s=300, backend=backend)
        for size in args.sizes:
            numel = int(size * MiB) // 4
            n = max(4, int(args.total_mib / size) // 4)
            x = torch.ones(numel, device=device)
            for rnd in range(args.repeat + 1):
                barrier()
                t0 = time.perf_counter()
                for i in range(n):
                    await coll.allreduce((0, 1), x, "sum", tag=f"b/{size}/{rnd}/{i}")
                dt_h = time.perf_counter() - t0
                barrier()
                t0 = time.perf_counter()
                for _ in range(n):
                    wait_work(raw.allreduce([x]), device, 300)
                dt_r = time.perf_counter() - t0
                if rnd > 0 and role == 0:
                    results.setdefault(("allreduce-hopnet", size), []).append(n * numel * 4 / dt_h / 1e9)
                    results.setdefault(("allreduce-raw", size), []).append(n * numel * 4 / dt_r / 1e9)
        await coll.close()

    for transport in planes.values():
        await transport.close()
    conn.send(("result", results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="0.0625,0.25,1,4,16,64",
                        type=lambda s: [float(x) for x in s.split(",")], help="MiB, comma separated")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--total-mib", type=float, default=256.0)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--allreduce", action="store_true", help="also TorchCollective vs allreduce")
    args = parser.parse_args()

    from hopnet.launch.store import host_store

    hosted = host_store("127.0.0.1")
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=worker, args=(r, pipes[r][1], args, hosted.endpoint)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    try:
        live = {0, 1}
        while live:
            msgs = {}
            for r in sorted(live):
                if not pipes[r][0].poll(600):
                    raise SystemExit(f"rank {r} silent for 600 s")
                msgs[r] = pipes[r][0].recv()
            kinds = {m[0] for m in msgs.values()}
            if "error" in kinds:
                raise SystemExit("\n".join(m[1] for m in msgs.values() if m[0] == "error"))
            if kinds == {"addr"}:
                for r in live:
                    pipes[r][0].send(msgs[1 - r][1])
            elif kinds == {"sync"}:
                for r in live:
                    pipes[r][0].send("go")
            elif kinds == {"result"}:
                results = msgs[0][1]
                live.clear()
            else:
                raise SystemExit(f"workers out of step: {msgs}")
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        hosted.close()

    methods = ["zmq", "torch", "raw"] if args.device == "cpu" else ["torch", "raw"]
    print(f"one-way throughput, GB/s (median of {args.repeat}), device {args.device}")
    print("| size | " + " | ".join(methods) + " | torch / " + ("zmq" if args.device == "cpu" else "raw") + " |")
    print("|---" * (len(methods) + 2) + "|")
    for size in args.sizes:
        med = {m: statistics.median(results[(m, size)]) for m in methods}
        ref = med["zmq"] if args.device == "cpu" else med["raw"]
        label = f"{size * 1024:g} KiB" if size < 1 else f"{size:g} MiB"
        print(f"| {label} | " + " | ".join(f"{med[m]:.2f}" for m in methods) + f" | {med['torch'] / ref:.2f}x |")
    if args.allreduce:
        print("\nall-reduce (2 ranks), algorithm GB/s: | size | hopnet TorchCollective | direct | ratio |")
        for size in args.sizes:
            h = statistics.median(results[("allreduce-hopnet", size)])
            r = statistics.median(results[("allreduce-raw", size)])
            print(f"| {size:g} MiB | {h:.2f} | {r:.2f} | {h / r:.2f}x |")


if __name__ == "__main__":
    main()

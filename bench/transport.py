"""Transport benchmark: ZmqTransport against a plain TCP socket, torch.distributed gloo and
bare zmq.asyncio, between two processes on 127.0.0.1.

    python bench/transport.py [--sizes 1,16,64] [--repeat 5] [--transport tcp|ipc] [--payload-stream on,off]

Throughput is one-way bulk: the sender sends N messages of one float32 tensor back to back
(each send returns only when the sender may reuse the tensor), the receiver receives each
into the same preallocated buffer and, after the N-th, sends a 1-byte ack; the sender's
clock runs from its first send to the ack. N is about --total-mib / size (at least 4).
Latency is the median round trip of --pings control messages, one at a time.
--payload-stream times ZmqTransport with its payload stream on, off, or both (one transport
each, interleaved). Every configuration runs --repeat times, interleaved with the others so load changes hit
all alike, after one untimed warm-up round; the table shows the median.
See docs/performance/index.md ("Transport: throughput and latency") for results.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import struct
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import multiprocessing as mp

MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def count_for(size_mib: float, total_mib: int) -> int:
    return max(4, int(total_mib / size_mib))


def methods(args: argparse.Namespace) -> list[str]:
    return [f"hopnet-{mode}" for mode in args.payload_stream] + ["socket", "gloo"]


# ------------------------------------------------------------------ worker processes


class BenchReceiver:
    """Receiver for the bench: receives into one preallocated slot, counts, signals."""

    def __init__(self) -> None:
        self.slot = None
        self.expect = 0
        self.count = 0
        self.done: asyncio.Future | None = None
        self.queue: asyncio.Queue | None = None

    def buffers_for(self, header):
        return [self.slot]

    def deliver(self, msg) -> None:
        if msg.tensors:
            self.count += 1
            if self.count == self.expect and self.done is not None and not self.done.done():
                self.done.set_result(None)
        elif self.queue is not None:
            self.queue.put_nowait(msg)
        elif self.done is not None and not self.done.done():
            self.done.set_result(msg)


def worker(role: int, conn, args: argparse.Namespace, ports: dict) -> None:
    try:
        if args.loop == "uvloop":
            import uvloop
            runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
        else:
            runner = asyncio.Runner()
        with runner:
            runner.run(_worker(role, conn, args, ports))
    except BaseException as exc:  # report to the parent instead of hanging it
        import traceback
        conn.send(("error", f"rank {role}: {exc!r}\n{traceback.format_exc()}"))
        raise


async def _worker(role: int, conn, args: argparse.Namespace, ports: dict) -> None:
    import torch
    import torch.distributed as dist
    import zmq
    import zmq.asyncio

    import hopnet.transports.zmq.limits as zmq_limits
    from hopnet.transports.zmq import ZmqTransport
    from hopnet.wire import Message

    torch.set_num_threads(1)
    if args.chunk_mib:
        zmq_limits.CHUNK_BYTES = int(args.chunk_mib * MiB)
    if args.stage_mib is not None:
        zmq_limits.STAGE_BYTES = int(args.stage_mib * MiB)
    if args.stream_min_kib is not None:
        import hopnet.transports.payload_stream as ps
        ps.MIN_BYTES = int(args.stream_min_kib * 1024)
    if args.stream_spin_ms is not None:
        import hopnet.transports.payload_stream as ps
        ps.SPIN_S = args.stream_spin_ms / 1000
    if args.no_tune_malloc:
        os.environ["HOPNET_TUNE_MALLOC"] = "0"
    peer = 1 - role
    loop = asyncio.get_running_loop()

    def barrier() -> None:
        conn.send(("sync", role))
        assert conn.recv() == "go"

    def exchange(value):
        """Send a setup value to the peer (through the parent) and get the peer's."""
        conn.send(("addr", value))
        return conn.recv()

    # hopnet transport, both ways (the ack and the pong travel back over it)
    if args.transport == "tcp":
        bind = "tcp://127.0.0.1:*"
    else:
        bind = f"ipc://{args.ipc_dir}/hopnet-bench-{role}.sock"
    recs: dict[str, BenchReceiver] = {}
    trs: dict[str, ZmqTransport] = {}
    for mode in args.payload_stream:
        recs[mode] = BenchReceiver()
        trs[mode] = ZmqTransport(role, frozenset({peer}), bind=bind.replace(".sock", f"-{mode}.sock"),
                                 payload_stream=mode == "on")
        await trs[mode].connect({peer: exchange(await trs[mode].start(recs[mode]))})

    # bare zmq.asyncio ROUTER (role 1) / DEALER (role 0), same address family
    ctx = zmq.asyncio.Context()
    if role == 1:
        bare = ctx.socket(zmq.ROUTER)
        bare.bind("tcp://127.0.0.1:*" if args.transport == "tcp" else f"ipc://{args.ipc_dir}/bare-bench.sock")
        exchange(bare.getsockopt_string(zmq.LAST_ENDPOINT))
    else:
        bare = ctx.socket(zmq.DEALER)
        bare.connect(exchange(None))
    bare.setsockopt(zmq.LINGER, 0)

    # plain TCP socket
    if role == 1:
        lsock = socket.create_server(("127.0.0.1", ports["socket"]))
        exchange(None)
        sock, _ = lsock.accept()
        lsock.close()
    else:
        exchange(None)
        sock = socket.create_connection(("127.0.0.1", ports["socket"]))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    # gloo
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports['gloo']}", rank=role, world_size=2)

    results: dict = {}
    barrier()

    async def bulk_hopnet(mode: str, payload, n: int) -> float | None:
        tr, rec = trs[mode], recs[mode]
        if role == 0:
            rec.done = loop.create_future()
            msg = Message("update", 0, 1, 0, tensors=[payload])
            barrier()
            t0 = time.perf_counter()
            for i in range(n):
                msg.iter = i
                await tr.send(msg)
            await rec.done
            return time.perf_counter() - t0
        rec.slot, rec.expect, rec.count = payload, n, 0
        rec.done = loop.create_future()
        barrier()
        await rec.done
        await tr.send(Message("ack", 1, 0, 0))
        return None

    def bulk_socket(payload, n: int) -> float | None:
        nbytes = payload.numel() * payload.element_size()
        view = memoryview(payload.numpy()).cast("B")
        if role == 0:
            prefix = struct.pack("<Q", nbytes)
            barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                sock.sendall(prefix)
                sock.sendall(view)
            assert sock.recv(1) == b"k"
            return time.perf_counter() - t0
        prefix = bytearray(8)
        barrier()
        for _ in range(n):
            _recv_into(sock, memoryview(prefix))
            assert struct.unpack("<Q", prefix)[0] == nbytes
            _recv_into(sock, view)
        sock.sendall(b"k")
        return None

    def bulk_gloo(payload, n: int) -> float | None:
        ack = torch.zeros(1)
        if role == 0:
            barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                dist.send(payload, dst=1)
            dist.recv(ack, src=1)
            return time.perf_counter() - t0
        barrier()
        for _ in range(n):
            dist.recv(payload, src=0)
        dist.send(ack, dst=0)
        return None

    async def rtt_hopnet(mode: str, pings: int) -> list[float] | None:
        tr, rec = trs[mode], recs[mode]
        if role == 0:
            out = []
            barrier()
            for i in range(pings):
                rec.done = loop.create_future()
                t0 = time.perf_counter()
                await tr.send(Message("token", 0, 1, i))
                await rec.done
                out.append(time.perf_counter() - t0)
            rec.done = None
            return out
        rec.queue = asyncio.Queue()
        barrier()
        for _ in range(pings):
            m = await rec.queue.get()
            await tr.send(Message("token", 1, 0, m.iter))
        rec.queue = None
        return None

    async def rtt_bare(_mode: str, pings: int) -> list[float] | None:
        if role == 0:
            out = []
            barrier()
            for i in range(pings):
                t0 = time.perf_counter()
                await bare.send(b"ping")
                await bare.recv()
                out.append(time.perf_counter() - t0)
            return out
        barrier()
        for _ in range(pings):
            m = await bare.recv_multipart()
            await bare.send_multipart(m)
        return None

    sizes = [float(s) for s in args.sizes.split(",")]
    payloads = {s: torch.ones(int(s * MiB) // 4) for s in sizes}
    for rnd in range(args.repeat + 1):  # round 0 warms up and is not recorded
        for s in sizes if args.only != "rtt" else ():
            n = count_for(s, args.total_mib) if rnd else 2
            for method in methods(args):
                cpu0 = time.process_time()
                if method.startswith("hopnet"):
                    dt = await bulk_hopnet(method.split("-")[1], payloads[s], n)
                elif method == "socket":
                    dt = bulk_socket(payloads[s], n)
                else:
                    dt = bulk_gloo(payloads[s], n)
                if rnd:  # CPU time of this process, all its threads, per MiB moved
                    results.setdefault(("cpu", s, method), []).append((time.process_time() - cpu0) * 1e6 / (n * s))
                if dt is not None and rnd:
                    results.setdefault(("GB/s", s, method), []).append(n * s * MiB / dt / 1e9)
        pings = args.pings if rnd else 200
        rtts = [(f"hopnet-{mode}", mode, rtt_hopnet) for mode in args.payload_stream] + [("bare-zmq", "", rtt_bare)]
        for method, mode, fn in rtts if args.only != "bulk" else ():
            lat = await fn(mode, pings)
            if lat is not None and rnd:
                results.setdefault(("rtt", 0, method), []).append(statistics.median(lat) * 1e6)

    barrier()
    results["stats"] = {mode: tr.stats.as_dict() for mode, tr in trs.items()}
    conn.send(("results", results))
    for tr in trs.values():
        await tr.close()
    bare.close(0)
    ctx.term()
    sock.close()
    dist.destroy_process_group()


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if not r:
            raise ConnectionError("peer closed")
        got += r


# ------------------------------------------------------------------ parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,16,64", help="tensor sizes in MiB (default 1,16,64)")
    p.add_argument("--repeat", type=int, default=5, help="timed rounds; the median is shown (default 5)")
    p.add_argument("--transport", choices=("tcp", "ipc"), default="tcp",
                   help="address family of the zmq sockets (the plain socket and gloo are always tcp)")
    p.add_argument("--total-mib", type=int, default=512, help="bytes per throughput trial (default 512 MiB)")
    p.add_argument("--pings", type=int, default=2000, help="round trips per latency trial (default 2000)")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio", help="event loop (default asyncio)")
    p.add_argument("--only", choices=("bulk", "rtt"), default=None, help="run one half of the benchmark")
    p.add_argument("--chunk-mib", type=float, default=0,
                   help="override hopnet's chunk size (MiB) in both processes, for tuning")
    p.add_argument("--stage-mib", type=float, default=None,
                   help="override hopnet's staging limit (MiB; 0 = always zero-copy), for tuning")
    p.add_argument("--stream-min-kib", type=float, default=None,
                   help="override the smallest message sent over the payload stream (KiB), for tuning")
    p.add_argument("--stream-spin-ms", type=float, default=None,
                   help="override how long the stream's reader waits for more of a message before yielding (ms)")
    p.add_argument("--no-tune-malloc", action="store_true", help="leave glibc malloc at its defaults")
    p.add_argument("--payload-stream", default="on",
                   help="ZmqTransport's payload stream: on, off, or on,off to time both (default on)")
    args = p.parse_args(argv)
    args.payload_stream = [m.strip() for m in args.payload_stream.split(",")]
    if not args.payload_stream or any(m not in ("on", "off") for m in args.payload_stream):
        p.error("--payload-stream takes on, off or on,off")
    args.ipc_dir = f"/tmp/hopnet-bench-{os.getpid()}"
    if args.transport == "ipc":
        os.makedirs(args.ipc_dir, exist_ok=True)

    ports = {"socket": free_port(), "gloo": free_port()}
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for role in (0, 1):
        parent_end, child_end = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(role, child_end, args, ports), daemon=True)
        proc.start()
        conns.append(parent_end)
        procs.append(proc)

    # Relay the setup exchanges (each hopnet transport, bare zmq, socket), then the barriers.
    for _ in range(len(args.payload_stream) + 2):
        (k0, a0), (k1, a1) = _get(conns[0]), _get(conns[1])
        assert (k0, k1) == ("addr", "addr"), (k0, k1)
        conns[0].send(a1)
        conns[1].send(a0)
    while True:
        k0, v0 = _get(conns[0])
        if k0 == "results":
            results = v0
            _, receiver = _get(conns[1])
            for key, values in receiver.items():
                if key[0] == "cpu":  # both sides' CPU time, round by round
                    results[key] = [a + b for a, b in zip(results[key], values)]
            break
        k1, _ = _get(conns[1])
        assert (k0, k1) == ("sync", "sync"), (k0, k1)
        conns[0].send("go")
        conns[1].send("go")
    for proc in procs:
        proc.join(30)
    if args.transport == "ipc":
        shutil.rmtree(args.ipc_dir, ignore_errors=True)
    _print_table(results, args)
    return 0


def _get(conn):
    kind, value = conn.recv()
    if kind == "error":
        raise RuntimeError(value)
    return kind, value


def _print_table(results: dict, args: argparse.Namespace) -> None:
    med = {k: statistics.median(v) for k, v in results.items() if isinstance(k, tuple)}
    print(f"hopnet transport benchmark: {args.transport}, {args.loop} loop, {os.cpu_count()} cpus, "
          f"median of {args.repeat} rounds, {args.total_mib} MiB per throughput trial")
    print()
    modes = args.payload_stream
    hop = " | ".join(f"hopnet stream {m}" for m in modes)
    ratio = " | ".join(f"stream {m} / socket" for m in modes)
    print(f"| one-way throughput | {hop} | plain TCP socket | gloo send/recv | {ratio} |")
    print("|---|" + "---|" * (2 * len(modes) + 2))
    for s in [float(x) for x in args.sizes.split(",")] if args.only != "rtt" else ():
        hs = [med[("GB/s", s, f"hopnet-{m}")] for m in modes]
        so, g = med[("GB/s", s, "socket")], med[("GB/s", s, "gloo")]
        print(f"| {s:g} MiB float32 | " + " | ".join(f"{h:.2f} GB/s" for h in hs)
              + f" | {so:.2f} GB/s | {g:.2f} GB/s | " + " | ".join(f"{h / so:.2f}x" for h in hs) + " |")
    if args.only != "rtt":
        print()
        print("CPU time per MiB moved, sender + receiver (all threads; less sensitive to load than throughput):")
        print("| size | " + " | ".join(methods(args)) + " |")
        print("|---|" + "---|" * len(methods(args)))
        for s in [float(x) for x in args.sizes.split(",")]:
            print(f"| {s:g} MiB | " + " | ".join(f"{med[('cpu', s, m)]:.0f} µs" for m in methods(args)) + " |")
    if args.only == "bulk":
        b = 0.0
    else:
        print()
        b = med.get(("rtt", 0, "bare-zmq"), 1)
    if b:
        hs = [med.get(("rtt", 0, f"hopnet-{m}"), 0) for m in modes]
        ratio = " | ".join(f"stream {m} / bare" for m in modes)
        print(f"| control round trip (median) | {hop} | bare zmq.asyncio | {ratio} |")
        print("|---|" + "---|" * (2 * len(modes) + 1))
        print(f"| {args.pings} pings | " + " | ".join(f"{h:.0f} µs" for h in hs) + f" | {b:.0f} µs | "
              + " | ".join(f"{h / b:.2f}x" for h in hs) + " |")
    spread = {k: (min(v), max(v)) for k, v in results.items() if isinstance(k, tuple) and k[0] != "cpu"}
    print()
    print("spread over rounds (min..max): " + ", ".join(
        f"{k[2]}@{k[1] or 'rtt'}: {lo:.2f}..{hi:.2f}" for k, (lo, hi) in sorted(spread.items(), key=str)))
    for mode, stats in results["stats"].items():
        if stats["dropped"]:
            print(f"hopnet (stream {mode}) drops:", stats["dropped"])


if __name__ == "__main__":
    sys.exit(main())

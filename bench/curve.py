"""What CurveZMQ costs hopnet's transport: plain against CURVE, in one run, interleaved.

    python bench/curve.py [--sizes-kib 64,1024,16384] [--total-mib 256] [--repeat 3] [--pings 1000]

Two ZmqTransports (ranks 0 and 1) in one process on 127.0.0.1, once with plain sockets
and once with the run's CURVE keys; the two configurations alternate round by round so
load changes hit both alike. Throughput: rank 0 sends messages of one uint8 tensor back to
back until --total-mib have arrived at rank 1. Latency: the median round trip of a control
message (rank 0 -> 1 -> 0). The table shows the medians and CURVE / plain. libzmq encrypts
in its I/O threads, so the numbers include that work whichever core it lands on.
See docs/performance/index.md ("Encryption (CurveZMQ)").
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from hopnet.security import CurveKeys
from hopnet.transports.zmq import ZmqTransport
from hopnet.wire import Message


class _Sink:
    def __init__(self) -> None:
        self.count = 0
        self.target = 0
        self.done: asyncio.Future | None = None
        self.on_message = None

    def buffers_for(self, header):  # noqa: ANN001, ANN201 - the Receiver protocol
        return None

    def deliver(self, msg: Message) -> None:
        if self.on_message is not None:
            self.on_message(msg)
            return
        self.count += 1
        if self.count >= self.target and self.done is not None and not self.done.done():
            self.done.set_result(None)


async def _pair(keys: CurveKeys | None) -> tuple[ZmqTransport, ZmqTransport, _Sink, _Sink]:
    sink0, sink1 = _Sink(), _Sink()
    a = ZmqTransport(0, frozenset({1}), curve=keys, send_timeout=120)
    b = ZmqTransport(1, frozenset({0}), curve=keys, send_timeout=120)
    addr_a, addr_b = await a.start(sink0), await b.start(sink1)
    await a.connect({1: addr_b})
    await b.connect({0: addr_a})
    return a, b, sink0, sink1


async def _throughput(a: ZmqTransport, sink: _Sink, size: int, count: int) -> float:
    payload = torch.zeros(size, dtype=torch.uint8)
    loop = asyncio.get_running_loop()
    sink.count, sink.target, sink.done = 0, count, loop.create_future()
    start = time.perf_counter()
    for i in range(count):
        await a.send(Message("update", 0, 1, i, tensors=[payload]))
    await asyncio.wait_for(sink.done, 300)
    return size * count / (time.perf_counter() - start) / (1 << 20)


async def _latency(a: ZmqTransport, b: ZmqTransport, sink0: _Sink, sink1: _Sink, pings: int) -> float:
    loop = asyncio.get_running_loop()
    box: dict[str, asyncio.Future] = {}

    def echo(msg: Message) -> None:
        loop.create_task(b.send(Message("ack", 1, 0, msg.iter)))

    def back(msg: Message) -> None:
        box["f"].set_result(None)

    sink1.on_message, sink0.on_message = echo, back
    times = []
    for i in range(pings):
        box["f"] = loop.create_future()
        start = time.perf_counter()
        await a.send(Message("token", 0, 1, i))
        await asyncio.wait_for(box["f"], 30)
        times.append(time.perf_counter() - start)
    sink1.on_message = sink0.on_message = None
    return statistics.median(times) * 1e6


async def _main(args: argparse.Namespace) -> None:
    sizes = [int(s) << 10 for s in args.sizes_kib.split(",")]
    keys = CurveKeys.generate()
    configs = {"plain": None, "curve": keys}
    pairs = {name: await _pair(k) for name, k in configs.items()}
    results: dict[tuple[str, object], list[float]] = {}
    try:
        for name, (a, b, s0, s1) in pairs.items():  # warm-up: connections made, buffers touched
            await _throughput(a, s1, sizes[0], 8)
            await _latency(a, b, s0, s1, 20)
        for _ in range(args.repeat):
            for name, (a, b, s0, s1) in pairs.items():
                for size in sizes:
                    count = max(8, (args.total_mib << 20) // size)
                    results.setdefault((name, size), []).append(await _throughput(a, s1, size, count))
                results.setdefault((name, "rtt"), []).append(await _latency(a, b, s0, s1, args.pings))
    finally:
        for a, b, _, _ in pairs.values():
            await a.close()
            await b.close()
    print("| message | plain | CURVE | CURVE / plain |")
    print("| --- | ---: | ---: | ---: |")
    for size in sizes:
        p, c = (statistics.median(results[(n, size)]) for n in ("plain", "curve"))
        print(f"| {size >> 10} KiB, MiB/s | {p:.0f} | {c:.0f} | {c / p:.2f} |")
    p, c = (statistics.median(results[(n, "rtt")]) for n in ("plain", "curve"))
    print(f"| control round trip, us | {p:.0f} | {c:.0f} | {c / p:.2f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-kib", default="64,1024,16384")
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pings", type=int, default=1000)
    asyncio.run(_main(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

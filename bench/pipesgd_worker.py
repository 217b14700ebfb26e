"""One worker of bench/pipesgd.py: sleep-emulated compute, a real gradient of --model-mb MB.

Each iteration sleeps ``--compute-ms`` (the "forward and backward"), fills the flat
gradient with fresh values, and steps the protocol (plain SGD). At the end it prints one
JSON line: rank, seconds per iteration over the iterations after ``--warmup``, bytes this
worker sent per iteration (the transport's counter), and where the iteration went:

* ``compute_s``: the trainer thread's time outside ``step()`` (sleep + filling the gradient);
* ``step_s``: its time inside ``step()`` (waiting for the due all-reduce, the optimizer step);
* ``trace``: per iteration (t, compute began, step() began, step() ended), and ``comm``
  (pipe-sgd): per all-reduce (t, launched, began, ended), both on the system's monotonic
  clock, so the driver lines up the ranks' timelines;
* ``cpu_s``: the process's CPU time per iteration (all threads: trainer, event loop,
  libzmq I/O), ``trainer_cpu_s`` the trainer thread's share.

``--role ddp`` (under torchrun) runs the same loop with torch DDP (gloo): the gradient of a
one-sample forward of the same ``Linear(numel, 1)`` is all-reduced inside ``backward()``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

BYTES_PER_MB = 1_000_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["hopnet", "ddp"], default="hopnet")
    parser.add_argument("--compute-ms", type=float, default=50.0)
    parser.add_argument("--model-mb", type=float, default=4.0)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--out", default=None, help="(ddp) write the JSON line to OUT/rank{R}.json instead")
    args = parser.parse_args()
    torch.set_num_threads(1)
    numel = max(1, int(args.model_mb * BYTES_PER_MB) // 4)
    model = torch.nn.Linear(numel, 1, bias=False)
    if args.role == "ddp":
        run_ddp(model, numel, args)
    else:
        run_hopnet(model, numel, args)


class Window:
    """Sums of the trainer's time split and CPU time over the measured iterations, and the
    trainer's timeline: per iteration (t, compute began, step() began, step() ended) on the
    system's monotonic clock, which the ranks of one machine share."""

    def __init__(self) -> None:
        self.compute = self.step = 0.0
        self.started = self.cpu = self.trainer_cpu = 0.0
        self.trace: list[tuple[int, float, float, float]] = []

    def add(self, t: int, began: float, computed: float, ended: float) -> None:
        self.compute += computed - began
        self.step += ended - computed
        self.trace.append((t, began, computed, ended))

    def open(self) -> None:
        self.started = time.monotonic()
        self.cpu, self.trainer_cpu = time.process_time(), time.thread_time()

    def result(self, measured: int) -> dict[str, float]:
        return {"s_per_iter": (time.monotonic() - self.started) / measured,
                "compute_s": self.compute / measured, "step_s": self.step / measured,
                "cpu_s": (time.process_time() - self.cpu) / measured,
                "trainer_cpu_s": (time.thread_time() - self.trainer_cpu) / measured, "trace": self.trace}


def run_hopnet(model: torch.nn.Module, numel: int, args: argparse.Namespace) -> None:
    import hopnet

    worker = hopnet.init(model)
    opt = hopnet.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-6), worker)
    gen = torch.Generator().manual_seed(worker.rank)
    fresh = [torch.randn(numel, generator=gen) for _ in range(4)]
    stats = worker.node.transport.stats
    protocol = worker.node.protocol
    window = Window()
    sent = 0.0
    for step in worker.iterations(args.iterations):
        if step == args.warmup:
            window.open()
            sent = stats.sent_bytes
        began = time.monotonic()
        time.sleep(args.compute_ms / 1000)
        opt.zero_grad()
        model.weight.grad.view(-1).copy_(fresh[step % len(fresh)])
        computed = time.monotonic()
        opt.step()
        if step >= args.warmup:
            window.add(step, began, computed, time.monotonic())
    # The last iteration also drains the pipeline (pipe-sgd): it counts, as in the paper's T.
    measured = args.iterations - args.warmup
    result = {"rank": worker.rank, **window.result(measured),
              "bytes_per_iter": (stats.sent_bytes - sent) / measured,
              "comm": [c for c in getattr(protocol, "comm_times", []) if c[0] >= args.warmup]}
    worker.close()
    print(json.dumps(result), flush=True)


def run_ddp(model: torch.nn.Module, numel: int, args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ddp = DistributedDataParallel(model, bucket_cap_mb=max(25.0, 2 * args.model_mb))  # one bucket
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-6)
    gen = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(1, numel, generator=gen) for _ in range(4)]
    window = Window()
    for step in range(args.iterations):
        if step == args.warmup:
            window.open()
        began = time.monotonic()
        time.sleep(args.compute_ms / 1000)
        opt.zero_grad()
        loss = ddp(inputs[step % len(inputs)]).sum()
        computed = time.monotonic()
        loss.backward()  # DDP's all-reduce of the gradient finishes inside
        opt.step()
        if step >= args.warmup:
            window.add(step, began, computed, time.monotonic())
    measured = args.iterations - args.warmup
    result = {"rank": rank, **window.result(measured), "bytes_per_iter": 0.0, "comm": []}
    dist.destroy_process_group()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()

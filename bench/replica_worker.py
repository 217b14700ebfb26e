"""The worker bench/replicas.py launches: an MLP of about ``--model-mb`` MB of float32 parameters on
random data, AdamW, under whatever `hopnet launch` set (replica groups or not).

At the end it records a ``replica_bench`` event: its peak RSS (``VmHWM``, KiB), its peak address space
(``VmPeak``, what ``ulimit -v`` caps), its RSS after the
model was built and before ``hopnet.init`` (``baseline_kb``), the bytes it sent to each lane peer
(the kernel's counters of the ``links`` record are read by the bench from the log), and its rate.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import hopnet


def status_kb(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-mb", type=float, default=20.0)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    width = int((args.model_mb * 1e6 / 4 / args.layers) ** 0.5)
    model = nn.Sequential(*(m for _ in range(args.layers) for m in (nn.Linear(width, width), nn.ReLU())))
    baseline = status_kb("VmRSS")
    worker = hopnet.init(model)
    optimizer = hopnet.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), worker)
    x = torch.randn(args.batch, width)
    began = time.monotonic()
    for _ in worker.iterations(args.iterations):
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    rate = args.iterations / (time.monotonic() - began)
    worker.consensus()
    worker.record("replica_bench", peak_kb=status_kb("VmHWM"), address_peak_kb=status_kb("VmPeak"),
                  baseline_kb=baseline, rate=round(rate, 3),
                  params=sum(p.numel() for p in model.parameters()))
    worker.close()


if __name__ == "__main__":
    main()

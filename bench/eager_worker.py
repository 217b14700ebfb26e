"""A worker for bench/eager.py: sleep-emulated compute, a real gradient buffer reduced for real.

Each iteration sleeps ``--compute-ms`` (the launcher's ``--slowdown`` stretches it, in
``Worker.step``), fills the flat gradient buffer with fresh values and steps through
the protocol the launcher chose (allreduce or eager-sgd), which reduces that buffer.
"""

from __future__ import annotations

import argparse
import time

import torch

import hopnet


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compute-ms", type=float, default=40.0)
    parser.add_argument("--numel", type=int, default=65_536, help="gradient elements (float32)")
    parser.add_argument("--iterations", type=int, default=120)
    args = parser.parse_args()
    model = torch.nn.Linear(args.numel, 1, bias=False)
    worker = hopnet.init(model)
    opt = hopnet.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), worker)
    gen = torch.Generator().manual_seed(worker.rank)
    try:
        for step in worker.iterations(args.iterations):
            time.sleep(args.compute_ms / 1000)
            opt.zero_grad()
            worker.grads.buffer.copy_(torch.randn(args.numel, generator=gen))
            opt.step()
    finally:
        worker.close()


if __name__ == "__main__":
    main()

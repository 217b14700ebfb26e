"""One worker of bench/pipesgd.py: sleep-emulated compute, a real gradient of --model-mb MB.

Each iteration sleeps ``--compute-ms`` (the "forward and backward"), fills the flat
gradient with fresh values, and steps the protocol (plain SGD). At the end it prints one
JSON line: rank, seconds per iteration over the iterations after ``--warmup``, and bytes
this worker sent per iteration (the transport's counter, headers included).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import hopnet

BYTES_PER_MB = 1_000_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compute-ms", type=float, default=50.0)
    parser.add_argument("--model-mb", type=float, default=4.0)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    numel = max(1, int(args.model_mb * BYTES_PER_MB) // 4)
    model = torch.nn.Linear(numel, 1, bias=False)
    worker = hopnet.init(model)
    opt = hopnet.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-6), worker)
    gen = torch.Generator().manual_seed(worker.rank)
    fresh = [torch.randn(numel, generator=gen) for _ in range(4)]
    stats = worker.node.transport.stats
    started = sent = 0.0
    for step in worker.iterations(args.iterations):
        if step == args.warmup:
            started, sent = time.monotonic(), stats.sent_bytes
        time.sleep(args.compute_ms / 1000)
        opt.zero_grad()
        model.weight.grad.view(-1).copy_(fresh[step % len(fresh)])
        opt.step()
    # The last iteration also drains the pipeline (pipe-sgd): it counts, as in the paper's T.
    elapsed = time.monotonic() - started
    measured = args.iterations - args.warmup
    result = {"rank": worker.rank, "s_per_iter": elapsed / measured,
              "bytes_per_iter": (stats.sent_bytes - sent) / measured}
    worker.close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

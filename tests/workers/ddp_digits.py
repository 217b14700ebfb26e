"""examples/train_digits.py's training loop under torch DistributedDataParallel (gloo).

Run on N processes by tests/support/ddp.py (``run_ddp``; torchrun runs it too), with the
same model, seeds, samples, batches and learning-rate schedule as the example, so that its
parameters can be compared with ``hopnet launch --protocol allreduce``'s. Rank 0 saves
its flat parameters to ``OUT``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from digits_data import digits_split  # noqa: E402
from support.ddp import end_now, init_gloo  # noqa: E402

from hopnet.data import ElasticSampler  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    init_gloo()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, args.hidden), torch.nn.ReLU(), torch.nn.Linear(args.hidden, 10))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    x_train, y_train, _, _ = digits_split(args.seed)
    loss_fn = torch.nn.CrossEntropyLoss()
    sampler = ElasticSampler(len(x_train), rank=rank, members=range(world), seed=args.seed)
    next_batch = sampler.batches(args.batch_size)
    for step in range(args.iterations):
        for group in optimizer.param_groups:
            group["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.iterations))
        batch = torch.tensor(next(next_batch))
        optimizer.zero_grad()
        loss_fn(ddp(x_train[batch]), y_train[batch]).backward()
        optimizer.step()
    if rank == 0:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        torch.save(flat, args.out)
    dist.barrier()
    end_now()


if __name__ == "__main__":
    main()

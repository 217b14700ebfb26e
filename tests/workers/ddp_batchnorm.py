"""tests/support/bn_task.py under torch DistributedDataParallel (gloo, buffers broadcast), launched
by tests/support/ddp.py (``run_ddp``; torchrun runs it too): ``ddp_batchnorm.py STEPS OUT``; rank 0 saves its state_dict to OUT."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.bn_task import LR, batch, cnn, set_lr, state  # noqa: E402
from support.ddp import end_now, init_gloo  # noqa: E402


def main() -> None:
    steps, out = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    init_gloo()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = cnn()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(steps):
        set_lr(optimizer, LR, step, steps)
        optimizer.zero_grad()
        x, y = batch(rank, world, step)
        loss_fn(ddp(x), y).backward()
        optimizer.step()
    if rank == 0:
        torch.save(state(model), out)
    dist.barrier()
    end_now()


if __name__ == "__main__":
    main()

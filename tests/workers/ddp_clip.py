"""tests/support/clip_task.py under torch DistributedDataParallel (gloo), clipping the averaged
gradient, launched by tests/support/ddp.py (``run_ddp``; torchrun runs it too). Rank 0 saves its flat parameters to OUT."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.clip_task import MAX_NORM, STEPS, batch, flat, make_model, make_optimizer  # noqa: E402
from support.ddp import end_now, init_gloo  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    init_gloo()
    rank = dist.get_rank()
    model = make_model()
    ddp = DistributedDataParallel(model)
    optimizer = make_optimizer(model)
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = batch(rank, step)
        loss_fn(ddp(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
    if rank == 0:
        torch.save(flat(model), sys.argv[1])
    dist.barrier()
    end_now()


if __name__ == "__main__":
    main()

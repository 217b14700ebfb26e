"""tests/support/bn_task.py under torch DistributedDataParallel (gloo) with small buckets, launched by
tests/support/ddp.py (``run_ddp``; torchrun runs it too): ``ddp_accumulate.py STEPS BUCKET_MB OUT``. Three runs from the same
model: one backward per step (``plain``), two per step (``accumulate``), two per step with the first
under ``no_sync()`` (``no_sync``); rank 0 saves ``{run: state_dict}`` to OUT."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.bn_task import LR, cnn, set_lr, state  # noqa: E402
from support.overlap_task import MICRO_BATCHES, micro_batch  # noqa: E402
from support.ddp import end_now, init_gloo  # noqa: E402


def train(run: str, steps: int, bucket_mb: float, rank: int, world: int) -> dict[str, torch.Tensor]:
    model = cnn()
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    micro = 1 if run == "plain" else MICRO_BATCHES
    for step in range(steps):
        set_lr(optimizer, LR, step, steps)
        optimizer.zero_grad()
        for m in range(micro):
            x, y = micro_batch(rank, world, step, m)
            if run == "no_sync" and m < micro - 1:
                with ddp.no_sync():
                    (loss_fn(ddp(x), y) / micro).backward()
            else:
                (loss_fn(ddp(x), y) / micro).backward()
        optimizer.step()
    return state(model)


def main() -> None:
    steps, bucket_mb, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    init_gloo()
    rank, world = dist.get_rank(), dist.get_world_size()
    states = {run: train(run, steps, bucket_mb, rank, world) for run in ("plain", "accumulate", "no_sync")}
    if rank == 0:
        torch.save(states, out)
    dist.barrier()
    end_now()


if __name__ == "__main__":
    main()

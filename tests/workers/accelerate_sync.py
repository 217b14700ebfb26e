"""An Accelerate script under ``hopnet.integrations.accelerate.Sync``: a small MLP, each rank on its
own data, bf16, two accumulation steps per optimizer step, clipping, a schedule.

Saves each rank's parameters at the end of the loop (``OUT/own{R}.pt``, before the consensus) and
after the context's exit (``OUT/final{R}.pt``), and prints the steps it ran and the consensus.

``--scaler``: fp32 with torch's gradient scaler, as Accelerate makes one for fp16 on a GPU (a CPU
build makes none: the test gives it torch's CPU scaler), and ``--overflow R:S`` makes rank R's
loss infinite in optimizer step S; it then prints the steps Accelerate reported skipped.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from hopnet.integrations.accelerate import Sync, single_process


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--scaler", action="store_true")
    parser.add_argument("--overflow", default=None, metavar="R:S")
    parser.add_argument("--die", default=None, metavar="R:S")
    args = parser.parse_args()
    overflow = tuple(int(v) for v in args.overflow.split(":")) if args.overflow else None
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=args.steps)
    with single_process():
        accelerator = Accelerator(cpu=True, mixed_precision="no" if args.scaler else "bf16",
                                  gradient_accumulation_steps=2)
    if args.scaler:
        accelerator.scaler = torch.amp.GradScaler("cpu")
    model, optimizer, schedule = accelerator.prepare(model, optimizer, schedule)
    skipped = []

    with Sync(accelerator, model, optimizer, steps=args.steps) as sync:
        rank = sync.worker.rank
        sync.worker.register_state("schedule", schedule)  # a replacement (--max-restarts) takes it over too
        generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data
        x = torch.randn(args.steps * 2 * 8, 8, generator=generator)
        loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).sin()), batch_size=8)
        steps = 0
        for xb, yb in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(xb).float(), yb)
                if overflow == (rank, steps) and accelerator.sync_gradients:
                    loss = loss * float("inf")
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                if accelerator.sync_gradients and accelerator.optimizer_step_was_skipped:
                    skipped.append(steps)
                schedule.step()
                optimizer.zero_grad()
            steps += accelerator.sync_gradients
            if not sync.step():
                break
            if args.die == f"{rank}:{steps}" and not os.environ.get("HOPNET_RESTART"):
                os.kill(os.getpid(), signal.SIGKILL)
        torch.save(torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone(), args.out / f"own{rank}.pt")
    assert sync.consensus is not None
    torch.save(torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone(), args.out / f"final{rank}.pt")
    print(f"optimizer steps {steps}, iterations {sync.worker.steps}, consensus of {list(sync.consensus.members)}",
          flush=True)
    if args.scaler:
        print(f"rank {rank} skipped steps {skipped}, scale {accelerator.scaler.get_scale()}", flush=True)


if __name__ == "__main__":
    main()

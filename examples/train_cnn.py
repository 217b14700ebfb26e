"""Train a small CNN on the digits as 1x8x8 images, the way a practitioner writes a trainer.

BatchNorm and dropout, a frozen stem, AdamW with two parameter groups, a cosine schedule
stepped every iteration, two micro-batches of gradient accumulation, clipping of the
averaged gradient and autocast; at the end the workers agree on one model. The micro-batches
come from ``hopnet.data.ElasticSampler``: each sample once per epoch across the workers.

    hopnet launch --nproc 4 examples/train_cnn.py
    hopnet launch --nproc 4 --protocol ad-psgd examples/train_cnn.py --amp none

Under a gradient protocol the script gets DDP's semantics: ``optimizer.synchronize()``
leaves the average gradient in ``.grad`` before it is clipped, buffers follow rank 0's,
and with ``--amp fp16`` an overflow on any rank skips the step on every rank. Under a
model-averaging protocol the same lines work, and the clipping acts on the local gradient.
Each rank prints its own held-out accuracy; rank 0 also prints the consensus model's
(``hopnet launch --save-model`` writes that model to the run directory as ``model.pt``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path

import torch
from torch import nn

import hopnet
from digits_data import digits_split
from hopnet.data import ElasticSampler


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32, help="per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (cosine decay)")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--clip", type=float, default=1.0, help="max norm of the averaged gradient")
    parser.add_argument("--amp", choices=("bf16", "fp16", "none"), default="bf16",
                        help="autocast dtype; fp16 uses a GradScaler (default: bf16)")
    parser.add_argument("--seed", type=int, default=0, help="same model initialisation on every worker")
    return parser.parse_args()


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 16, 3, padding=1)  # frozen: a fixed random feature bank
        self.features = nn.Sequential(
            nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
            nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(32 * 4 * 4, 64), nn.ReLU(),
                                  nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(self.stem(x)))


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on the weight matrices and kernels only, as is usual with AdamW."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    decayed = [p for _, p in trainable if p.dim() > 1]
    plain = [p for _, p in trainable if p.dim() <= 1]
    return [{"params": decayed, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    was_training = model.training
    model.eval()
    with torch.no_grad():
        correct = (model(x).argmax(dim=1) == y).float().mean().item()
    model.train(was_training)
    return correct


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # several workers share this machine's cores
    torch.manual_seed(args.seed)
    model = DigitsCNN()
    model.stem.requires_grad_(False)

    worker = hopnet.init(model)
    optimizer = hopnet.DistributedOptimizer(
        torch.optim.AdamW(parameter_groups(model, args.weight_decay), lr=args.lr), worker)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.iterations)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    scaler = torch.amp.GradScaler("cpu", enabled=args.amp == "fp16")
    # Saved in checkpoints (--checkpoint-every) and handed to a replacement (--max-restarts), with the
    # optimizer's state: a restarted worker goes on with the same learning rate and loss scale.
    worker.register_state("lr_schedule", schedule)
    worker.register_state("grad_scaler", scaler)

    x_train, y_train, x_test, y_test = digits_split(args.seed)
    x_train, x_test = x_train.view(-1, 1, 8, 8), x_test.view(-1, 1, 8, 8)
    loss_fn = nn.CrossEntropyLoss()
    # Each sample once per epoch across the workers; checkpointed and handed to a replacement.
    sampler = ElasticSampler(len(x_train), rank=worker.rank, members=worker.members, view=worker.view,
                             seed=args.seed)
    worker.register_state("sampler", sampler)
    micro_batches = sampler.batches(args.batch_size)

    model.train()
    for _ in worker.iterations(args.iterations):
        optimizer.zero_grad()
        for _ in range(args.micro_batches):
            batch = torch.tensor(next(micro_batches))
            autocast = (torch.autocast("cpu", dtype=amp_dtype) if amp_dtype is not None
                        else contextlib.nullcontext())
            with autocast:
                loss = loss_fn(model(x_train[batch]), y_train[batch]) / args.micro_batches
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # before the average: every rank's found-inf takes part in it
        optimizer.synchronize()  # the average gradient is in .grad from here on
        nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        with optimizer.skip_synchronize():
            scaler.step(optimizer)
        scaler.update()
        schedule.step()
        worker.report(loss=round(loss.item() * args.micro_batches, 5), lr=schedule.get_last_lr()[0])

    own_accuracy = accuracy(model, x_test, y_test)
    run_dir = os.environ.get("HOPNET_RUN_DIR")
    if run_dir:  # this worker's own model, before the workers agree on one
        torch.save(model.state_dict(), Path(run_dir) / f"final_rank{worker.rank}.pt")
    worker.consensus()  # every live worker now holds the average model, buffers included
    consensus_accuracy = accuracy(model, x_test, y_test)
    worker.record("eval", iter=worker.iteration, accuracy=own_accuracy, consensus_accuracy=consensus_accuracy,
                  final=True)
    print(f"held-out accuracy {own_accuracy:.4f} (this worker's model)", flush=True)
    if worker.rank == 0:
        print(f"consensus model held-out accuracy {consensus_accuracy:.4f}", flush=True)
    worker.close()


if __name__ == "__main__":
    main()

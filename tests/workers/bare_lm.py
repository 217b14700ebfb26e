"""examples/hf_trainer_lm.py's training written with hopnet's bare API, without the Trainer.

The same model, batches (each rank's ``DistributedSampler`` share, seeded alike), optimizer (the
Trainer's AdamW with its two weight-decay groups), warm-up and cosine schedule, clipping of the
averaged gradient and bf16 autocast, in the loop of docs/guides/embedding.md; then the consensus.
Every rank prints ``held-out loss X`` as the example does, and rank 0 saves the model's
state_dict to ``OUT``. tests/test_hf.py compares the two runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from hf_trainer_lm import build_model, splits  # noqa: E402
from transformers import Trainer, TrainingArguments, get_cosine_schedule_with_warmup  # noqa: E402

import hopnet  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    train, test = splits(64)
    model = build_model(args.seed, 64)

    worker = hopnet.init(model)
    hf_args = TrainingArguments(output_dir="unused", learning_rate=args.lr, weight_decay=0.01, use_cpu=True,
                                report_to="none")
    optimizer_cls, defaults = Trainer.get_optimizer_cls_and_kwargs(hf_args, model)
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.01},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = hopnet.DistributedOptimizer(optimizer_cls(groups, **defaults), worker)
    schedule = get_cosine_schedule_with_warmup(optimizer, max(1, args.steps // 10), args.steps)
    members = list(worker.members)
    sampler = DistributedSampler(train, num_replicas=len(members), rank=members.index(worker.rank), seed=args.seed)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)

    def batches() -> Iterator[dict[str, torch.Tensor]]:
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    stream = batches()
    model.train()
    for _ in worker.iterations(args.steps):
        batch = next(stream)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        optimizer.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        worker.report(loss=loss.item())
    worker.consensus()
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        held_out = model(input_ids=test.windows, labels=test.windows).loss.item()
    print(f"held-out loss {held_out:.4f} (consensus model, {args.steps} steps)", flush=True)
    if worker.rank == 0:
        torch.save({name: t.detach().clone() for name, t in model.state_dict().items()}, args.out)
    worker.close()


if __name__ == "__main__":
    main()

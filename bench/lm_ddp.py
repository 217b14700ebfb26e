"""examples/train_lm.py's twin under torch DDP: the same model, data, schedule and loop, for bench/lm.py.

    python -m torch.distributed.run --nproc-per-node 4 bench/lm_ddp.py --out DIR [--slowdown rank=0:4] \\
        --preset tiny --iterations 200 --eval-every 10

Everything but the distribution comes from examples/train_lm.py (its flags, the model, the
corpus and held-out windows, AdamW's groups, the schedule, the loss, the evaluation): gloo on the
CPU, NCCL with ``--device cuda``; all micro-batches but the last inside DDP's ``no_sync()``, the
clipping after the backward pass (which leaves DDP's average in ``.grad``). ``--slowdown`` stretches
the time since the previous step ended by the rank's factor just before ``optimizer.step()``, the
way hopnet's ``Worker.step`` does it (hopnet.slowdown.Slowdown, the same specs and seed). Each rank
writes ``lm_rank{R}.json`` into ``--out``: its held-out evaluations as ``[iteration, seconds since
its loop began, loss]`` (iteration -1: before the first), and when each iteration ended.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from hopnet.slowdown import Slowdown  # noqa: E402
from lm_data import random_windows  # noqa: E402
from train_lm import autocast, data, evaluate, lm_loss, lr_at, parameter_groups, parse_args, setup  # noqa: E402


def main() -> None:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--out", required=True, help="where each rank writes lm_rank{R}.json")
    own.add_argument("--slowdown", action="append", default=[], help="as hopnet's --slowdown")
    mine, rest = own.parse_known_args()
    args = parse_args(rest)
    model, device = setup(args, "LOCAL_RANK")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(parameter_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    slowdown = Slowdown.from_specs(mine.slowdown, seed=args.seed)
    train, heldout = data(args, device)
    generator = torch.Generator().manual_seed(args.seed * 100_003 + rank)
    evals = [(-1, 0.0, evaluate(model, heldout, args))]
    ends = []

    model.train()
    began = step_ended = time.monotonic()
    for step in range(args.iterations):
        lr = lr_at(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        for micro in range(args.micro_batches):
            x, y = (t.to(device) for t in random_windows(train, args.context, args.batch_size, generator))
            last = micro == args.micro_batches - 1
            with contextlib.nullcontext() if last else ddp.no_sync(), autocast(args):
                loss = lm_loss(ddp, x, y) / args.micro_batches
            loss.backward()  # the last one all-reduces the accumulated gradient
        nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        factor = slowdown.factor(rank, step)
        if factor > 1.0:
            time.sleep((factor - 1.0) * (time.monotonic() - step_ended))
        optimizer.step()
        step_ended = time.monotonic()
        ends.append(step_ended - began)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.iterations:
            elapsed = time.monotonic() - began
            evals.append((step, elapsed, evaluate(model, heldout, args)))

    Path(mine.out).mkdir(parents=True, exist_ok=True)
    (Path(mine.out) / f"lm_rank{rank}.json").write_text(json.dumps({"rank": rank, "evals": evals, "ends": ends}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

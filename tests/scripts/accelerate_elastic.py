"""An Accelerate script under ``hopnet.integrations.accelerate.Sync`` for the elastic tests
(tests/test_hf.py): one dataset divided among the view's members by ``hopnet.data.ElasticSampler``,
two accumulation steps per optimizer step, the sampler and the schedule registered (a joiner takes
them from its donor). The first workers wait at one step for the joiner to start (joiner_gate.py),
and each iteration takes ``--step-ms`` more (a sleep standing in for compute: this model's own takes
a millisecond, and the run would end before the joiner's request is in). Prints the iterations it
ran, the last one, and the consensus."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from joiner_gate import wait_for_the_joiner  # noqa: E402

from hopnet.data import ElasticSampler  # noqa: E402
from hopnet.integrations.accelerate import Sync, single_process  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--step-ms", type=float, default=100.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same model on every rank
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(7))
    y = x.sum(dim=1, keepdim=True).sin()
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=args.steps)
    with single_process():
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, optimizer, schedule = accelerator.prepare(model, optimizer, schedule)

    with Sync(accelerator, model, optimizer, steps=args.steps) as sync:
        worker = sync.worker
        sampler = ElasticSampler(len(x), rank=worker.rank, members=worker.members, view=worker.view)
        worker.register_state("sampler", sampler)
        worker.register_state("schedule", schedule)
        batches = sampler.batches(8)
        ran = 0
        while True:
            wait_for_the_joiner(worker.iteration)
            for _ in range(2):
                with accelerator.accumulate(model):
                    rows = next(batches)
                    loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
                    accelerator.backward(loss)
                    optimizer.step()
                    schedule.step()
                    optimizer.zero_grad()
            time.sleep(args.step_ms / 1000)
            ran += 1
            if not sync.step():
                break
    assert sync.consensus is not None
    print(f"rank {worker.rank} ran {ran} iterations, last {worker.iteration}, "
          f"consensus of {list(sync.consensus.members)}", flush=True)


if __name__ == "__main__":
    main()

"""Train a small MLP on scikit-learn's handwritten digits with hopnet.

Run it under the launcher; the protocol and its options come from the launcher's flags:

    hopnet launch --nproc 4 examples/train_digits.py
    hopnet launch --graph examples/ring.json --backup-workers 1 examples/train_digits.py --iterations 400

Each worker trains on its own share of the training set, from hopnet.data.ElasticSampler:
every epoch a new order of the samples, each sample in one worker's share (docs/guides/data.md).
Every worker evaluates on the same held-out split, so the accuracies printed at the end are
comparable across workers.
The final parameters are saved into the run directory (``final_rank{R}.pt``), where a
test or a person can check that the workers agree.

Then ``worker.consensus()`` makes every live worker's model the exact mean of the live
workers' models, and the lowest live rank (rank 0 unless it left) prints that model's
held-out accuracy. With ``hopnet launch --save-model`` that rank also writes it to
``model.pt`` in the run directory.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch

import hopnet
from digits_data import digits_split
from hopnet.data import ElasticSampler


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300, help="training iterations (default: 300)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1, help="peak learning rate (cosine decay to 0)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="same model initialisation on every worker")
    parser.add_argument("--eval-every", type=int, default=100)
    return parser.parse_args()


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # several workers share this machine's cores
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, args.hidden), torch.nn.ReLU(), torch.nn.Linear(args.hidden, 10))

    worker = hopnet.init(model)
    optimizer = hopnet.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9), worker)
    x_train, y_train, x_test, y_test = digits_split(args.seed)
    loss_fn = torch.nn.CrossEntropyLoss()
    sampler = ElasticSampler(len(x_train), rank=worker.rank, members=worker.members, view=worker.view,
                             seed=args.seed)
    worker.register_state("sampler", sampler)  # checkpointed: a resumed run goes on from the same sample
    next_batch = sampler.batches(args.batch_size)  # full batches, epoch after epoch

    for step in worker.iterations(args.iterations):
        for group in optimizer.param_groups:
            group["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.iterations))
        batch = torch.tensor(next(next_batch))
        optimizer.zero_grad()
        loss = loss_fn(model(x_train[batch]), y_train[batch])
        loss.backward()
        worker.report(loss=round(loss.item(), 5))
        optimizer.step()
        if (step + 1) % args.eval_every == 0:
            worker.record("eval", iter=step, accuracy=accuracy(model, x_test, y_test))

    final_accuracy = accuracy(model, x_test, y_test)
    final_loss = loss_fn(model(x_test), y_test).item()
    worker.record("eval", iter=worker.iteration, accuracy=final_accuracy, final=True)
    run_dir = os.environ.get("HOPNET_RUN_DIR")
    if run_dir:
        torch.save(torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone(),
                   Path(run_dir) / f"final_rank{worker.rank}.pt")

    consensus = worker.consensus()  # every live worker now holds the mean of the live workers' models
    consensus_accuracy = accuracy(model, x_test, y_test)
    worker.record("eval", iter=worker.iteration, accuracy=consensus_accuracy, consensus=True)
    worker.close()
    print(f"final held-out accuracy {final_accuracy:.4f} (loss {final_loss:.4f}, "
          f"{worker.steps} steps, reached iteration {worker.iteration})", flush=True)
    if worker.rank == consensus.members[0]:
        print(f"consensus model held-out accuracy {consensus_accuracy:.4f} "
              f"(mean of ranks {', '.join(map(str, consensus.members))})", flush=True)


if __name__ == "__main__":
    main()

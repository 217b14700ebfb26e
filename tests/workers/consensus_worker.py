"""A small digits trainer for the consensus tests, run under `hopnet launch`.

It trains an MLP on scikit-learn's digits (emulating ``--compute-ms`` of compute per
iteration by sleeping), calls ``worker.consensus()`` and prints, on every rank, the members
averaged, the rounds, the consensus model's held-out accuracy and a digest of its whole
state_dict. ``--kill-rank R --kill-at K``: rank R SIGKILLs itself at iteration K, a crash
with no goodbye (its neighbours' heartbeats must find it dead).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch

import hopnet

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from digits_data import digits_split  # noqa: E402  (the examples' cached split: no sklearn import)

HIDDEN = 32


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 10))


def held_out() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training split and the held-out split (x_train, y_train, x_test, y_test)."""
    x_train, y_train, x_test, y_test = digits_split(0)
    return x_train, y_train, x_test, y_test


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def digest(state: dict[str, torch.Tensor]) -> str:
    """The state_dict's values, summed per entry in float64: equal digests, equal models."""
    return ";".join(f"{name}={tensor.double().sum().item()!r}" for name, tensor in sorted(state.items()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--compute-ms", type=float, default=0.0)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-at", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = make_model()
    worker = hopnet.init(model)
    optimizer = hopnet.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), worker)
    x_train, y_train, x_test, y_test = held_out()
    x_train, y_train = x_train[worker.rank::worker.graph.n], y_train[worker.rank::worker.graph.n]
    draw = torch.Generator().manual_seed(worker.rank)
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in worker.iterations(args.iterations):
        if worker.rank == args.kill_rank and step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(args.compute_ms / 1000)
        batch = torch.randint(len(x_train), (32,), generator=draw)
        optimizer.zero_grad()
        loss_fn(model(x_train[batch]), y_train[batch]).backward()
        optimizer.step()
    result = worker.consensus()
    print(f"consensus of ranks {list(result.members)} in {result.rounds} round(s): held-out accuracy "
          f"{accuracy(model, x_test, y_test):.4f} digest {digest(model.state_dict())}", flush=True)
    worker.close()


if __name__ == "__main__":
    main()

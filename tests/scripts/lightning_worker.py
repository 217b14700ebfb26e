"""A LightningModule trained under HopnetStrategy, in either Lightning namespace, for
tests/test_lightning.py: the digits MLP of examples/lightning_digits.py, an early stop agreed
through ``reduce_boolean_decision`` (as EarlyStopping does), a worker that dies, and checks of
the collectives; with ``--lr-step``, an LR schedule stepped per step.

    hopnet launch --nproc 2 tests/scripts/lightning_worker.py --namespace pytorch_lightning --stop-at 30
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from digits_data import digits_split  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--namespace", choices=("lightning.pytorch", "pytorch_lightning"), default="lightning.pytorch")
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--stop-at", type=int, default=None, help="every rank agrees to stop after this step")
    parser.add_argument("--lr-step", type=int, default=None, help="halve the learning rate every that many steps")
    parser.add_argument("--die", default=None, metavar="RANK:STEP", help="that rank exits (status 3) after that step")
    args = parser.parse_args()
    pl = importlib.import_module(args.namespace)
    strategies = importlib.import_module("hopnet.integrations." + args.namespace.split(".")[0])
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    x_train, y_train, x_test, y_test = digits_split(0)

    class Digits(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            if args.lr_step is None:
                return optimizer
            schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.lr_step, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    class StopAt(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if args.die is not None and args.die == f"{trainer.global_rank}:{trainer.global_step}":
                os._exit(3)
            if args.stop_at is not None:
                trainer.should_stop = trainer.strategy.reduce_boolean_decision(
                    trainer.global_step >= args.stop_at and trainer.global_rank == 0, all=False)

    module = Digits()
    strategy = strategies.HopnetStrategy()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=args.iterations,
                         callbacks=[StopAt()], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(TensorDataset(x_train, y_train), batch_size=32, shuffle=True, drop_last=True))
    # The collectives, among the live workers: every rank must see the same results.
    rank = trainer.global_rank
    total = strategy.reduce(torch.tensor(float(rank + 1)), reduce_op="sum")
    gathered = strategy.all_gather(torch.tensor([rank]))
    shared = strategy.broadcast(f"from rank {rank}", src=1)
    strategy.barrier()
    with torch.no_grad():
        accuracy = (module.net(x_test).argmax(dim=1) == y_test).float().mean().item()
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    print(f"accuracy {accuracy:.4f} epoch {trainer.current_epoch} lr {lr:g} steps {trainer.global_step} iteration {strategy.worker.iteration} "
          f"sum {total.item():g} gathered {gathered.flatten().tolist()} broadcast {shared!r}", flush=True)


if __name__ == "__main__":
    main()

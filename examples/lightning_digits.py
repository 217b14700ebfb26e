"""Train the digits MLP of train_digits.py as a LightningModule, under hopnet.

The module and the Trainer are what a Lightning user writes; the strategy is the one change:

    hopnet launch --nproc 4 examples/lightning_digits.py
    hopnet launch --nproc 4 --protocol diloco --local-steps 10 examples/lightning_digits.py
    hopnet launch --nproc 2 examples/lightning_digits.py --checkpoint-dir ckpts          # ModelCheckpoint
    hopnet launch --nproc 2 examples/lightning_digits.py --resume ckpts/last.ckpt        # goes on from there

The same script under Lightning's own DDP (two processes it starts itself, gloo on the CPU):

    python examples/lightning_digits.py --strategy ddp --devices 2
    python examples/lightning_digits.py --strategy ddp_fork --devices 2    # the same, forked

Lightning gives each worker its share of the samples (a DistributedSampler); the LR schedule is a
cosine stepped every iteration, and the validation logs the workers' mean held-out accuracy. Training
ends with the consensus model (every live worker holds the mean of the live workers' models), whose
held-out accuracy each rank prints. ``--save PATH`` writes that model's state_dict (rank 0).
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from digits_data import digits_split
from hopnet.integrations.lightning import HopnetStrategy


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300, help="optimizer steps (default: 300)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1, help="peak learning rate (cosine decay to 0)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batchnorm", action="store_true", help="a BatchNorm layer after the hidden one")
    parser.add_argument("--seed", type=int, default=0, help="same model initialisation on every worker")
    parser.add_argument("--clip", type=float, default=None, help="clip the (averaged) gradient's norm")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--precision", default="32-true", help="Lightning's precision (e.g. bf16-mixed)")
    parser.add_argument("--strategy", choices=("hopnet", "ddp", "ddp_fork"), default="hopnet",
                        help="ddp_fork: Lightning's DDP in processes forked from this one (no second import)")
    parser.add_argument("--devices", type=int, default=1, help="processes Lightning starts (ddp only)")
    parser.add_argument("--checkpoint-dir", help="save a checkpoint after every epoch here (and last.ckpt)")
    parser.add_argument("--resume", help="a checkpoint to go on from (fit(ckpt_path=...))")
    parser.add_argument("--save", help="write the final (consensus) model's state_dict here (rank 0)")
    return parser.parse_args()


class DigitsMLP(L.LightningModule):
    def __init__(self, hidden: int, lr: float, iterations: int, batchnorm: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        norm = [nn.BatchNorm1d(hidden)] if batchnorm else []  # (no bias before it: BatchNorm removes it)
        self.net = nn.Sequential(nn.Linear(64, hidden, bias=not batchnorm), *norm, nn.ReLU(), nn.Linear(hidden, 10))
        self.loss_fn = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        accuracy = (self(x).argmax(dim=1) == y).float().mean()
        self.log("val_accuracy", accuracy, sync_dist=True)  # the mean over the workers

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.hparams.iterations)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # several workers share this machine's cores
    L.seed_everything(args.seed, verbose=False)
    x_train, y_train, x_test, y_test = digits_split(args.seed)
    train = DataLoader(TensorDataset(x_train, y_train), batch_size=args.batch_size, shuffle=True, drop_last=True)
    held_out = DataLoader(TensorDataset(x_test, y_test), batch_size=256)
    module = DigitsMLP(args.hidden, args.lr, args.iterations, args.batchnorm)

    callbacks: list[L.Callback] = []
    if args.checkpoint_dir:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=args.checkpoint_dir, save_top_k=-1,
                                                             save_last=True))  # every epoch, and the last
    strategy = HopnetStrategy() if args.strategy == "hopnet" else args.strategy
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=args.devices, max_steps=args.iterations,
                        precision=args.precision, gradient_clip_val=args.clip,
                        accumulate_grad_batches=args.accumulate, callbacks=callbacks,
                        default_root_dir=os.environ.get("HOPNET_RUN_DIR", "lightning_logs"),
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        log_every_n_steps=10)
    trainer.fit(module, train, held_out, ckpt_path=args.resume)

    prefix = "" if args.strategy == "hopnet" else f"[rank {trainer.global_rank}] "  # hopnet launch prefixes
    print(f"{prefix}held-out accuracy {accuracy(module, x_test, y_test):.4f} after {trainer.global_step} steps "
          "(the consensus model)", flush=True)
    if trainer.global_rank == 0 and args.save:
        torch.save(module.state_dict(), args.save)


if __name__ == "__main__":
    main()

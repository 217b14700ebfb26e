"""fp16 with a gradient scaler under Lightning, on a CPU: Lightning's ``16-mixed`` plugin given torch's
CPU scaler (Lightning turns ``precision="16-mixed"`` into bf16 on a CPU), a small scale so that
nothing overflows by itself, and rank R's loss made infinite at step S (``--overflow R:S``).
Under ``--strategy hopnet`` (``hopnet launch``) or Lightning's ``ddp`` or ``ddp_fork`` (``--devices 2``);
rank 0 saves the final model to ``--save``, and every rank prints its scale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from digits_data import digits_split  # noqa: E402

from hopnet.integrations.lightning import HopnetStrategy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=("hopnet", "ddp", "ddp_fork"), default="hopnet")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--overflow", default="1:4", metavar="R:S")
    parser.add_argument("--save", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    x_train, y_train, _, _ = digits_split(0)

    class Digits(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x).float(), y)
            if args.overflow == f"{self.global_rank}:{self.global_step}":
                loss = loss * float("inf")
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        def on_train_end(self) -> None:
            if args.strategy == "ddp_fork":  # the forked ranks end here, with their scalers
                report(self.trainer, self)

    def report(trainer: L.Trainer, module: L.LightningModule) -> None:
        print(f"rank {trainer.global_rank} scale {scaler.get_scale():g} steps {trainer.global_step}", flush=True)
        if trainer.global_rank == 0:
            torch.save(module.state_dict(), args.save)

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    strategy = HopnetStrategy() if args.strategy == "hopnet" else args.strategy
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=args.devices, max_steps=args.iterations,
                        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = Digits()
    trainer.fit(module, DataLoader(TensorDataset(x_train, y_train), batch_size=32, shuffle=True, drop_last=True))
    if args.strategy != "ddp_fork":
        report(trainer, module)


if __name__ == "__main__":
    main()

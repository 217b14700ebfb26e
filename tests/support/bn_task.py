"""A conv + BatchNorm model on digits, shared by tests/test_model_state.py and its DDP
reference (tests/workers/ddp_batchnorm.py): the same model, batches and schedule on both sides."""

from __future__ import annotations

import functools
import math

import torch
from sklearn.datasets import load_digits

BATCH = 32
LR = 0.1


class Cast(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


def cnn(seed: int = 0, *, bf16_head: bool = False) -> torch.nn.Sequential:
    """A conv + BatchNorm model for 1x8x8 digits; ``bf16_head``: its last layer in bfloat16."""
    torch.manual_seed(seed)
    head: list[torch.nn.Module] = [torch.nn.Linear(8 * 8 * 8, 10)]
    if bf16_head:
        head = [Cast(torch.bfloat16), head[0].to(torch.bfloat16), Cast(torch.float32)]
    return torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               torch.nn.Flatten(), *head)


@functools.cache
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    return x, torch.tensor(data.target, dtype=torch.long)


def batch(rank: int, world: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of ``step``, from its own shard (every rank's batches differ)."""
    x, y = digits()
    x, y = x[rank::world], y[rank::world]
    pick = torch.randint(len(x), (BATCH,), generator=torch.Generator().manual_seed(rank * 1000 + step))
    return x[pick], y[pick]


def set_lr(optimizer: torch.optim.Optimizer, peak: float, step: int, steps: int) -> None:
    """A cosine schedule, as the examples use."""
    for group in optimizer.param_groups:
        group["lr"] = peak * 0.5 * (1 + math.cos(math.pi * step / steps))


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}

"""A small training task with clipping, shared by hopnet's threads and the DDP reference
(tests/workers/ddp_clip.py): the same model, batches, optimizer and schedule on both sides."""

from __future__ import annotations

import torch

from support.threaded import seeded

STEPS = 20
MAX_NORM = 0.5
LR = 0.2


def make_model() -> torch.nn.Module:
    return seeded(lambda: torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank * 1000 + step)
    return 3 * torch.randn(16, 5, generator=gen), torch.randint(3, (16,), generator=gen)


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

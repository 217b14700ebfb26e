"""What the simulator's workers hold in place of a trainer's tensors, and the network that charges
their bytes: shared by a fixed run (:mod:`hopnet.sim.engine`) and one with churn (:mod:`hopnet.sim.views`)."""

from __future__ import annotations

import torch

from hopnet.protocols.adpsgd.options import REPLY as AVERAGING_REPLY
from hopnet.protocols.adpsgd.options import REQUEST as AVERAGING_REQUEST
from hopnet.registry import Averages
from hopnet.runtime.mailbox import COLLECTIVE_KIND
from hopnet.sim.spec import SimSpec
from hopnet.transports.inproc import InprocNetwork

STAND_IN_MAX_ELEMENTS = 1 << 16
"""Largest stand-in gradient (float32 elements) the simulator all-reduces for a model it
only knows the size of; the links are charged the model's bytes, scaled up."""


def stand_in_gradients(spec: SimSpec, n: int) -> tuple[int, float]:
    """Elements of the float32 gradient stand-in, and the factor its bytes are charged at."""
    numel = max(n, min(spec.model_bytes // 4, STAND_IN_MAX_ELEMENTS))
    return numel, spec.model_bytes / (4 * numel)


def gradients(spec: SimSpec, rank: int, stand_in: int) -> torch.Tensor | None:
    """What a gradient protocol reduces every iteration (there is no trainer to compute any):
    random values of the model's size, or of the stand-in's when only its bytes are known."""
    if spec.config.spec.averages is not Averages.GRADIENTS:
        return None
    gen = torch.Generator().manual_seed(spec.config.seed * 1_000_003 + rank + 1)
    if spec.param_dim:
        return torch.randn(spec.param_dim, generator=gen, dtype=torch.float64)
    return torch.randn(stand_in, generator=gen, dtype=torch.float32)


def initial_model(spec: SimSpec, rank: int, stand_in: int) -> torch.Tensor | None:
    """A worker's model at the start: ``param_dim`` values, or a stand-in to average (there is no
    trainer; links are charged the model's bytes); None where the protocol needs none."""
    config = spec.config
    if spec.param_dim:
        gen = torch.Generator().manual_seed(config.seed * 1_000_003 + rank)
        return torch.randn(spec.param_dim, generator=gen, dtype=torch.float64)
    if config.spec.averages is Averages.MODELS and not config.spec.simulated_without_tensors:
        gen = torch.Generator().manual_seed(config.seed * 1_000_003 + rank)
        return torch.randn(stand_in, generator=gen, dtype=torch.float32)
    return None


def network(spec: SimSpec, scale: float) -> InprocNetwork:
    """The in-process network of one run (or one view): ``spec``'s links, updates charged the model's
    bytes, the stand-ins' messages charged at ``scale``."""
    stand_in_kinds = (COLLECTIVE_KIND, AVERAGING_REQUEST, AVERAGING_REPLY)
    return InprocNetwork(spec.link, virtual_bytes={"update": spec.model_bytes} if spec.model_bytes else None,
                         byte_scale=None if spec.param_dim else {kind: scale for kind in stand_in_kinds},
                         seed=spec.config.seed)

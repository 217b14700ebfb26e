"""eager-SGD's declaration (:mod:`hopnet.protocols.eager` is the algorithm)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hopnet.config import ProtocolConfig
from hopnet.options import option
from hopnet.output_spec import Count, OutputSpec, Wait
from hopnet.protocols.specs.gradient_options import GradientOptions
from hopnet.registry import Averages, MessageKind, ProtocolSpec, register

if TYPE_CHECKING:
    import torch

    from hopnet.model_state import ModelState
    from hopnet.params import FlatGradients
    from hopnet.protocols.base import Protocol

ACTIVATION_KIND = "eager"
"""An activation: ``iter`` is the round id, ``meta["r"]`` the root (initiator) of its tree.
With ``meta["fin"]`` instead: the sender has finished its iterations (majority rounds it
was to start are then started by whoever waits for them). With ``meta["sync"] = k``: the
sender is in the full synchronisation of iteration k, a barrier, so a majority round it
was to start is started by whoever waits for it in iteration k."""


@dataclass(frozen=True)
class EagerOptions(GradientOptions):
    eager_mode: str = option("solo", choices=("solo", "majority"),
                             help="who starts a round: solo (whoever arrives first; never waits for another's "
                                  "compute) or majority (a seeded random rank; earlier arrivals wait for it)")
    full_sync_every: int | None = option(None, minimum=1, metavar="N",
                                         help="average the models with a blocking all-reduce every N iterations")

    def settings(self) -> list[str]:
        shown = [f"mode {self.eager_mode}"]
        if self.buffers != "broadcast":
            shown.append(f"buffers {self.buffers}")
        if self.full_sync_every is not None:
            shown.append(f"full sync every {self.full_sync_every}")
        return shown


def _build(config: ProtocolConfig, options: EagerOptions, model: ModelState | None,
           grads: FlatGradients | torch.Tensor | None) -> Protocol:
    from hopnet.protocols.eager import EagerProtocol

    return EagerProtocol(config, options, model, grads)


EAGER_OUTPUT = OutputSpec(
    waits=(Wait("wait_updates_s", "wait for round", "wait round"),),
    counts=(Count("initiated", "rounds started", "per_rank"), Count("stale_calls", "late contributions"),
            Count("rounds", "rounds", "max", in_summary=False),
            Count("rounds_skipped", "rounds skipped", in_summary=False),
            Count("active_mean", "mean ranks active per round", "mean", in_summary=False)))


register(ProtocolSpec(
    name="eager-sgd",
    summary="eager-SGD's partial all-reduce of the gradients among all ranks (see --eager-mode).",
    options=EagerOptions,
    build=_build,
    averages=Averages.GRADIENTS,
    uses_graph=False,
    message_kinds=(MessageKind(ACTIVATION_KIND, any_rank=True),),
    resumable=True,
    restartable=True,
    output=EAGER_OUTPUT,
))

__all__ = ["ACTIVATION_KIND", "EagerOptions"]

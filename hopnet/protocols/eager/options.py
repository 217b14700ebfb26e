"""eager-SGD's options and message kinds: what the algorithm and the declaration (:mod:`.spec`)
both read. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from hopnet.options import option
from hopnet.protocols.gradient_options import GradientOptions

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


__all__ = ["ACTIVATION_KIND", "EagerOptions"]

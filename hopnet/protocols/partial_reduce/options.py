"""Partial Reduce's options and message kinds: what the algorithm and the declaration (:mod:`.spec`)
both read. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from hopnet.protocols.partial_reduce.weights import MISSING_POLICIES, WEIGHT_MODES
from hopnet.errors import ConfigError
from hopnet.options import option
from hopnet.protocols.local_steps import LocalStepsOptions

ABORT = "preduce_abort"
"""Member -> the other members of a group: the group failed; ``meta``: ``gid``, and the
``peer`` to blame with its ``state`` ("dead" or "departed")."""

DEFAULT_GROUP_SIZE = 3
DEFAULT_EMA_DECAY = 0.9


@dataclass(frozen=True)
class PartialReduceOptions(LocalStepsOptions):
    group_size: int = option(DEFAULT_GROUP_SIZE, minimum=2, metavar="N", help="workers per group")
    weights: str = option("const", choices=WEIGHT_MODES,
                          help="const (1/P, keeps the mean) or dynamic (staleness-aware EMA weights, Eq. 9)")
    ema_decay: float = option(DEFAULT_EMA_DECAY, metavar="ALPHA", help="dynamic weights: the EMA decay")
    missing_policy: str = option("oldest", choices=MISSING_POLICIES,
                                 help="dynamic weights: who gets the weight of staleness levels no member holds "
                                      "(oldest is the paper's reading)")
    frozen_window: int | None = option(None, minimum=0, metavar="T",
                                       help="keep the sync graph of the last T groups connected (none: derived "
                                            "from the world and group sizes; 0 switches group-frozen avoidance "
                                            "off)")

    def check(self) -> None:
        if isinstance(self.ema_decay, bool) or not isinstance(self.ema_decay, (int, float)) \
                or not 0 <= self.ema_decay < 1:
            raise ConfigError(f"--ema-decay must be in [0, 1) (got {self.ema_decay!r})")


__all__ = ["ABORT", "DEFAULT_EMA_DECAY", "DEFAULT_GROUP_SIZE", "PartialReduceOptions"]

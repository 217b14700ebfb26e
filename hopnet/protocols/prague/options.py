"""Prague's options and message kinds: what the algorithm and the declaration (:mod:`.spec`)
both read. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from hopnet.options import option
from hopnet.protocols.local_steps import LocalStepsOptions

DEFAULT_GROUP_SIZE = 3
DEFAULT_SLOW_FILTER = 4


@dataclass(frozen=True)
class PragueOptions(LocalStepsOptions):
    group_size: int = option(DEFAULT_GROUP_SIZE, minimum=2, metavar="N", help="workers per group")
    group_generator: str = option("smart", choices=("random", "smart", "static"),
                                  help="random (a central Group Generator with a lock vector and FIFO queue), "
                                       "smart (Group Buffer, Global Division, Inter-Intra and the slow-worker "
                                       "filter) or static (a conflict-free schedule each worker computes alone)")
    group_buffer: bool = option(True, help="smart GG: switch the Group Buffer off")
    global_division: bool = option(True, help="smart GG: switch Global Division off")
    inter_intra: bool = option(True, help="smart GG: switch the Inter-Intra phases (by the graph's machine "
                                          "field) off")
    slow_filter: int = option(DEFAULT_SLOW_FILTER, minimum=0, metavar="C",
                              help="smart GG: leave out of a Global Division the workers C or more requests "
                                   "behind its initiator; 0 switches the filter off")


def restart_refusal(options: PragueOptions) -> str | None:
    if options.group_generator == "static":
        return ("--protocol prague --group-generator static cannot replace a dead worker (its schedule counts on "
                "every rank in every iteration); use random or smart")
    return None


__all__ = ["DEFAULT_GROUP_SIZE", "DEFAULT_SLOW_FILTER", "PragueOptions", "restart_refusal"]

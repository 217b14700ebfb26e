"""DiLoCo's options and message kinds: what the algorithm and the declaration (:mod:`.spec`)
both read. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from hopnet.errors import ConfigError
from hopnet.options import ProtocolOptions, option
from hopnet.protocols.compression import COMPRESSIONS

READY_KIND = "diloco_ready"
"""Under ``--outer-quorum``, rank -> every rank: ``meta["n"]``, the pseudo-gradients it has announced
so far (this one included); ``meta["done"]``: it finished training and announces no more
(:mod:`hopnet.protocols.diloco.quorum`)."""

@dataclass(frozen=True)
class DiLoCoOptions(ProtocolOptions):
    local_steps: int = option(10, minimum=1, metavar="H",
                              help="inner steps (the trainer's optimizer) between two outer steps")
    outer_lr: float = option(0.7, minimum=0.0, metavar="LR", help="the outer optimizer's learning rate")
    outer_momentum: float = option(0.9, minimum=0.0, metavar="M", help="the outer optimizer's momentum (0: none)")
    outer_nesterov: bool = option(True, help="plain momentum in the outer step instead of Nesterov's")
    compress: str = option("none", choices=COMPRESSIONS,
                           help="compress every hop of the ring's all-reduce (diloco: of the pseudo-gradients): "
                                "trunc16 keeps the top 16 bits of each float32 (2x fewer bytes), int8 quantizes "
                                "with scale max|block|/127 (4x)")
    fragments: int = option(1, minimum=1, metavar="F",
                            help="streaming DiLoCo: sync the model in F fragments on staggered schedules")
    overlap_steps: int | None = option(None, minimum=0, metavar="D",
                                       help="inner steps a fragment's all-reduce runs behind before its outer step "
                                            "is applied (default 1 with --fragments > 1, else 0: the sync blocks)")

    outer_quorum: int | None = option(None, minimum=1, metavar="P",
                                      help="close each outer round over the first P ready workers; a late worker's "
                                           "pseudo-gradient joins a later round, weighted 1/(1+staleness) "
                                           "(default: every worker)")
    max_stale_rounds: int = option(2, minimum=0, metavar="S",
                                   help="with --outer-quorum: no round closes without a worker whose "
                                        "pseudo-gradient would then be more than S rounds stale")

    def check(self) -> None:
        if self.outer_quorum is not None and (self.fragments != 1 or self.overlap()):
            raise ConfigError("--outer-quorum takes neither --fragments nor --overlap-steps")
        if self.outer_momentum >= 1:
            raise ConfigError(f"--outer-momentum must be < 1 (got {self.outer_momentum!r})")
        if self.fragments > self.local_steps:
            raise ConfigError(f"--fragments {self.fragments} must be at most --local-steps {self.local_steps}")
        if self.overlap() >= self.local_steps:
            raise ConfigError(f"--overlap-steps {self.overlap()} must be below --local-steps {self.local_steps} "
                              "(a fragment's reduction must land before its next sync)")

    def check_ranks(self, world_size: int) -> None:
        if self.outer_quorum is not None and self.outer_quorum > world_size:
            raise ConfigError(f"--outer-quorum {self.outer_quorum} is more than the {world_size} workers")

    def overlap(self) -> int:
        if self.overlap_steps is not None:
            return self.overlap_steps
        return 1 if self.fragments > 1 else 0

    def settings(self) -> list[str]:
        shown = [f"H={self.local_steps}", f"outer lr {self.outer_lr:g}",
                 f"momentum {self.outer_momentum:g}{' nesterov' if self.outer_nesterov else ''}"]
        if self.compress != "none":
            shown.append(f"compress {self.compress}")
        if self.fragments > 1:
            shown.append(f"{self.fragments} fragments, overlap {self.overlap()}")
        if self.outer_quorum is not None:
            shown.append(f"quorum {self.outer_quorum}, at most {self.max_stale_rounds} rounds stale")
        return shown


def sync_offsets(local_steps: int, fragments: int) -> list[int]:
    """Fragment ``f`` syncs after iteration ``t`` when ``(t + 1 + offset[f]) % H == 0``."""
    return [f * local_steps // fragments for f in range(fragments)]


def sync_interval(local_steps: int, fragments: int) -> int:
    """The most iterations between two consecutive syncs (of any fragments)."""
    offsets = sync_offsets(local_steps, fragments)
    return max([b - a for a, b in zip(offsets, offsets[1:])] + [local_steps - offsets[-1] + offsets[0]])


__all__ = ["DiLoCoOptions", "READY_KIND", "sync_interval", "sync_offsets"]

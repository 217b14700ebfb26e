"""Collective operations among groups of ranks formed on the fly (see :mod:`.base`)."""

from hopnet.collectives.base import REDUCE_OPS, Collective, ReduceOp, check_group

__all__ = ["REDUCE_OPS", "Collective", "ReduceOp", "check_group"]

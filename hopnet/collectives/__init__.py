"""Collective operations among groups of ranks formed on the fly (see :mod:`.base`).

:class:`~hopnet.collectives.ring.RingCollective` (``hopnet.collectives.ring``) runs over the
node's own messages; import it from there (it needs the runtime, this package's base does not).
"""

from hopnet.collectives.base import REDUCE_OPS, Collective, ReduceOp, check_group
from hopnet.collectives.codec import Codec, IdentityCodec

__all__ = ["REDUCE_OPS", "Codec", "Collective", "IdentityCodec", "ReduceOp", "check_group"]

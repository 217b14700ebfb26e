"""allreduce's options and message kinds: what the algorithm and the declaration (:mod:`.spec`)
both read. Imports no torch."""

from __future__ import annotations

from hopnet.protocols.gradient_options import BucketOptions

AllReduceOptions = BucketOptions

__all__ = ["AllReduceOptions"]



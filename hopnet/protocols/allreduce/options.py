"""allreduce's options and message kinds, which the algorithm and the declaration (:mod:`.spec`) both read. Imports no torch."""


from __future__ import annotations


from hopnet.protocols.gradient_options import BucketOptions

AllReduceOptions = BucketOptions


__all__ = ["AllReduceOptions"]

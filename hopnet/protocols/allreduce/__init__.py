"""Synchronous all-reduce of the gradients among all ranks: the DDP baseline.

Modules: ``spec`` (the declaration), ``options``, ``protocol`` (the algorithm).
The registry imports ``spec`` only (no torch); ``spec`` imports ``protocol`` when a run builds one,
and ``protocol`` reads ``options``, never ``spec``.
"""

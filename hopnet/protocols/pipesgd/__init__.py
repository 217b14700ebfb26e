"""Pipe-SGD (Li et al., NeurIPS'18): the all-reduce of iteration k runs behind the compute of
the next K-1 iterations, with light gradient compression.

Modules: ``spec`` (the declaration), ``options``, ``protocol`` (the algorithm).
The registry imports ``spec`` only (no torch); ``spec`` imports ``protocol`` when a run builds one,
and ``protocol`` reads ``options``, never ``spec``.
"""

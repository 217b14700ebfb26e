"""Partial Reduce (Miao et al., SIGMOD'21): a controller forms groups of the first P ready workers,
which average with staleness-aware weights.

Modules: ``spec``, ``options``, ``protocol``, and its coordinator: ``controller`` (the sans-IO state
machine), ``weights`` (staleness-aware weights), ``window`` (the group-frozen filter's components),
``mixing`` (the mixing matrices of its rounds).
The registry imports ``spec`` only (no torch); ``spec`` imports ``protocol`` when a run builds one,
and ``protocol`` reads ``options``, never ``spec``.
"""

"""Hop (Luo et al., ASPLOS'19): update queues tagged by iteration, token queues bounding the iteration
gap, backup workers, bounded staleness and iteration skipping.

Modules: ``spec`` (the declaration), ``options``, ``protocol`` (the algorithm), ``queues`` (update and token
queues), ``mix_sums`` (the weighted sums updates are mixed into).
The registry imports ``spec`` only (no torch); ``spec`` imports ``protocol`` when a run builds one,
and ``protocol`` reads ``options``, never ``spec``.
"""

"""AD-PSGD (Lian et al., ICML'18): atomic pairwise model averaging between the two sides of a
bipartite graph, free of deadlock.

Modules: ``spec`` (the declaration), ``options``, ``protocol`` (the algorithm).
The registry imports ``spec`` only (no torch); ``spec`` imports ``protocol`` when a run builds one,
and ``protocol`` reads ``options``, never ``spec``.
"""

"""DiLoCo: H local steps, then an outer Nesterov step on the averaged pseudo-gradient (optionally
streamed in fragments, and among a quorum).

Modules: ``spec``, ``options``, ``protocol``, ``quorum`` (the outer step among a quorum of ready workers).
The registry imports ``spec`` only (no torch); ``spec`` imports ``protocol`` when a run builds one,
and ``protocol`` reads ``options``, never ``spec``.
"""

"""Prague (Luo et al., ASPLOS'20): Partial All-Reduce in groups a Group Generator forms (random,
smart, or a static schedule).

Modules: ``spec``, ``options``, ``protocol``, and the Group Generators it runs as a coordinator:
``random_gg``, ``smart_gg``, ``static_schedule``.
The registry imports ``spec`` only (no torch); ``spec`` imports ``protocol`` when a run builds one,
and ``protocol`` reads ``options``, never ``spec``.
"""

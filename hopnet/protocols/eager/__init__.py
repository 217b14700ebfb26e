"""eager-SGD (Li et al., PPoPP'20): solo and majority partial all-reduce of the gradients.

Modules: ``spec`` (the declaration), ``options``, ``protocol`` (the algorithm: the trainer's side), built on
``rounds`` (the activations and the round engine, with the protocol's state).
The registry imports ``spec`` only (no torch); ``spec`` imports ``protocol`` when a run builds one,
and ``protocol`` reads ``options``, never ``spec``.
"""

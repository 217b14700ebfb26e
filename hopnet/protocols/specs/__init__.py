"""The built-in protocols' declarations: one module per algorithm module of :mod:`hopnet.protocols`.

A declaration (:class:`hopnet.registry.ProtocolSpec`: name, options, checks on a graph, gap
bound, coordinator, message kinds) imports no torch, so the command line, the argument
checks and ``hopnet launch --help`` never load it; its ``build`` imports the algorithm when a
run makes its protocol. The registry finds the built-in protocols by importing every module
of this package (docs/design.md, "Adding a protocol").
"""

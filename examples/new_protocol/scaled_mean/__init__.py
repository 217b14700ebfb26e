"""scaled-mean: every rank applies the mean of all ranks' gradients times ``--scale-by``.

A toy protocol, complete as a package: copy this folder into ``hopnet/protocols/`` and
`hopnet launch --protocol scaled-mean`, `hopnet simulate` and ``hopnet.init(protocol=...)``
know it, with its flag, its ``HOPNET_SCALE_BY`` variable and its keyword (docs/design/adding-a-protocol.md).
"""

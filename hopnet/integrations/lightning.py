"""hopnet under PyTorch Lightning (the ``lightning`` package): ``Trainer(strategy=HopnetStrategy())``.

::

    trainer = lightning.Trainer(strategy=HopnetStrategy(protocol="hop"), max_steps=300)
    trainer.fit(module, datamodule)      # in a script started by `hopnet launch --nproc 4`

How it works: :mod:`hopnet.integrations._lightning`; what it supports: docs/guides/lightning.md.
For the older ``pytorch_lightning`` namespace, import :mod:`hopnet.integrations.pytorch_lightning`.
"""

from __future__ import annotations

import lightning.pytorch as pl

from hopnet.integrations._lightning import strategy_class

HopnetStrategy = strategy_class(pl)
HopnetStrategy.__module__ = __name__

__all__ = ["HopnetStrategy"]

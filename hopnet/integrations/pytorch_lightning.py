"""hopnet under PyTorch Lightning's older namespace (the ``pytorch_lightning`` package): the same
strategy as :mod:`hopnet.integrations.lightning`, built on ``pytorch_lightning``'s classes, for
``pytorch_lightning.Trainer(strategy=HopnetStrategy())``."""

from __future__ import annotations

import pytorch_lightning as pl

from hopnet.integrations._lightning import strategy_class

HopnetStrategy = strategy_class(pl)
HopnetStrategy.__module__ = __name__

__all__ = ["HopnetStrategy"]

"""Training protocols: algorithm only, no sockets (see :mod:`hopnet.protocols.base`).

Each protocol is one module here that ends by declaring itself (:func:`hopnet.registry.register`);
adding a protocol is adding a module (docs/design.md, "Adding a protocol")."""

from __future__ import annotations

import torch

from hopnet.config import ProtocolConfig
from hopnet.params import FlatGradients
from hopnet.protocols.base import Protocol


def make_protocol(config: ProtocolConfig, params: torch.Tensor | None,
                  grads: FlatGradients | torch.Tensor | None = None) -> Protocol:
    """The protocol object ``config.protocol`` names, for one worker.

    ``params`` is the flat parameter buffer (protocols that average models mix it);
    ``grads`` the flat gradients (protocols that average gradients reduce them)."""
    return config.spec.build(config, config.options, params, grads)


__all__ = ["Protocol", "make_protocol"]

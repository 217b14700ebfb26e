"""Training protocols: algorithm only, no sockets (see :mod:`hopnet.protocols.base`).

Each protocol is one module here that ends by declaring itself (:func:`hopnet.registry.register`);
adding a protocol is adding a module (docs/design.md, "Adding a protocol")."""

from __future__ import annotations

import torch

from hopnet.config import ProtocolConfig
from hopnet.model_state import ModelState
from hopnet.params import FlatGradients
from hopnet.protocols.base import Protocol


def make_protocol(config: ProtocolConfig, model: ModelState | torch.Tensor | None,
                  grads: FlatGradients | torch.Tensor | None = None) -> Protocol:
    """The protocol object ``config.protocol`` names, for one worker.

    ``model`` holds the model's flat tensors (a bare tensor is a model of parameters only):
    protocols that average models mix all of them, the others keep its buffers in step;
    ``grads`` the flat gradients (protocols that average gradients reduce them)."""
    state = ModelState.wrap(model)
    protocol = config.spec.build(config, config.options, state, grads)
    protocol.model = state
    return protocol


__all__ = ["Protocol", "make_protocol"]

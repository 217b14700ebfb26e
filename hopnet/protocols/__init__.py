"""Training protocols: algorithm only, no sockets (see :mod:`hopnet.protocols.base`).

Each protocol is one algorithm module here, declared (:func:`hopnet.registry.register`) by the
module of the same name in :mod:`hopnet.protocols.specs`, which imports no torch; adding a
protocol is adding the two (docs/design.md, "Adding a protocol"). This package's own import
loads no torch either: the declarations sit below it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
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
    from hopnet.model_state import ModelState

    state = ModelState.wrap(model)
    protocol = config.spec.build(config, config.options, state, grads)
    protocol.model = state
    return protocol


__all__ = ["make_protocol"]

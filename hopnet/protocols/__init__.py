"""Training protocols: algorithm only, no sockets (see :mod:`hopnet.protocols.base`).

Each protocol is a package here holding everything that is only its own: ``spec`` (its
declaration, :func:`hopnet.registry.register`; imports no torch), ``options``, ``protocol`` (the
algorithm) and its own parts (Hop's queues, Prague's Group Generators, Partial Reduce's
controller). Adding a protocol is adding a package (docs/design/adding-a-protocol.md). The
modules at this level are what several protocols share: the interface (``base``), the gradient
protocols' machinery (``gradient``, ``overlap``, ``buffer_sync``, ``resync``) and shared
declarations (``local_steps``, ``gradient_options``, ``compression``). This package's own import
loads no torch.
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

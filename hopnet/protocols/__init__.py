"""Training protocols: algorithm only, no sockets (see :mod:`hopnet.protocols.base`)."""

from __future__ import annotations

import torch

from hopnet.config import ProtocolConfig
from hopnet.params import FlatGradients
from hopnet.protocols.adpsgd import AdPsgdProtocol
from hopnet.protocols.allreduce import AllReduceProtocol
from hopnet.protocols.base import Protocol
from hopnet.protocols.eager import EagerProtocol
from hopnet.protocols.hop import HopProtocol
from hopnet.protocols.partial_reduce import PartialReduceProtocol
from hopnet.protocols.pipesgd import PipeSgdProtocol
from hopnet.protocols.prague import PragueProtocol


def make_protocol(config: ProtocolConfig, params: torch.Tensor | None,
                  grads: FlatGradients | torch.Tensor | None = None) -> Protocol:
    """The protocol object ``config.protocol`` names, for one worker.

    ``params`` is the flat parameter buffer (protocols that average models mix it);
    ``grads`` the flat gradients (protocols that average gradients reduce them)."""
    if config.protocol in ("hop", "notify-ack"):
        return HopProtocol(config, params)
    if config.protocol == "allreduce":
        return AllReduceProtocol(config, grads)
    if config.protocol == "eager-sgd":
        return EagerProtocol(config, params, grads)
    if config.protocol == "pipe-sgd":
        return PipeSgdProtocol(config, grads)
    if config.protocol == "ad-psgd":
        return AdPsgdProtocol(config, params)
    if config.protocol == "prague":
        return PragueProtocol(config, params)
    if config.protocol == "partial-reduce":
        return PartialReduceProtocol(config, params)
    raise ValueError(f"unknown protocol {config.protocol!r}")


__all__ = ["AdPsgdProtocol", "AllReduceProtocol", "EagerProtocol", "HopProtocol", "PartialReduceProtocol",
           "PipeSgdProtocol", "PragueProtocol", "Protocol",
           "make_protocol"]

"""Training protocols: algorithm only, no sockets (see :mod:`hopnet.protocols.base`)."""

from __future__ import annotations

import torch

from hopnet.config import ProtocolConfig
from hopnet.protocols.base import Protocol
from hopnet.protocols.hop import HopProtocol


def make_protocol(config: ProtocolConfig, params: torch.Tensor | None) -> Protocol:
    """The protocol object ``config.protocol`` names, for one worker."""
    if config.protocol in ("hop", "notify-ack"):
        return HopProtocol(config, params)
    raise ValueError(f"unknown protocol {config.protocol!r}")


__all__ = ["HopProtocol", "Protocol", "make_protocol"]

"""hopnet: decentralized, heterogeneity-tolerant data-parallel training for PyTorch.

Names are imported on first use, so light modules (the launcher, the graph tools)
start without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "init": "hopnet.api",
    "Worker": "hopnet.api",
    "AsyncWorker": "hopnet.api",
    "DistributedOptimizer": "hopnet.optim",
    "NonFiniteError": "hopnet.errors",
    "ProtocolConfig": "hopnet.config",
    "ConfigError": "hopnet.errors",
    "GraphError": "hopnet.errors",
    "HopnetError": "hopnet.errors",
    "PeerFailure": "hopnet.errors",
    "WaitTimeout": "hopnet.errors",
    "Graph": "hopnet.graph",
    "ModelState": "hopnet.model_state",
    "flatten_parameters": "hopnet.params",
}

__all__ = [
    "AsyncWorker", "ConfigError", "DistributedOptimizer", "Graph", "GraphError", "HopnetError", "ModelState",
    "NonFiniteError", "PeerFailure", "ProtocolConfig", "WaitTimeout", "Worker", "flatten_parameters", "init",
]

if TYPE_CHECKING:
    from hopnet.api import AsyncWorker, Worker, init
    from hopnet.optim import DistributedOptimizer
    from hopnet.config import ProtocolConfig
    from hopnet.errors import ConfigError, GraphError, HopnetError, NonFiniteError, PeerFailure, WaitTimeout
    from hopnet.graph import Graph
    from hopnet.model_state import ModelState
    from hopnet.params import flatten_parameters


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hopnet' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

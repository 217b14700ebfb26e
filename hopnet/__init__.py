"""hopnet: decentralized, heterogeneity-tolerant data-parallel training for PyTorch."""

from hopnet.api import DistributedOptimizer, Worker, init
from hopnet.config import ProtocolConfig
from hopnet.errors import ConfigError, GraphError, HopnetError, PeerFailure, WaitTimeout
from hopnet.graph import Graph
from hopnet.params import flatten_parameters

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DistributedOptimizer",
    "Graph",
    "GraphError",
    "HopnetError",
    "PeerFailure",
    "ProtocolConfig",
    "WaitTimeout",
    "Worker",
    "flatten_parameters",
    "init",
]

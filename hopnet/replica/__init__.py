"""Replica groups: several processes act as one worker of the graph (docs/design/replicas.md).

Inside a replica, DDP's or FSDP's semantics over a torch.distributed group of its own; between
replicas, the run's protocol, on shards: process ``m`` of a replica runs a lane of the protocol
on shard ``m`` of the model, with process ``m`` of each neighbour replica. :mod:`.layout` is the
arithmetic (no torch); the rest is built where ``hopnet.init`` runs.
"""

from hopnet.replica.layout import MODES, ReplicaLayout

__all__ = ["MODES", "ReplicaLayout"]

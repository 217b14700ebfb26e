"""A replica group made where ``hopnet.init`` runs: its process group, then DDP's or FSDP's side
of the model, and this member's lane tensors (:class:`~hopnet.replica.base.ReplicaSync`)."""

from __future__ import annotations

import torch

from hopnet.errors import ConfigError
from hopnet.model_state import ModelState
from hopnet.params import FlatGradients
from hopnet.replica.base import ReplicaSync
from hopnet.replica.ddp import DdpReplica
from hopnet.replica.fsdp import FsdpReplica, _broadcast_module, shard_model
from hopnet.replica.agreement import LaneAgreement
from hopnet.replica.group import open_agreement_group, open_replica_group
from hopnet.replica.layout import ReplicaLayout
from hopnet.transports.zmq.malloc import prefer_low_memory


def build_replica(layout: ReplicaLayout, process: int, module: torch.nn.Module | None, *, store_endpoint: str,
                  timeout_s: float, averages_models: bool, bind_host: str = "127.0.0.1",
                  lane_channels: int = 1, generation: int = 0) -> ReplicaSync:
    """This process's side of its replica group (blocks until every member has joined it);
    ``lane_channels``: 2 for a protocol whose lanes agree in two independent orders; ``generation``:
    the restart number of a replica that came back (its groups meet apart from the dead ones')."""
    sync = _build(layout, process, module, store_endpoint=store_endpoint, timeout_s=timeout_s,
                  averages_models=averages_models, generation=generation)
    side = None
    if lane_channels > 1:
        side = LaneAgreement(open_agreement_group(layout, process, store_endpoint, timeout_s, bind_host, channel=1,
                                                  generation=generation), layout.replicas)
    group = open_agreement_group(layout, process, store_endpoint, timeout_s, bind_host, generation=generation)
    sync.lanes = LaneAgreement(group, layout.replicas, side=side)
    return sync


def _build(layout: ReplicaLayout, process: int, module: torch.nn.Module | None, *, store_endpoint: str,
           timeout_s: float, averages_models: bool, generation: int = 0) -> ReplicaSync:
    if module is None:
        raise ConfigError("replica groups need hopnet.init(model): a bare params= tensor cannot be sharded")
    if not store_endpoint:
        raise ConfigError("replica groups need the run's c10d store (HOPNET_STORE, set by `hopnet launch`)")
    trainable = [p for p in module.parameters() if p.requires_grad]
    if not trainable:
        raise ConfigError("the model has no trainable parameters")
    device = trainable[0].device
    group = open_replica_group(layout, process, store_endpoint, device, timeout_s, generation)
    member, replica = layout.member_of(process), layout.replica_of(process)
    if layout.mode == "ddp":
        return DdpReplica(size=layout.size, member=member, replica_index=replica, group=group,
                          state=ModelState.of(module), grads=FlatGradients(module), averages_models=averages_models)
    prefer_low_memory()  # FSDP's per-module buffers handed back when freed, not kept in the heap
    _broadcast_module(module, group)  # one starting model per replica, then each member keeps its shards
    shard_model(module, group, device)
    buffers = ModelState.of(module, params=False)
    return FsdpReplica(size=layout.size, member=member, replica_index=replica, group=group, module=module,
                       buffers=buffers if buffers.flats else None, averages_models=averages_models)


__all__ = ["build_replica"]

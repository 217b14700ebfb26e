"""The process group of one replica: gloo on CPU, NCCL on GPU, made from the run's store.

It becomes torch.distributed's default group when the trainer has made none (then DDP's and
FSDP's defaults are the replica, and ``dist.get_world_size()`` is the replica's size). When the
trainer has already initialised torch.distributed over every process (torchrun users often
do), every process makes every replica's group with ``new_group``, in the same order, and keeps
its own.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hopnet.replica.layout import ReplicaLayout
from hopnet.rendezvous.store import connect_store, in_namespace

STORE_PREFIX = "hopnet/replica"


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def store_prefix(layout: ReplicaLayout, process: int, generation: int = 0) -> str:
    """Where a replica's groups meet in the run's store; a replica that came back (its members'
    ``HOPNET_RESTART=N``) meets under a prefix of its own, apart from the dead generation's keys."""
    replica = layout.replica_of(process)
    return f"{STORE_PREFIX}{replica}" if generation == 0 else f"{STORE_PREFIX}{replica}@{generation}"


def open_replica_group(layout: ReplicaLayout, process: int, store_endpoint: str, device: torch.device,
                       timeout_s: float, generation: int = 0) -> Any:
    """This process's replica group (blocks until every member has made it, or ``timeout_s``)."""
    backend = backend_for(device)
    timeout = timedelta(seconds=timeout_s)
    replica = layout.replica_of(process)
    if dist.is_initialized():
        if dist.get_world_size() != layout.processes:
            raise RuntimeError(f"torch.distributed is initialised over {dist.get_world_size()} processes, but the "
                               f"run has {layout.processes}: initialise it over all of them, or not at all")
        mine = None
        for r in range(layout.replicas):
            group = dist.new_group(list(layout.members(r)), timeout=timeout, backend=backend)
            if r == replica:
                mine = group
        return _kept(mine)
    store = connect_store(in_namespace(store_endpoint, store_prefix(layout, process, generation)), timeout_s)
    hook = sys.excepthook
    dist.init_process_group(backend, store=store, rank=layout.member_of(process), world_size=layout.size,
                            timeout=timeout)
    sys.excepthook = hook  # torch's would prefix a traceback with the member's index ("[rank0]"), not the rank
    return _kept(dist.group.WORLD)


def _kept(group: Any) -> Any:
    """``group``, never destroyed: it lives as long as the process, and a gloo group's destructor at the
    interpreter's exit (a script under torchrun exits that way) killed a worker now and then with
    std::terminate while its peer still talked to it. The process's exit ends its threads."""
    from hopnet.transports.torchdist import leave_behind

    leave_behind(group)
    return group


def open_agreement_group(layout: ReplicaLayout, process: int, store_endpoint: str, timeout_s: float,
                         bind_host: str, channel: int = 0, generation: int = 0) -> Any:
    """A gloo group of the replica's members for their lanes' agreements (:mod:`.agreement`), apart from
    the group DDP or FSDP use on the trainer's thread; ``channel`` tells a replica's groups apart."""
    from hopnet.transports.torchdist import build_group

    name = "agree" if channel == 0 else f"agree{channel}"
    store = connect_store(in_namespace(store_endpoint, f"{store_prefix(layout, process, generation)}/{name}"),
                          timeout_s)
    return _kept(build_group(store, "gloo", layout.member_of(process), layout.size, timeout_s=timeout_s,
                             host=bind_host))


__all__ = ["STORE_PREFIX", "backend_for", "open_agreement_group", "open_replica_group"]

"""A member's lane: the worker context it runs its protocol in, inside a run of replica groups.

Member ``m`` of replica ``r`` is rank ``r`` of lane ``m``: its graph is the run's (whose nodes are
the replicas), its peers are member ``m`` of each neighbour replica, and its process groups on
the torch plane are made under the store namespace ``lane{m}``, apart from the other lanes'.
The rendezvous stays the run's (every process registers under its process rank); the lane
keeps the addresses of its own members.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from hopnet.config import ProtocolConfig
from hopnet.bootstrap.env import Restarts
from hopnet.bootstrap.init import InitSpec, ModelTensors, WorkerContext
from hopnet.errors import ConfigError
from hopnet.registry import Averages
from hopnet.replica.base import NO_REPLICA, ReplicaSync
from hopnet.replica.setup import build_replica
from hopnet.replica.support import replica_refusal
from hopnet.rendezvous.store import in_namespace
from hopnet.replica.layout import ReplicaLayout
from hopnet.runtime.node import AddressExchange


@dataclass
class LaneContext(WorkerContext):
    """A :class:`WorkerContext` whose rank, world and store are its lane's."""

    layout: ReplicaLayout = ReplicaLayout()
    member: int = 0
    process: int = 0

    def exchange(self, config: ProtocolConfig, restart: int = 0) -> AddressExchange:
        everyone = super().exchange(config, restart)
        layout, member = self.layout, self.member

        async def lane(address: str) -> dict[int, str]:
            addresses = await everyone(address)
            return {r: addresses[layout.process(r, member)] for r in range(layout.replicas)}
        return lane


def lane_context(context: WorkerContext, layout: ReplicaLayout) -> LaneContext:
    """``context`` (a process's, under its launcher) as its lane sees it."""
    process = context.rank
    member = layout.member_of(process)
    fields = {f.name: getattr(context, f.name) for f in dataclasses.fields(WorkerContext)}
    fields.update(rank=layout.replica_of(process), world_size=layout.replicas,
                  store_endpoint=in_namespace(context.store_endpoint, f"lane{member}") if context.store_endpoint else "")
    return LaneContext(**fields, layout=layout, member=member, process=process)


def place_in_replica(spec: InitSpec, context: WorkerContext, config: ProtocolConfig
                     ) -> tuple[WorkerContext, ModelTensors, ReplicaSync]:
    """The context this process's node runs in, the tensors it moves and its replica group: a lane of a
    replica when ``HOPNET_REPLICA_SIZE`` groups the processes, else ``context``, the model's flat
    tensors and :data:`~hopnet.replica.base.NO_REPLICA`."""
    layout = ReplicaLayout.from_environ(os.environ, context.world_size)
    if not layout.grouped:
        return context, ModelTensors.of(spec.model, spec.params), NO_REPLICA
    refusal = replica_refusal(config)
    if refusal is not None:
        raise ConfigError(refusal)
    replica = build_replica(layout, context.rank, spec.model, store_endpoint=context.store_endpoint,
                            timeout_s=config.timeout_s, averages_models=config.spec.averages is Averages.MODELS,
                            bind_host=context.bind_host, lane_channels=config.spec.lane_channels,
                            generation=Restarts.from_environ(os.environ).this)
    return lane_context(context, layout), ModelTensors(replica.lane_model, replica.lane_grads), replica


def event_log_path(run_dir: str, context: WorkerContext) -> Path:
    """Where this process's node logs: ``rank{R}.jsonl``, or its lane's file in a run of replica groups."""
    if isinstance(context, LaneContext):
        path = context.layout.log_path(Path(run_dir), context.process)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path
    return Path(run_dir) / f"rank{context.rank}.jsonl"


__all__ = ["LaneContext", "event_log_path", "lane_context", "place_in_replica"]

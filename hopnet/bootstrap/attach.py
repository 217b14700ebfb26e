"""Joining a run that torchrun or srun started: everything `hopnet launch` would have set.

:func:`attach` turns an :class:`~hopnet.bootstrap.external.ExternalEnv` into an
:class:`AttachedRun`: the graph (``graph=`` of :func:`hopnet.init`, else ``HOPNET_GRAPH``,
a JSON path or a builder spec such as ``ring:4``, else a ring over the world), the
protocol options (``HOPNET_*`` variables, :mod:`hopnet.bootstrap.env_options`), the host to
bind (``HOPNET_BIND``, else the local address on the route to the master), the run's
store (torchrun's agent store, or one rank 0 hosts) and the run directory (``HOPNET_RUN_DIR``,
else a fresh ``runs/...`` that rank 0 names and shares through the store).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hopnet.config import ProtocolConfig
from hopnet.errors import ConfigError
from hopnet.graph import Graph
from hopnet.bootstrap.env import BIND, GRAPH, RUN_DIR
from hopnet.bootstrap.env_options import config_from_variables
from hopnet.bootstrap.external import ExternalEnv, route_address
from hopnet.bootstrap.run_name import graph_label, make_run_dir
from hopnet.rendezvous.store import HostedStore, connect_store, host_store
from hopnet.rendezvous.via_store import StoreRendezvous
from hopnet.replica.layout import ReplicaLayout

STORE_CONNECT_S = 120.0
"""How long a rank waits for the run's store to answer (rank 0 may start last)."""
FINISH_WAIT_S = 30.0
"""How long the rank hosting the store keeps it for ranks still closing."""


def resolve_graph_argument(graph: Graph | str | os.PathLike[str] | None, environ: Mapping[str, str],
                           world_size: int) -> Graph:
    """``graph=`` of :func:`hopnet.init`, else ``HOPNET_GRAPH``, else a ring over the world."""
    spec: Graph | str | os.PathLike[str] | None = graph
    where = "graph="
    if spec is None and environ.get(GRAPH, "").strip():
        spec, where = environ[GRAPH].strip(), GRAPH
    if spec is None:
        return Graph.ring(world_size)
    g = spec if isinstance(spec, Graph) else Graph.load(os.fspath(spec))
    if g.n != world_size:
        raise ConfigError(f"{where} {g.name or os.fspath(spec) if not isinstance(spec, Graph) else g.name or 'graph'} "
                          f"has {g.n} nodes but the launcher started {world_size} workers")
    return g


@dataclass
class AttachedRun:
    """One worker's share of a run another launcher started."""

    external: ExternalEnv
    graph: Graph
    flags: ProtocolConfig
    explicit: tuple[str, ...]
    bind_host: str
    store_endpoint: str
    rendezvous: StoreRendezvous
    hosted: HostedStore | None
    run_dir: str = ""

    @property
    def rank(self) -> int:
        return self.external.rank

    @property
    def world_size(self) -> int:
        return self.external.world_size

    def open_run_dir(self, protocol: str, timeout_s: float) -> str:
        """Rank 0 names the run directory (and writes ``graph.json``); every rank learns it."""
        chosen: str | None = None
        if self.rank == 0:
            given = os.environ.get(RUN_DIR, "").strip() or None
            path = make_run_dir(given, protocol, graph_label(self.graph, None))
            self.graph.to_json(path / "graph.json")
            chosen = str(path.resolve())
        self.run_dir = self.rendezvous.share("run_dir", chosen, timeout_s)
        Path(self.run_dir).mkdir(parents=True, exist_ok=True)  # another machine: its own copy
        return self.run_dir

    def share_coordinator(self, start: Callable[[], Mapping[str, str]] | None, timeout_s: float) -> dict[str, str]:
        """Rank 0 starts the run's coordinator with ``start`` (which returns the
        ``HOPNET_COORDINATOR*`` variables naming it; ``None``: the protocol has none) and
        shares them; every rank returns them, to set before its node starts.

        Under torchrun or srun there is no launcher process of hopnet's own: rank 0's process
        hosts the coordinator, as node 0's launcher does under `hopnet launch`."""
        chosen = json.dumps(dict(start()) if start is not None else {}) if self.rank == 0 else None
        return {str(k): str(v) for k, v in json.loads(self.rendezvous.share("coordinator", chosen, timeout_s)).items()}

    async def exchange(self, address: str, config: dict[str, Any], timeout_s: float) -> dict[int, str]:
        return await asyncio.to_thread(self.rendezvous.exchange, address, config, timeout_s)

    def finish(self, aborted: bool = False) -> None:
        """Leave the store; rank 0 (when it hosts it) serves it until every rank left."""
        self.rendezvous.finish(0.0 if aborted else FINISH_WAIT_S)
        if self.hosted is not None:
            self.hosted.close()
            self.hosted = None


def attach(external: ExternalEnv, graph: Graph | str | os.PathLike[str] | None,
           environ: Mapping[str, str]) -> AttachedRun:
    replicas = ReplicaLayout.from_environ(environ, external.world_size).replicas  # the graph's nodes
    g = resolve_graph_argument(graph, environ, replicas)
    flags, explicit = config_from_variables(environ)
    bind = environ.get(BIND, "").strip() or route_address(external.master_addr, external.master_port)
    hosted: HostedStore | None = None
    if external.hosts_store:
        hosted = host_store(external.master_addr, external.master_port)
    store: dist.TCPStore = hosted.store if hosted is not None and hosted.store is not None \
        else connect_store(external.store_endpoint, STORE_CONNECT_S)
    rendezvous = StoreRendezvous(store, prefix=external.key_prefix, rank=external.rank,
                                 world_size=external.world_size, endpoint=external.store_endpoint)
    return AttachedRun(external, g, flags, explicit, bind, external.store_endpoint, rendezvous, hosted)


__all__ = ["AttachedRun", "attach", "resolve_graph_argument"]

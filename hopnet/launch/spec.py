"""What a launch was asked to do (:class:`~hopnet.launch.settings.LaunchSpec`, declared in
:mod:`hopnet.launch.settings`) and what it resolves to (:class:`LaunchPlan`).

:func:`validate` is the launcher's first phase: it checks every input and resolves the
graph, the worker command, the protocol's coordinator and this machine's ranks, raising
:class:`ConfigError` with a one-line message before anything is created (no run
directory, no socket, no process).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from hopnet.config import ProtocolConfig
from hopnet.config_checks import check_config_for_graph
from hopnet.coordinator import make_coordinator
from hopnet.errors import ConfigError
from hopnet.elastic.settings import ElasticSettings
from hopnet.elastic.support import elastic_refusal
from hopnet.graph import Graph
from hopnet.graph.source import GraphSource
from hopnet.bootstrap.env import WorkerEnv
from hopnet.launch.nodes import place_ranks
from hopnet.launch.options import option_names
from hopnet.launch.settings import (
    DEFAULT_GRACE_S,
    DEFAULT_NPROC,
    DEFAULT_SETTLE_S,
    START_METHODS,
    GraphArgument,
    LaunchSpec,
    check_settings,
)
from hopnet.registry import lookup, specs
from hopnet.replica.layout import ReplicaLayout
from hopnet.replica.support import replica_refusal, replica_restart_refusal

WORKER_ENTRY = (sys.executable, "-m", "hopnet.bootstrap.worker_main")
"""Every worker runs its script through :mod:`hopnet.bootstrap.worker_main`."""
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclass(frozen=True)
class NodePlan:
    """The ranks this launcher runs: ``rank_offset .. rank_offset + nproc - 1`` of ``world_size``,
    or the ranks ``placed`` on this machine (see :func:`hopnet.launch.nodes.place_ranks`).

    With one machine ``rank_offset`` is 0 and ``nproc == world_size``.
    """

    world_size: int
    nproc: int
    node_rank: int = 0
    rank_offset: int = 0
    placed: tuple[int, ...] | None = None

    @property
    def ranks(self) -> Sequence[int]:
        if self.placed is not None:
            return self.placed
        return range(self.rank_offset, self.rank_offset + self.nproc)

    def worker_env(self, rank: int, *, graph_path: str, rendezvous: str, run_dir: str,
                   config_json: str, bind: str, explicit_options: tuple[str, ...] = ()) -> WorkerEnv:
        return WorkerEnv(rank=rank, world_size=self.world_size, local_rank=list(self.ranks).index(rank),
                         graph_path=graph_path, rendezvous=rendezvous, run_dir=run_dir,
                         config_json=config_json, bind_host=bind, node_rank=self.node_rank,
                         explicit_options=explicit_options)


@dataclass(frozen=True)
class LaunchPlan:
    """A validated :class:`LaunchSpec`, resolved: what the later phases run."""

    spec: LaunchSpec
    config: ProtocolConfig
    command: list[str]
    """The argv every worker starts with (:data:`WORKER_ENTRY` then the script and its arguments)."""
    graph: Graph
    nodes: NodePlan
    bind: str
    coordinator_name: str | None
    """The protocol's coordinator (:func:`hopnet.coordinator.make_coordinator`), if it has one."""
    notes: list[str] = field(default_factory=list)
    """What :func:`check_config_for_graph` noted about the options on this graph."""
    elastic: ElasticSettings | None = None
    """Set when the run is elastic (``--min-nproc``/``--max-nproc``)."""
    replicas: ReplicaLayout = ReplicaLayout()
    """The replica groups (one process each unless ``--replica-size``): ranks are processes, the graph's
    nodes replicas."""

    @property
    def world_size(self) -> int:
        return self.nodes.world_size

    @property
    def explicit_options(self) -> tuple[str, ...]:
        return tuple(sorted(self.spec.explicit_options))


def resolve_graph(graph: GraphArgument, nproc: int | None) -> tuple[Graph, int]:
    """The graph and the number of workers, checked against each other.

    ``graph`` is a :class:`Graph`, a JSON path, a builder spec (``ring:4``), or ``None``
    for a ring over ``nproc`` workers (``nproc`` defaults to the graph's size, or 4).
    """
    if nproc is not None and (not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1):
        raise ConfigError(f"--nproc must be an integer >= 1 (got {nproc!r})")
    if graph is None:
        n = DEFAULT_NPROC if nproc is None else nproc
        return Graph.ring(n), n
    if isinstance(graph, Graph):
        g = graph
        label = g.name or "the graph"
    else:
        label = os.fspath(graph)
        g = Graph.load(label)
    if nproc is not None and nproc != g.n:
        raise ConfigError(f"--nproc {nproc} does not match the graph {label} ({g.n} nodes)")
    return g, g.n


def worker_command(script: str | os.PathLike[str], script_args: Sequence[str], module: bool) -> list[str]:
    """The command line of every worker: the script (or ``-m MODULE``) run through :data:`WORKER_ENTRY`."""
    script_text = os.fspath(script)
    if module:
        if not _MODULE_NAME.fullmatch(script_text):
            raise ConfigError(f"-m {script_text!r}: not a module name")
        return [*WORKER_ENTRY, "-m", script_text, *script_args]
    if not os.path.exists(script_text):
        raise ConfigError(f"script {script_text!r} not found")
    if os.path.isdir(script_text) and not os.path.exists(os.path.join(script_text, "__main__.py")):
        raise ConfigError(f"script {script_text!r} is a directory without __main__.py")
    return [*WORKER_ENTRY, script_text, *script_args]


def _node_plan(spec: LaunchSpec, graph: Graph, layout: ReplicaLayout) -> NodePlan:
    world_size = layout.processes
    if spec.single_machine:
        return NodePlan(world_size=world_size, nproc=world_size)
    if spec.rdzv_endpoint is None:
        raise ConfigError("--nnodes above 1 needs --rdzv-endpoint HOST:PORT (node 0's address, "
                          "reachable from every machine)")
    # the graph's nodes are placed on the machines; a replica's processes go where its node goes
    placed = tuple(p for replica in place_ranks(graph, spec.nnodes, spec.node_rank) for p in layout.members(replica))
    return NodePlan(world_size=world_size, nproc=len(placed), node_rank=spec.node_rank, placed=placed)


def validate(spec: LaunchSpec) -> LaunchPlan:
    """Check ``spec`` and resolve it; the first problem found raises :class:`ConfigError`."""
    config = spec.config if spec.config is not None else ProtocolConfig()
    if not isinstance(config, ProtocolConfig):
        raise ConfigError(f"config must be a ProtocolConfig (got {type(config).__name__})")
    config.validate()
    command = worker_command(spec.script, spec.script_args, spec.module)
    if not isinstance(spec.bind, str) or not spec.bind.strip():
        raise ConfigError(f"--bind {spec.bind!r}: expected a host name or address")
    check_settings(spec)
    max_restarts = spec.max_restarts
    if spec.resume and (spec.run_dir is None or spec.overwrite):
        raise ConfigError("resume needs the run directory to resume, and cannot --overwrite it")
    if spec.resume and not lookup(config.protocol).resumable:
        takers = ", ".join(s.name for s in specs() if s.resumable)
        raise ConfigError(f"--resume: --protocol {config.protocol} cannot resume from checkpoints yet ({takers} can)")
    if max_restarts and (refusal := config.spec.refuses_restarts(config.options)) is not None:
        raise ConfigError(f"--max-restarts: {refusal}")  # as the workers would, before anything starts
    if max_restarts and config.bulk == "torch":
        raise ConfigError("--max-restarts needs the ZeroMQ plane (CPU tensors, --bulk zmq or auto): "
                          "the torch plane's process groups cannot take a new process in")
    unknown = sorted(set(spec.explicit_options) - set(option_names()))
    if unknown:
        raise ConfigError(f"explicit_options: {unknown[0]!r} is not a protocol option")

    size = replica_size(spec)
    nproc = spec.nproc if spec.nproc is not None or spec.graph is not None or size == 1 else DEFAULT_NPROC
    if size > 1 and nproc is not None and nproc % size:
        raise ConfigError(f"--replica-size {size} does not divide --nproc {nproc}")
    if size > 1 and spec.graph is not None and nproc is not None:
        graph, replicas = resolve_graph(spec.graph, None)
        if replicas * size != nproc:
            raise ConfigError(f"--nproc {nproc} makes {nproc // size} replicas of {size} processes, but the graph "
                              f"has {replicas} nodes (one per replica)")
    else:
        graph, replicas = resolve_graph(spec.graph, None if nproc is None else nproc // size)
    layout = ReplicaLayout(size=size, mode=spec.replica_mode or "ddp", processes=replicas * size)
    if layout.grouped:
        check_replica_run(spec, config)
    notes = check_config_for_graph(config, graph)
    machine = make_coordinator(config, graph)  # the protocol's coordinator, if it needs one (refusals first too)
    max_failures = spec.max_failures
    if not isinstance(max_failures, int) or isinstance(max_failures, bool) or not 0 <= max_failures < replicas:
        noun = "replicas" if layout.grouped else "workers"
        raise ConfigError(f"--max-failures must be an integer from 0 to {replicas - 1} "
                          f"(there are {replicas} {noun}; got {max_failures!r})")
    return LaunchPlan(spec=spec, config=config, command=command, graph=graph,
                      nodes=_node_plan(spec, graph, layout), bind=spec.bind.strip(),
                      coordinator_name=machine.name if machine is not None else None, notes=notes,
                      elastic=elastic_settings(spec, config, replicas, layout.size), replicas=layout)


def replica_size(spec: LaunchSpec) -> int:
    """``--replica-size``; with ``--replica-mode`` alone under ``--nnodes``, one replica per machine."""
    if spec.replica_size is not None:
        return spec.replica_size
    if spec.replica_mode is None:
        return 1
    if spec.single_machine:
        raise ConfigError("--replica-mode needs --replica-size R on one machine (under --nnodes the default "
                          "replica is one machine)")
    if spec.nproc is None or spec.nproc % spec.nnodes:
        raise ConfigError(f"--replica-mode under --nnodes {spec.nnodes}: give --replica-size, or an --nproc that "
                          "the machines divide evenly (one replica per machine)")
    return spec.nproc // spec.nnodes


def check_replica_run(spec: LaunchSpec, config: ProtocolConfig) -> None:
    """What replica groups of several processes do not take yet, refused in one line each."""
    refusal = replica_refusal(config)
    if refusal is not None:
        raise ConfigError(refusal)
    refusal = replica_restart_refusal(config) if spec.max_restarts else None
    if refusal is not None:
        raise ConfigError(refusal)


def elastic_settings(spec: LaunchSpec, config: ProtocolConfig, world_size: int,
                     replica_size: int = 1) -> ElasticSettings | None:
    """``--min-nproc``/``--max-nproc``: the elastic run's settings, refused in one line when the graph,
    the protocol or the other flags cannot change membership mid-run (None: the run is not elastic).
    ``world_size``: the graph's nodes (workers, or replicas of ``replica_size`` processes: the flags
    count processes, the settings replicas)."""
    low, high = spec.min_nproc, spec.max_nproc
    if low is None and high is None:
        return None
    low = replica_size if low is None else low
    high = world_size * replica_size if high is None else high
    if replica_size > 1 and (low % replica_size or high % replica_size):
        raise ConfigError(f"--min-nproc {low}/--max-nproc {high}: an elastic run of replica groups grows and "
                          f"shrinks by whole replicas; give multiples of --replica-size {replica_size}")
    processes = world_size * replica_size
    if not low <= processes <= high:
        raise ConfigError(f"--min-nproc {low} and --max-nproc {high} must bracket the {processes} "
                          f"{'processes' if replica_size > 1 else 'workers'} the run starts with")
    source = GraphSource.from_argument(spec.graph)
    if source.builder is None:
        raise ConfigError(f"--min-nproc/--max-nproc: {source.label} is a fixed graph and cannot re-form when "
                          "workers join or leave: give a builder such as --graph ring or --graph torus")
    refusal = elastic_refusal(config, replica_size)
    if refusal is None and spec.max_restarts:
        refusal = "--max-restarts replaces a dead worker in place; an elastic run re-forms without it instead"
    if refusal is None and spec.nnodes > 1:
        refusal = "runs over several machines (--nnodes) cannot change membership yet; grow one with `hopnet join`"
    if refusal is not None:
        raise ConfigError(f"--min-nproc/--max-nproc: {refusal}")
    return ElasticSettings(graph=str(source.builder), min_nproc=low // replica_size, max_nproc=high // replica_size)


__all__ = ["DEFAULT_GRACE_S", "DEFAULT_NPROC", "DEFAULT_SETTLE_S", "START_METHODS", "GraphArgument", "LaunchPlan",
           "LaunchSpec", "NodePlan", "WORKER_ENTRY", "resolve_graph", "validate", "worker_command"]

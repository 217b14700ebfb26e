"""The phases of :func:`hopnet.init`, each callable alone; :func:`hopnet.api.init` drives them.

1. :func:`find_launcher`: who started this process, `hopnet launch` (``HOPNET_*``, see
   :class:`~hopnet.bootstrap.env.WorkerEnv`) or torchrun/srun (:mod:`hopnet.bootstrap.external`,
   joined through :mod:`hopnet.bootstrap.attach`): the rank, the world, the graph, the
   launcher's protocol options, the host to bind, the run's store, the run key;
2. :func:`resolve_options`: the options that run, from the launcher's, ``config=`` and keyword
   options, with the launcher's refusals (:mod:`hopnet.bootstrap.options`);
3. :func:`check_inputs`: the model and the options against the graph;
4. :func:`open_run`: the run directory, and under torchrun/srun the coordinator rank 0 hosts;
5. :func:`connect`: the transport and the collectives, for the model's tensors;
6. the node, assembled by :func:`hopnet.api.assemble_node` inside :class:`hopnet.api.Worker`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hopnet.config import ProtocolConfig
from hopnet.config_checks import check_config_for_graph
from hopnet.coordinator import make_coordinator
from hopnet.errors import ConfigError
from hopnet.graph import Graph
from hopnet.bootstrap.attach import AttachedRun, attach
from hopnet.bootstrap.coordinator_proc import CoordinatorProcess, CoordinatorStartError
from hopnet.bootstrap.env import JOIN, Restarts, WorkerEnv
from hopnet.bootstrap.external import detect
from hopnet.bootstrap.options import check_coordinator_options, check_explicit
from hopnet.rendezvous.client import exchange_addresses_async
from hopnet.model_state import ModelState
from hopnet.replica.layout import ReplicaLayout
from hopnet.params import FlatGradients
from hopnet.runtime.node import AddressExchange, CollectiveFactory
from hopnet.security import CurveKeys, keys_from_environ
from hopnet.transports.base import Transport
from hopnet.bootstrap.plane import collective_factory, make_transport
from hopnet.bootstrap.title import script_name, set_title, worker_title

COORDINATOR_STOP_GRACE_S = 5.0
"""How long the coordinator rank 0 hosts gets to write its summary when the worker closes."""

@dataclass(frozen=True)
class InitSpec:
    """What :func:`hopnet.init` was asked: the model (or flat ``params``), a whole ``config``,
    a ``graph``, and keyword ``options`` overriding single fields."""

    model: torch.nn.Module | None = None
    params: torch.Tensor | None = None
    config: ProtocolConfig | None = None
    graph: Graph | str | os.PathLike[str] | None = None
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class WorkerContext:
    """This worker's place in the run, as the launcher that started it set it up."""

    rank: int
    world_size: int
    graph: Graph
    flags: ProtocolConfig
    """The launcher's protocol options (command-line flags, or ``HOPNET_*`` variables)."""
    explicit: tuple[str, ...]
    """The options given explicitly to the launcher, which code may not change."""
    bind_host: str
    store_endpoint: str
    curve: CurveKeys | None
    """The run key when the launcher secured the run, else ``None``."""
    launched: WorkerEnv | None = None
    """Set under `hopnet launch`."""
    attached: AttachedRun | None = None
    """Set under torchrun or srun."""

    def exchange(self, config: ProtocolConfig, restart: int = 0) -> AddressExchange:
        """The address exchange of the node's start, announcing ``config`` to the other ranks.
        ``restart``: this process replaces its rank's dead worker, in a run whose table is complete."""
        announced = json.loads(config.to_json())
        attached, launched = self.attached, self.launched

        async def exchange(address: str) -> dict[int, str]:
            if attached is not None:
                return await attached.exchange(address, announced, config.timeout_s)
            assert launched is not None
            return await exchange_addresses_async(launched.rendezvous, launched.rank, launched.world_size, address,
                                                  config.timeout_s, config=announced, curve=self.curve,
                                                  restart=restart)
        return exchange


class NoLauncherError(ConfigError):
    """:func:`hopnet.init` in a process no launcher started (``python train.py``). Uncaught, it is
    one line on stderr, not a traceback: :func:`_one_line_when_uncaught`."""


def _script_command() -> str:
    """``hopnet launch --nproc 4 SCRIPT ARGS`` for the script this process runs."""
    import shlex

    argv = list(sys.argv) or ["train.py"]
    script = argv[0] if argv[0] not in ("", "-c", "-m") else "train.py"
    return shlex.join(["hopnet", "launch", "--nproc", "4", script, *argv[1:]])


def _one_line_when_uncaught() -> None:
    """Print an uncaught :class:`NoLauncherError` as one line (the traceback would only bury how
    to run the script); every other exception as before."""
    previous = sys.excepthook
    if getattr(previous, "_hopnet_one_line", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if isinstance(value, NoLauncherError):
            print(f"hopnet: error: {value}", file=sys.stderr)
        else:
            previous(kind, value, tb)

    hook._hopnet_one_line = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def find_launcher(graph: Graph | str | os.PathLike[str] | None, environ: Mapping[str, str]) -> WorkerContext:
    """The launcher's view of this worker: `hopnet launch`'s variables, else torchrun's or srun's."""
    launched = WorkerEnv.from_environ(environ)
    if launched is None:
        external = detect(environ)
        if external is None:
            _one_line_when_uncaught()
            raise NoLauncherError(f"hopnet.init() takes its rank and peers from a launcher: run `{_script_command()}` "
                                  "(or under torchrun or srun)")
        attached = attach(external, graph, environ)
        set_title(worker_title(attached.rank, attached.world_size, script_name(sys.argv)))
        context = WorkerContext(attached.rank, attached.world_size, attached.graph, attached.flags, attached.explicit,
                                attached.bind_host, attached.store_endpoint, keys_from_environ(environ),
                                attached=attached)
    else:
        g = Graph.from_json(launched.graph_path)
        if graph is not None:
            check_same_graph(g, graph)
        context = WorkerContext(launched.rank, launched.world_size, g, launched.config(), launched.explicit_options,
                                launched.bind_host, launched.store, keys_from_environ(environ), launched=launched)
    size = ReplicaLayout.from_environ(environ, context.world_size).size
    if context.graph.n * size != context.world_size and not environ.get(JOIN, "").strip():
        per = f" in replicas of {size}" if size > 1 else ""
        raise ConfigError(f"the graph has {context.graph.n} nodes but the launcher started "
                          f"{context.world_size} workers{per}")
    return context


def check_same_graph(launched: Graph, given: Graph | str | os.PathLike[str]) -> None:
    """``graph=`` under `hopnet launch` must be the graph the launcher runs."""
    g = given if isinstance(given, Graph) else Graph.load(os.fspath(given))
    same = g.n == launched.n and all(sorted(g.peers(r)) == sorted(launched.peers(r)) for r in range(g.n))
    if not same:
        raise ConfigError(f"graph= {g.name or 'given to hopnet.init()'} differs from the graph `hopnet launch` "
                          "runs (drop graph= or pass the same graph to --graph)")


def resolve_options(spec: InitSpec, context: WorkerContext) -> ProtocolConfig:
    """The options this worker runs: ``config=`` else the launcher's, with keyword ``options`` on
    top; refused when they change an option given explicitly to the launcher, or (under
    `hopnet launch`) one its coordinator was built from."""
    config = spec.config if spec.config is not None else context.flags
    if spec.options:
        config = config.replace(**spec.options)
        config.validate()
    where = "hopnet.init()" if spec.config is None else "the config passed to hopnet.init()"
    check_explicit(context.flags, config, context.explicit, where)
    if context.launched is not None:  # under torchrun/srun rank 0 builds the coordinator from config itself
        check_coordinator_options(context.flags, config, where)
    return config


def check_inputs(spec: InitSpec, context: WorkerContext, config: ProtocolConfig) -> None:
    """The model and the options, checked before any socket opens."""
    if spec.model is not None and spec.params is not None:
        raise ConfigError("pass either model or params, not both")
    check_config_for_graph(config, context.graph)  # the launcher's own check, for options given in code


@dataclass
class WorkerRun:
    """The run directory, and what this worker must release when it closes: its share of a
    torchrun/srun run's store, and the coordinator rank 0 hosts there."""

    run_dir: str
    attached: AttachedRun | None = None
    coordinator: CoordinatorProcess | None = None

    def finish(self, aborted: bool) -> None:
        if self.attached is not None:
            self.attached.finish(aborted=aborted)
        if self.coordinator is not None:  # after the store: every rank has left, so no group waits on it
            self.coordinator.stop(COORDINATOR_STOP_GRACE_S)


def open_run(context: WorkerContext, config: ProtocolConfig) -> WorkerRun:
    """The run directory; under torchrun/srun rank 0 names it, and hosts the protocol's coordinator
    (no launcher process of hopnet's own), whose ``HOPNET_COORDINATOR*`` every rank sets."""
    attached = context.attached
    if attached is None:
        assert context.launched is not None
        return WorkerRun(context.launched.run_dir)
    run = WorkerRun(attached.open_run_dir(config.protocol, config.timeout_s), attached)
    set_title(worker_title(attached.rank, attached.world_size, script_name(sys.argv), run.run_dir))

    def host() -> dict[str, str]:
        run.coordinator = host_coordinator(config, run.run_dir, context.bind_host)
        return run.coordinator.worker_env() if run.coordinator is not None else {}

    os.environ.update(attached.share_coordinator(host, config.timeout_s))
    return run


def host_coordinator(config: ProtocolConfig, run_dir: str, bind_host: str) -> CoordinatorProcess | None:
    """Start the coordinator the protocol needs (``None``: it needs none) as this process's child."""
    graph_path = Path(run_dir) / "graph.json"  # rank 0 wrote it when it named the run directory
    machine = make_coordinator(config, Graph.from_json(graph_path))
    if machine is None:
        return None
    stderr = sys.stderr.buffer

    def relay(line: bytes) -> None:
        stderr.write(line)

    try:
        return CoordinatorProcess.start(machine.name, graph_path=str(graph_path), config_json=config.to_json(),
                                        run_dir=run_dir, bind_host=bind_host, env=os.environ, pass_fds=(),
                                        relay=relay)
    except CoordinatorStartError as exc:
        raise ConfigError(str(exc)) from None


@dataclass(frozen=True)
class ModelTensors:
    """The model's parameters and floating buffers in flat tensors (:class:`ModelState`), its
    gradients in others (views keep ``.grad``)."""

    params: ModelState | None
    grads: FlatGradients | torch.Tensor | None
    """Hopnet's flat gradients; a member of a replica group its lane's slice of them (a tensor)."""

    @classmethod
    def of(cls, model: torch.nn.Module | None, params: torch.Tensor | None) -> ModelTensors:
        if model is None:
            return cls(ModelState.wrap(params), None)
        return cls(ModelState.of(model), FlatGradients(model))

    @property
    def device(self) -> torch.device:
        return self.params.device if self.params is not None else torch.device("cpu")


def check_restarts(restarts: Restarts, config: ProtocolConfig, context: WorkerContext,
                   tensors: ModelTensors) -> Restarts:
    """``--max-restarts`` needs a protocol that can take a replacement back, `hopnet launch` (which
    restarts the worker) and the ZeroMQ plane (the torch plane's process groups are fixed)."""
    if not restarts.allowed:
        return restarts
    refusal = config.spec.refuses_restarts(config.options)
    if refusal is not None:
        raise ConfigError(f"--max-restarts: {refusal}")
    if context.launched is None:
        raise ConfigError("--max-restarts needs `hopnet launch`, which starts the replacements")
    if tensors.device.type != "cpu" or config.bulk == "torch":
        raise ConfigError("--max-restarts needs the ZeroMQ plane (CPU tensors, --bulk zmq or auto): "
                          "the torch plane's process groups cannot take a new process in")
    return restarts


def _nbytes(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.numel() * tensor.element_size()


def connect(context: WorkerContext, config: ProtocolConfig,
            tensors: ModelTensors, *, replaceable: bool = False) -> tuple[Transport, CollectiveFactory | None]:
    """The transport to the graph's neighbours and the factory of the node's collectives,
    sized for the model's tensors on its device. ``replaceable``: dead workers may come back as new
    processes (``--max-restarts``): everything then goes over ZeroMQ."""
    params, grads = tensors.params, tensors.grads
    bulk = "zmq" if replaceable else config.bulk
    transport = make_transport(rank=context.rank, peers=frozenset(context.graph.peers(context.rank)),
                               bind_host=context.bind_host, bulk=bulk, device=tensors.device,
                               store_endpoint=context.store_endpoint, timeout_s=config.timeout_s,
                               message_bytes=None if params is None else params.nbytes,
                               curve=context.curve, handover=replaceable)
    factory = collective_factory(rank=context.rank, world_size=context.world_size, bulk=bulk,
                                 device=tensors.device, store_endpoint=context.store_endpoint,
                                 timeout_s=config.timeout_s, bind_host=context.bind_host,
                                 tensor_bytes=_nbytes(grads.buffer if isinstance(grads, FlatGradients) else grads))
    return transport, factory


__all__ = ["COORDINATOR_STOP_GRACE_S", "InitSpec", "ModelTensors", "WorkerContext", "WorkerRun", "check_inputs",
           "check_restarts",
           "check_same_graph", "connect", "find_launcher", "host_coordinator", "open_run", "resolve_options"]

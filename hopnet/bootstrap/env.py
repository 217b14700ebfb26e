"""The contract between `hopnet launch` and its workers: environment variables.

The launcher starts one process per rank and tells it who it is through ``HOPNET_*``
variables. A worker reads them with :meth:`WorkerEnv.from_environ`, which returns
``None`` when the process was not started by a launcher (``HOPNET_RANK`` unset), so
the same script can also run stand-alone.

=====================  ==============================================================
``HOPNET_RANK``        global rank of this worker, ``0 <= rank < world size``
``HOPNET_WORLD_SIZE``  number of workers (nodes of the graph)
``HOPNET_LOCAL_RANK``  rank among the workers of this machine (default: the rank)
``HOPNET_NODE_RANK``   index of this machine among the launchers (default: 0)
``HOPNET_GRAPH``       path of the communication graph (JSON) the launcher wrote
``HOPNET_RENDEZVOUS``  ``tcp://HOST:PORT`` of the launcher's rendezvous server
``HOPNET_RUN_DIR``     directory for this run's files (``rank{R}.jsonl`` event logs)
``HOPNET_CONFIG``      the :class:`~hopnet.config.ProtocolConfig` as JSON
``HOPNET_BIND``        host the worker binds its sockets to (default: 127.0.0.1)
``HOPNET_EXPLICIT``    protocol options given explicitly on the command line, as a
                       JSON list of :class:`~hopnet.config.ProtocolConfig` field names
                       (code may set the others; see :mod:`hopnet.bootstrap.options`)
``HOPNET_STORE``       ``HOST:PORT`` of the run's c10d ``TCPStore`` (hosted by the launcher;
                       workers open it as clients on demand, see :mod:`hopnet.rendezvous.store`).
                       Optional: without it the torch bulk plane and collective are unavailable
=====================  ==============================================================

``HOPNET_SAVE_MODEL=1`` (set by ``hopnet launch --save-model``, or by hand under any
launcher): the lowest live rank writes the consensus model's ``state_dict`` to
``model.pt`` in the run directory when ``worker.consensus()`` returns.

``HOPNET_CHECKPOINT_EVERY``, ``HOPNET_CHECKPOINT_DIR`` and ``HOPNET_RESUME`` (set by ``hopnet launch
--checkpoint-every/--checkpoint-dir/--resume``, or by hand under torchrun and srun) ask for
checkpoints and a resume: see :mod:`hopnet.checkpoint`.

``HOPNET_MAX_RESTARTS`` (set by ``hopnet launch --max-restarts K``): the launcher replaces up to
``K`` workers that die while the run goes on, so a worker's peers (and the coordinator) wait for
a dead rank to come back instead of failing. ``HOPNET_RESTART=N`` is set in the environment of a
replacement only: the ``N``-th process of its rank after the first (1, 2, ...). It joins the
running job and takes a neighbour's model instead of starting from its own initial weights.

``HOPNET_MAX_FAILURES`` (set by ``hopnet launch --max-failures K``): the run may lose up to ``K``
workers, so a group or averaging that a dead member broke is rolled back on the others, who go on
(as under ``--max-restarts``), instead of failing them.

The launcher also sets ``HOPNET_PARENT_FD`` and ``HOPNET_LAUNCHER_PID`` for the
launcher watch (:mod:`hopnet.bootstrap.parent_watch`), and ``HOPNET_CURVE_KEY`` (the run's
CurveZMQ key, ``"PUBLIC SECRET"``) when the run's sockets are secured
(:mod:`hopnet.security`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hopnet.errors import ConfigError

if TYPE_CHECKING:
    from hopnet.config import ProtocolConfig

RANK = "HOPNET_RANK"
WORLD_SIZE = "HOPNET_WORLD_SIZE"
LOCAL_RANK = "HOPNET_LOCAL_RANK"
NODE_RANK = "HOPNET_NODE_RANK"
GRAPH = "HOPNET_GRAPH"
RENDEZVOUS = "HOPNET_RENDEZVOUS"
RUN_DIR = "HOPNET_RUN_DIR"
CONFIG = "HOPNET_CONFIG"
BIND = "HOPNET_BIND"
EXPLICIT = "HOPNET_EXPLICIT"
STORE = "HOPNET_STORE"
SAVE_MODEL = "HOPNET_SAVE_MODEL"
MAX_RESTARTS = "HOPNET_MAX_RESTARTS"
MAX_FAILURES = "HOPNET_MAX_FAILURES"
RESTART = "HOPNET_RESTART"
ELASTIC = "HOPNET_ELASTIC"
JOIN = "HOPNET_JOIN"
MODEL_FILE = "model.pt"
"""Where ``--save-model`` puts the consensus model, in the run directory."""

ENV_VARS = (RANK, WORLD_SIZE, LOCAL_RANK, NODE_RANK, GRAPH, RENDEZVOUS, RUN_DIR, CONFIG, BIND, EXPLICIT, STORE)
"""Every variable of the contract (the launcher also sets ``PYTHONUNBUFFERED=1``)."""

DEFAULT_BIND = "127.0.0.1"
_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = environ.get(name)
    if text is None or text.strip() == "":
        if default is None:
            raise ConfigError(f"{name} is not set (it is required when {RANK} is set)")
        return default
    try:
        return int(text.strip())
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not an integer") from None


def _str(environ: Mapping[str, str], name: str, default: str | None = None) -> str:
    text = environ.get(name)
    if text is None or text.strip() == "":
        if default is None:
            raise ConfigError(f"{name} is not set (it is required when {RANK} is set)")
        return default
    return text.strip()


def save_model_requested(environ: Mapping[str, str]) -> bool:
    """Whether ``HOPNET_SAVE_MODEL`` asks for the consensus model to be saved."""
    return environ.get(SAVE_MODEL, "").strip().lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class Restarts:
    """``HOPNET_MAX_RESTARTS`` and ``HOPNET_RESTART`` as one worker reads them."""

    allowed: int = 0
    """Dead workers the launcher may replace (0: none; peers then never wait for one to come back)."""
    this: int = 0
    """This process's restart number: 0 for the first process of its rank, N for its N-th replacement."""
    losses: int = 0
    """Workers the run may lose (``HOPNET_MAX_FAILURES``): a round a dead member broke is rolled back."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Restarts:
        allowed, this = _int(environ, MAX_RESTARTS, 0), _int(environ, RESTART, 0)
        losses = _int(environ, MAX_FAILURES, 0)
        if allowed < 0 or this < 0 or losses < 0:
            raise ConfigError(f"{MAX_RESTARTS}, {RESTART} and {MAX_FAILURES} must be >= 0 "
                              f"(got {allowed}, {this} and {losses})")
        if this and not allowed:
            raise ConfigError(f"{RESTART}={this} without {MAX_RESTARTS}: a replacement needs peers that wait for it")
        return cls(allowed, this, losses)


def _names(environ: Mapping[str, str], name: str) -> tuple[str, ...]:
    text = environ.get(name, "").strip()
    if not text:
        return ()
    try:
        names = json.loads(text)
    except json.JSONDecodeError:
        names = None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{name}={text!r} is not a JSON list of option names")
    return tuple(names)


@dataclass(frozen=True)
class WorkerEnv:
    """Who a worker is and where to find everything else, as the launcher set it."""

    rank: int
    world_size: int
    local_rank: int
    graph_path: str
    rendezvous: str
    run_dir: str
    config_json: str
    bind_host: str = DEFAULT_BIND
    node_rank: int = 0
    explicit_options: tuple[str, ...] = ()
    """Protocol options given explicitly on the command line (field names)."""
    store: str = ""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the variable that is inconsistent."""
        if self.world_size < 1:
            raise ConfigError(f"{WORLD_SIZE}={self.world_size} must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"{RANK}={self.rank} is out of range ({WORLD_SIZE}={self.world_size})")
        if not 0 <= self.local_rank < self.world_size:
            raise ConfigError(f"{LOCAL_RANK}={self.local_rank} is out of range "
                              f"({WORLD_SIZE}={self.world_size})")
        if self.node_rank < 0:
            raise ConfigError(f"{NODE_RANK}={self.node_rank} must be >= 0")
        if not self.graph_path:
            raise ConfigError(f"{GRAPH} is empty (expected the path of a graph JSON file)")
        if not self.rendezvous.startswith(_ENDPOINT_SCHEMES):
            raise ConfigError(f"{RENDEZVOUS}={self.rendezvous!r} is not a ZeroMQ endpoint "
                              "(expected tcp://HOST:PORT)")
        if not self.bind_host:
            raise ConfigError(f"{BIND} is empty (expected a host such as 127.0.0.1)")
        if self.store:
            from hopnet.rendezvous.store import parse_endpoint

            try:
                parse_endpoint(self.store)
            except ConfigError as exc:
                raise ConfigError(f"{STORE}: {exc}") from None
        try:
            json.loads(self.config_json)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{CONFIG} is not valid JSON: {exc.msg} at column {exc.colno}") from None

    def config(self) -> ProtocolConfig:
        """The protocol configuration (parsed and validated)."""
        from hopnet.config import ProtocolConfig

        try:
            return ProtocolConfig.from_json(self.config_json)
        except ConfigError as exc:
            raise ConfigError(f"{CONFIG}: {exc}") from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{CONFIG}: {exc}") from None

    def to_environ(self) -> dict[str, str]:
        """The ``HOPNET_*`` variables (strings) that :meth:`from_environ` reads back."""
        return {
            RANK: str(self.rank),
            WORLD_SIZE: str(self.world_size),
            LOCAL_RANK: str(self.local_rank),
            NODE_RANK: str(self.node_rank),
            GRAPH: self.graph_path,
            RENDEZVOUS: self.rendezvous,
            RUN_DIR: self.run_dir,
            CONFIG: self.config_json,
            BIND: self.bind_host,
            EXPLICIT: json.dumps(list(self.explicit_options)),
            STORE: self.store,
        }

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv | None:
        """Read the launcher's variables; ``None`` when ``HOPNET_RANK`` is unset.

        Raises :class:`ConfigError` naming the variable when one is malformed, missing
        or inconsistent with the others.
        """
        if environ is None:
            environ = os.environ
        if environ.get(RANK) is None:
            return None
        rank = _int(environ, RANK)
        world_size = _int(environ, WORLD_SIZE)
        return cls(
            rank=rank,
            world_size=world_size,
            local_rank=_int(environ, LOCAL_RANK, default=rank),
            graph_path=_str(environ, GRAPH),
            rendezvous=_str(environ, RENDEZVOUS),
            run_dir=environ.get(RUN_DIR, "").strip(),
            config_json=_str(environ, CONFIG, default="{}"),
            bind_host=_str(environ, BIND, default=DEFAULT_BIND),
            node_rank=_int(environ, NODE_RANK, default=0),
            explicit_options=_names(environ, EXPLICIT),
            store=environ.get(STORE, "").strip(),
        )

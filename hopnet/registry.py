"""Where protocols declare themselves, and where everything else looks them up.

Each built-in protocol is a package of :mod:`hopnet.protocols` whose ``spec`` module ends with one
:func:`register` call of a :class:`ProtocolSpec`: its name, its options, whether it uses the
graph, what it averages, its coordinator and its message kinds. The command-line flags, the
keyword options of :func:`hopnet.init`, the ``HOPNET_*`` variables, the config checks, the
simulator and the report all read that declaration; no other list of protocol names exists.

Built-in protocols are found by importing ``hopnet.protocols.<package>.spec`` for every package
of :mod:`hopnet.protocols` that has one, the first time a name is looked up: declarations import no torch (``build`` imports the
algorithm), so the command line stays fast. Protocols of other packages register the same way
when their module is imported (one that imports torch makes every command that looks up a
protocol load it): name it in ``HOPNET_PLUGINS`` (comma-separated module names, imported in
every process of a run, the launcher's included) or declare it as an entry point of the
``hopnet.protocols`` group.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import os
import pkgutil
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from hopnet.errors import ConfigError
from hopnet.options import NoOptions, OptionField, ProtocolOptions, option_fields
from hopnet.output_spec import UPDATES_WAIT, OutputSpec
from hopnet.kinds import register_kind

if TYPE_CHECKING:
    import numpy as np
    import torch

    from hopnet.config import ProtocolConfig
    from hopnet.coordinator.base import Coordinator
    from hopnet.graph import Graph
    from hopnet.model_state import ModelState
    from hopnet.params import FlatGradients
    from hopnet.protocols.base import Protocol

PLUGINS_VARIABLE = "HOPNET_PLUGINS"
ENTRY_POINT_GROUP = "hopnet.protocols"

OptionsT = TypeVar("OptionsT", bound=ProtocolOptions)


class Averages(enum.Enum):
    """What a protocol averages: the models (parameters and buffers) or the gradients."""

    MODELS = "models"
    GRADIENTS = "gradients"


@dataclass(frozen=True)
class MessageKind:
    """A message kind of the protocol's own; ``any_rank``: accepted from every rank of the run,
    not only from graph neighbours."""

    name: str
    any_rank: bool = False


@dataclass(frozen=True)
class CoordinatorSpec(Generic[OptionsT]):
    """The central service a protocol needs (see :mod:`hopnet.coordinator`).

    ``build`` makes the sans-IO state machine from the run's options and graph; ``needed``
    says whether these options need it at all (Prague's static schedule does not);
    ``options`` names the protocol options it is built from: `hopnet launch` starts it from
    its flags before any worker runs, so code may not change them (besides these, the run's
    ``seed`` and ``peer_timeout_s``)."""

    build: Callable[[ProtocolConfig, OptionsT, Graph], Coordinator]
    options: tuple[str, ...]
    needed: Callable[[OptionsT], bool] = field(default=lambda options: True)


ProtocolFactory = Callable[["ProtocolConfig", OptionsT, "ModelState | None", "FlatGradients | torch.Tensor | None"],
                           "Protocol"]
GraphCheck = Callable[["ProtocolConfig", OptionsT, "Graph"], list[str]]
GapBound = Callable[[OptionsT, "Graph"], "np.ndarray"]


@dataclass(frozen=True)
class ProtocolSpec(Generic[OptionsT]):
    """A protocol's declaration."""

    name: str
    summary: str
    """One sentence for ``--protocol``'s help."""
    options: type[OptionsT]
    build: ProtocolFactory[OptionsT]
    """Makes the protocol object of one worker from the run's configuration, the model's flat tensors
    (a :class:`hopnet.model_state.ModelState`: what model-averaging protocols mix, whose buffers gradient
    protocols keep in step) and the flat gradients (what gradient protocols reduce)."""
    averages: Averages
    uses_graph: bool
    """False for protocols that reduce among all ranks whatever the graph says."""
    coordinator: CoordinatorSpec[OptionsT] | None = None
    message_kinds: tuple[MessageKind, ...] = ()
    check_graph: GraphCheck[OptionsT] | None = None
    """Refuses (``ConfigError``) options that cannot work on a graph; returns notes on the rest."""
    gap_bound: GapBound[OptionsT] | None = None
    """The proven bound on Iter(i) - Iter(j) for every pair (an N x N matrix, inf for none), where the
    protocol has one."""
    gap_rule: Callable[[OptionsT], str] | None = None
    """:attr:`gap_bound` in words, for the report."""
    resumable: bool = False
    """Its workers can resume from checkpoints (:meth:`hopnet.protocols.base.Protocol.resume_at`;
    docs/design/checkpoints.md)."""
    restartable: bool = False
    """A dead worker can be replaced while the others train (``hopnet launch --max-restarts``;
    :mod:`hopnet.runtime.rejoin`): the others keep going without it, then take it back."""
    restart_refusal: Callable[[OptionsT], str | None] | None = None
    """For a ``restartable`` protocol: why these options cannot replace a dead worker (None: they can)."""
    simulated_without_tensors: bool = False
    """The protocol runs without a parameter buffer (Hop): the simulator then gives it none and charges
    its ``update`` messages the model's bytes instead of averaging a stand-in model."""
    between_replicas: bool = False
    """It runs between replica groups (:mod:`hopnet.replica`): each lane of a replica makes the same
    choices as its siblings, because they follow iteration numbers and the graph, or are agreed
    (:class:`~hopnet.runtime.services.ReplicaLanes`). Left False, replica groups refuse it in one line."""
    restarts_replicas: bool = False
    """Under ``--max-restarts``, a dead replica group comes back whole (:mod:`hopnet.replica.handover`):
    a replica's death never leaves a survivor's lanes in different iterations, one of them held inside
    the replica's own collectives where it cannot hand its state over. Left False, ``--max-restarts``
    with replica groups is refused in one line."""
    lane_channels: int = 1
    """How many agreement channels (each a gloo group of its own) its lanes use between replica groups
    (:mod:`hopnet.replica.agreement`): 2 where two streams of choices run in orders independent of each
    other (eager-SGD's round engine and the trainer's calls), so neither waits in the other's order."""
    output: OutputSpec = field(default=OutputSpec(waits=(UPDATES_WAIT,)))
    """What the launcher's summary, `hopnet report` and `hopnet simulate` show of its runs: its waits,
    its counts (from the ``stop`` records), whether iteration gaps matter (:mod:`hopnet.output_spec`)."""

    def option_fields(self) -> tuple[OptionField, ...]:
        return option_fields(self.options)

    def default_options(self) -> OptionsT:
        return self.options()

    def needs_coordinator(self, options: ProtocolOptions) -> bool:
        return self.coordinator is not None and self.coordinator.needed(self._own(options))

    def refuses_restarts(self, options: ProtocolOptions) -> str | None:
        """Why ``--max-restarts`` cannot run with these options, in words (None: it can)."""
        if not self.restartable:
            return f"--protocol {self.name} cannot replace a dead worker yet"
        return self.restart_refusal(self._own(options)) if self.restart_refusal is not None else None

    def _own(self, options: ProtocolOptions) -> OptionsT:
        if not isinstance(options, self.options):
            raise ConfigError(f"--protocol {self.name} takes {self.options.__name__}, not {type(options).__name__}")
        return options


_specs: dict[str, ProtocolSpec[ProtocolOptions]] = {}
_lock = threading.RLock()
_discovered = False


def register(spec: ProtocolSpec[OptionsT]) -> ProtocolSpec[OptionsT]:
    """Make ``spec`` known under its name (once; registering the same name twice is an error,
    unless it is the same declaration again, as when a module is imported twice)."""
    with _lock:
        known = _specs.get(spec.name)
        if known is not None and known.options.__qualname__ != spec.options.__qualname__:
            raise ConfigError(f"protocol {spec.name!r} is registered twice "
                              f"({known.options.__module__} and {spec.options.__module__})")
        for kind in spec.message_kinds:
            register_kind(kind.name, any_rank=kind.any_rank)
        _specs[spec.name] = spec  # type: ignore[assignment]  # stored by name, read back by callers' types
    return spec


DECLARATION_MODULE = "spec"
"""The module of a protocol package that declares it (imports no torch)."""


def _builtin_declarations() -> list[str]:
    """``hopnet.protocols.<package>.spec`` for each package of :mod:`hopnet.protocols` that has one:
    a new protocol is a new package there, and no list to edit."""
    import hopnet.protocols as protocols

    found = []
    for package in pkgutil.iter_modules(protocols.__path__, protocols.__name__ + "."):
        if package.ispkg and importlib.util.find_spec(f"{package.name}.{DECLARATION_MODULE}") is not None:
            found.append(f"{package.name}.{DECLARATION_MODULE}")
    return found


def _discover() -> None:
    global _discovered
    with _lock:
        if _discovered:
            return
        _discovered = True
        for name in _builtin_declarations():
            importlib.import_module(name)
        for name in filter(None, (part.strip() for part in os.environ.get(PLUGINS_VARIABLE, "").split(","))):
            try:
                importlib.import_module(name)
            except ImportError as exc:
                raise ConfigError(f"{PLUGINS_VARIABLE}: cannot import {name!r}: {exc}") from None
        from importlib.metadata import entry_points  # slow to import; needed only once a protocol is looked up

        for point in entry_points(group=ENTRY_POINT_GROUP):
            point.load()


def specs() -> tuple[ProtocolSpec[ProtocolOptions], ...]:
    """Every known protocol, by name."""
    _discover()
    return tuple(spec for _, spec in sorted(_specs.items()))


def names() -> tuple[str, ...]:
    return tuple(spec.name for spec in specs())


def lookup(name: str) -> ProtocolSpec[ProtocolOptions]:
    """The declaration of protocol ``name``; an unknown name is refused in one line."""
    spec = _specs.get(name)
    if spec is None:
        _discover()
        spec = _specs.get(name)
    if spec is None:
        raise ConfigError(f"unknown protocol {name!r} (choose from {', '.join(names())})")
    return spec


def owners(option_name: str) -> list[str]:
    """The protocols that take option ``option_name``."""
    return [spec.name for spec in specs() if option_name in spec.options.names()]


def protocol_option_fields() -> list[OptionField]:
    """Every protocol option of every protocol (a name taken by two protocols appears twice)."""
    return [f for spec in specs() for f in spec.option_fields()]


def refuse_foreign(protocol: str, given: Sequence[str], flag: Callable[[str], str]) -> None:
    """Refuse, in one line naming ``protocol``, options it does not take; unknown names too."""
    spec = lookup(protocol)
    own = set(spec.options.names())
    foreign = [name for name in given if name not in own]
    if not foreign:
        return
    unknown = [name for name in foreign if not owners(name)]
    if unknown:
        raise ConfigError(f"unknown protocol option {unknown[0]!r}")
    takers = sorted({p for name in foreign for p in owners(name)})
    raise ConfigError(f"{', '.join(flag(name) for name in foreign)}: option(s) that --protocol {protocol} does "
                      f"not take (taken by {', '.join(takers)})")


__all__ = ["Averages", "CoordinatorSpec", "MessageKind", "NoOptions", "ProtocolSpec", "lookup", "names", "owners",
           "protocol_option_fields", "refuse_foreign", "register", "specs"]

"""The launcher's settings, declared once: what one launcher is asked to do (:class:`LaunchSpec`).

Each field of :class:`LaunchSpec` is a :func:`setting`: its type and default (the field's),
its flag, help, value name, choices and smallest value (:class:`SettingInfo`). Everything
that spells a setting out derives from that one declaration, as the protocol options derive
from theirs (:mod:`hopnet.options`):

* `hopnet launch`'s arguments (:func:`add_launch_arguments`), and the command line's
  translation to a spec (:func:`spec_from_args`);
* the keywords of :func:`hopnet.launch.launch` (:func:`spec_from_keywords`, which refuses an
  unknown one), typed for mypy and IDEs by :class:`LaunchKeywords` (a test keeps it in step);
* the checks of each value on its own (:func:`check_settings`; the checks across settings
  and against the graph are :func:`hopnet.launch.spec.validate`'s).

This module imports neither torch nor the protocols: `hopnet launch --help` builds its
parser from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias, TypedDict

from hopnet.bootstrap.env import DEFAULT_BIND
from hopnet.errors import ConfigError
from hopnet.options import flag_of

if TYPE_CHECKING:
    from hopnet.config import ProtocolConfig
    from hopnet.graph import Graph

DEFAULT_NPROC = 4
DEFAULT_GRACE_S = 5.0
DEFAULT_SETTLE_S = 1.5
"""After the first failure, how long the other workers may end on their own before being stopped."""
START_METHODS = ("forkserver", "exec")
"""How workers start: forked from a fork server that imported torch once, or each exec'd."""

GraphArgument: TypeAlias = "Graph | str | os.PathLike[str] | None"
"""A :class:`Graph`, a JSON path, a builder spec (``ring:4``), or ``None`` for a ring."""

LAUNCHER = "launcher"
MACHINES = "several machines (one launcher per machine)"
SECURITY = "security"
ARGUMENTS = "arguments"
"""The positional arguments (SCRIPT ARGS...), which the command line takes after every flag."""
GROUPS = (LAUNCHER, MACHINES, SECURITY)
"""The command line's groups of launcher flags, in the order `hopnet launch --help` shows them."""


@dataclass(frozen=True)
class SettingInfo:
    """What a setting declares beyond its name, type and default."""

    help: str
    """The flag's help (or, for a setting without a flag, what it does)."""
    group: str | None = None
    """The command line's group of its flag (:data:`GROUPS`, or :data:`ARGUMENTS`); ``None``: no
    flag, a keyword of :func:`hopnet.launch.launch` only."""
    flag: str | None = None
    """The long flag; by default ``--`` and the name with dashes, without a ``_s`` suffix
    (``grace_s`` -> ``--grace``), ``--no-...`` for a switch that is on by default."""
    short: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    number: type | None = None
    """``int`` or ``float``: the value is a number (checked as one, parsed as one from a flag)."""
    minimum: float | None = None
    """The smallest value a number may take (checked on the command line too, for integers)."""
    label: str | None = None
    """How errors name the setting, when not by its flag (``grace period``)."""
    takes_value: bool = False
    """A switch whose flag takes a value (``--resume RUN_DIR``): set when the flag is given; the
    command line's translation reads the value itself."""
    nargs: str | None = None
    """For a positional argument: argparse's ``nargs``."""


def setting(default: Any = dataclasses.MISSING, *, help: str, group: str | None = None, flag: str | None = None,
            short: str | None = None, metavar: str | None = None, choices: Sequence[str] | None = None,
            number: type | None = None, minimum: float | None = None, label: str | None = None,
            takes_value: bool = False, nargs: str | None = None, positional: bool = False) -> Any:
    """A field of :class:`LaunchSpec` that is a launcher setting (see :class:`SettingInfo`).
    Only ``positional`` ones may be given by position; the others are keywords."""
    info = SettingInfo(help=help, group=group, flag=flag, short=short, metavar=metavar,
                       choices=tuple(choices) if choices else None, number=number, minimum=minimum, label=label,
                       takes_value=takes_value, nargs=nargs)
    return dataclasses.field(default=default, metadata={"setting": info}, kw_only=not positional)


@dataclass(frozen=True)
class Setting:
    """One declared setting: its name, default and :class:`SettingInfo`."""

    name: str
    default: Any
    info: SettingInfo

    @property
    def is_switch(self) -> bool:
        return isinstance(self.default, bool)

    @property
    def flag(self) -> str:
        return self.info.flag or flag_of(self.name, turns_off=self.is_switch and self.default is True)

    @property
    def dest(self) -> str:
        """Its name in the command line's namespace (``grace_s`` -> ``grace``)."""
        return self.name.removesuffix("_s")

    @property
    def has_flag(self) -> bool:
        return self.info.group is not None

    def check(self, value: Any) -> None:
        """Refuse a value this setting cannot take on its own, in one line naming it."""
        info = self.info
        name = info.label or self.flag
        if info.choices is not None and value is not None and value not in info.choices:
            raise ConfigError(f"{self.flag} {value!r}: expected one of {', '.join(info.choices)}")
        if info.number is None or (value is None and self.default is None):
            return
        whole = info.number is int
        ok = not isinstance(value, bool) and isinstance(value, int if whole else (int, float))
        if ok and info.minimum is not None and value < info.minimum:
            ok = False
        if not ok:
            noun = " an integer" if whole else ""
            bound = "" if info.minimum is None else f" >= {info.minimum:g}"
            raise ConfigError(f"{name} must be{noun}{bound} (got {value!r})")


@dataclass(frozen=True)
class LaunchSpec:
    """Everything the user asked of one launcher (the arguments of :func:`hopnet.launch.launch`).

    The fields are declared in the order `hopnet launch --help` shows their flags; those without
    a flag come last."""

    script: str | os.PathLike[str] = setting(
        help="the training script (a .py file)", group=ARGUMENTS, metavar="SCRIPT", nargs="?", positional=True)
    script_args: Sequence[str] = setting(
        (), help="arguments for the script, passed through untouched", group=ARGUMENTS, metavar="ARGS",
        nargs=argparse.REMAINDER, positional=True)
    graph: GraphArgument = setting(
        None, group=LAUNCHER, metavar="G",
        help="graph JSON file or builder spec such as ring:8, torus:2x4 (default: a ring over --nproc workers)")
    nproc: int | None = setting(
        None, group=LAUNCHER, metavar="N", number=int, minimum=1,
        help="number of workers (default: the graph's size, or 4 without --graph)")
    replica_size: int | None = setting(
        None, group=LAUNCHER, metavar="R", number=int, minimum=1,
        help="group the workers into replicas of R processes: DDP or FSDP inside a replica (--replica-mode), the "
             "protocol between replicas, whose graph has --nproc/R nodes (default: 1; with --replica-mode under "
             "--nnodes, one replica per machine)")
    replica_mode: str | None = setting(
        None, group=LAUNCHER, choices=("ddp", "fsdp"),
        help="inside a replica: ddp (each process holds the model, gradients averaged in the backward pass) or "
             "fsdp (parameters, gradients and optimizer state sharded; default: ddp)")
    run_dir: str | os.PathLike[str] | None = setting(
        None, group=LAUNCHER, metavar="DIR",
        help="directory for graph.json, launch.json and the workers' logs (default: runs/<time>-<protocol>-<graph>)")
    overwrite: bool = setting(
        False, group=LAUNCHER,
        help="reuse a --run-dir that holds an earlier run, removing that run's launch.json, graph.json and "
             "rank*.jsonl (other files stay); a directory a running launch holds is refused even so")
    bind: str = setting(
        DEFAULT_BIND, group=LAUNCHER, metavar="HOST",
        help=f"host the workers bind their sockets to (default: {DEFAULT_BIND})")
    prefix: bool = setting(
        True, group=LAUNCHER, help="let workers write straight to this terminal, without [rank R] prefixes")
    progress: bool = setting(
        True, group=LAUNCHER,
        help="no live status line (it is shown only on a terminal anyway); the per-rank summary table is still "
             "printed at the end")
    grace_s: float = setting(
        DEFAULT_GRACE_S, group=LAUNCHER, metavar="SECONDS", number=float, minimum=0, label="grace period",
        help=f"after SIGTERM, how long workers get before SIGKILL (default: {DEFAULT_GRACE_S:g})")
    start_method: str | None = setting(
        None, group=LAUNCHER, choices=START_METHODS,
        help="forkserver: fork workers from one process that imported torch once (faster start-up; the default "
             "on Linux); exec: each worker a new interpreter")
    module: bool = setting(
        False, group=LAUNCHER, short="-m", help="SCRIPT is a module name, run as `python -m SCRIPT`")
    save_model: bool = setting(
        False, group=LAUNCHER,
        help="write the consensus model's state_dict to RUN_DIR/model.pt (the script calls worker.consensus() "
             "after training; the lowest live rank writes it)")
    checkpoint_every: int = setting(
        0, group=LAUNCHER, metavar="N", number=int, minimum=0,
        help="every worker saves its model, optimizer, RNG and registered state every N iterations "
             "(default: 0, never)")
    checkpoint_dir: str | os.PathLike[str] | None = setting(
        None, group=LAUNCHER, metavar="DIR", help="where the checkpoints go (default: RUN_DIR/checkpoints)")
    resume: bool = setting(
        False, group=LAUNCHER, metavar="RUN_DIR", takes_value=True,
        help="restart the stopped or crashed run in RUN_DIR with its recorded script, arguments and options, from "
             "the last iteration every rank has a checkpoint of (no SCRIPT; a flag that conflicts with the "
             "recorded run is refused)")
    max_failures: int = setting(
        0, group=LAUNCHER, metavar="K", number=int, minimum=0,
        help="let up to K workers fail while the others finish training (default: 0, stop the run at the first "
             "failure)")
    max_restarts: int = setting(
        0, group=LAUNCHER, metavar="K", number=int, minimum=0,
        help="replace a worker that dies (crash, kill, declared dead by its peers) with a new process that "
             "rejoins the running job, up to K times per launcher (default: 0, a dead worker is lost)")
    exit_timeout: float | None = setting(
        None, group=LAUNCHER, metavar="S", number=float, minimum=0,
        help="once a worker has finished, how long the others may take to exit before they are stopped and named "
             "(default: --timeout)")
    min_nproc: int | None = setting(
        None, group=LAUNCHER, metavar="N", number=int, minimum=1,
        help="make the run elastic: a worker that gets SIGTERM leaves and the run goes on, down to N workers "
             "(default: 1 when --max-nproc is given; without either flag the run is not elastic)")
    max_nproc: int | None = setting(
        None, group=LAUNCHER, metavar="N", number=int, minimum=1,
        help="make the run elastic: `hopnet join RUN_DIR` adds workers, up to N (default: --nproc when "
             "--min-nproc is given)")
    nnodes: int = setting(
        1, group=MACHINES, metavar="N", number=int, minimum=1,
        help="number of machines, each running its own `hopnet launch` (default: 1)")
    node_rank: int = setting(
        0, group=MACHINES, metavar="R", number=int, minimum=0,
        help="this machine's index, 0 to N-1; node 0 hosts the rendezvous (default: 0)")
    rdzv_endpoint: str | None = setting(
        None, group=MACHINES, metavar="HOST:PORT",
        help="node 0's address and a free port on it, the same on every machine; node 0's launcher listens there")
    key_file: str | os.PathLike[str] | None = setting(
        None, group=SECURITY, metavar="PATH",
        help="CurveZMQ run key: a ZeroMQ certificate with public-key and secret-key (made by `hopnet keygen "
             "PATH`); turns CURVE on, on loopback too. Default: a fresh key per run when --bind is not loopback")
    secure: bool = setting(
        False, group=SECURITY,
        help="use CurveZMQ even on loopback (other users of this machine can reach loopback ports)")
    insecure: bool = setting(
        False, group=SECURITY, help="plain ZeroMQ sockets even off loopback: no authentication, no encryption")
    config: ProtocolConfig | None = setting(
        None, help="the protocol configuration (on the command line: --protocol and the protocol flags)")
    explicit_options: Collection[str] = setting(
        (), help="the protocol options the user gave explicitly: code in the workers may set only the others")
    env_extra: Mapping[str, str] | None = setting(None, help="more variables for every worker's environment")
    argv: Sequence[str] | None = setting(
        None, help="the command line recorded in launch.json (default: this process's)")
    settle_s: float = setting(
        DEFAULT_SETTLE_S, number=float, minimum=0, label="settle time",
        help="after a failure, how long the other workers may end on their own before they are stopped, "
             "to see who blames whom")

    @property
    def single_machine(self) -> bool:
        return self.nnodes == 1 and self.node_rank == 0 and self.rdzv_endpoint is None


class LaunchKeywords(TypedDict, total=False):
    """The keywords of :func:`hopnet.launch.launch` after ``script`` and ``script_args``: every other
    field of :class:`LaunchSpec`, with its type (tests/test_launch_phases.py keeps the two in step)."""

    graph: GraphArgument
    nproc: int | None
    replica_size: int | None
    replica_mode: str | None
    run_dir: str | os.PathLike[str] | None
    overwrite: bool
    bind: str
    prefix: bool
    progress: bool
    grace_s: float
    start_method: str | None
    module: bool
    save_model: bool
    checkpoint_every: int
    checkpoint_dir: str | os.PathLike[str] | None
    resume: bool
    max_failures: int
    max_restarts: int
    exit_timeout: float | None
    min_nproc: int | None
    max_nproc: int | None
    nnodes: int
    node_rank: int
    rdzv_endpoint: str | None
    key_file: str | os.PathLike[str] | None
    secure: bool
    insecure: bool
    config: ProtocolConfig | None
    explicit_options: Collection[str]
    env_extra: Mapping[str, str] | None
    argv: Sequence[str] | None
    settle_s: float


def settings() -> tuple[Setting, ...]:
    """Every setting of :class:`LaunchSpec`, in declaration order."""
    return _SETTINGS


def _declared() -> tuple[Setting, ...]:
    return tuple(Setting(f.name, f.default, f.metadata["setting"]) for f in dataclasses.fields(LaunchSpec))


_SETTINGS = _declared()


def check_settings(spec: LaunchSpec) -> None:
    """Each setting's own check (:meth:`Setting.check`); the first refusal raises :class:`ConfigError`."""
    for s in _SETTINGS:
        s.check(getattr(spec, s.name))


# ------------------------------------------------------------------ launch()'s keywords
def spec_from_keywords(script: str | os.PathLike[str], script_args: Sequence[str],
                       keywords: Mapping[str, Any]) -> LaunchSpec:
    """The spec of ``launch(script, script_args, **keywords)``; a keyword that names no setting
    raises ``TypeError``, as an unknown keyword of any function does."""
    names = {s.name for s in _SETTINGS}
    for name in keywords:
        if name not in names:
            import difflib

            near = difflib.get_close_matches(name, sorted(names), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise TypeError(f"launch() got an unexpected keyword argument {name!r}{hint}")
    return LaunchSpec(script, script_args, **keywords)


# ------------------------------------------------------------------ the command line
def _at_least(minimum: float) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum:g} (got {value})")
        return value
    return parse


def _flag_type(s: Setting) -> Callable[[str], Any]:
    if s.info.number is int:
        return _at_least(s.info.minimum) if s.info.minimum is not None else int
    if s.info.number is float:
        return float
    return str


def _add_flag(group: argparse._ArgumentGroup, s: Setting) -> None:
    names = [s.info.short, s.flag] if s.info.short else [s.flag]
    if s.is_switch and not s.info.takes_value:
        action = "store_false" if s.default is True else "store_true"
        group.add_argument(*names, dest=s.dest, action=action, help=s.info.help)
        return
    default = None if s.info.takes_value else s.default
    group.add_argument(*names, dest=s.dest, type=_flag_type(s), choices=s.info.choices, default=default,
                       metavar=s.info.metavar, help=s.info.help)


def in_group(group: str) -> Iterator[Setting]:
    return (s for s in _SETTINGS if s.info.group == group)


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """The launcher's flags, one group each (:data:`GROUPS`)."""
    for title in GROUPS:
        group = parser.add_argument_group(title)
        for s in in_group(title):
            _add_flag(group, s)


def add_positional_arguments(parser: argparse.ArgumentParser) -> None:
    """SCRIPT and ARGS, which come after every flag (the protocol's too)."""
    for s in in_group(ARGUMENTS):
        if s.info.nargs == "?":  # optional: absent with --resume
            parser.add_argument(s.dest, metavar=s.info.metavar, nargs="?", default=None, help=s.info.help)
        else:
            parser.add_argument(s.dest, metavar=s.info.metavar, nargs=s.info.nargs, help=s.info.help)


def spec_from_args(args: argparse.Namespace, **given: Any) -> LaunchSpec:
    """The spec of a parsed `hopnet launch` command line: every setting that has a flag (or is a
    positional argument) from ``args``, the others from ``given`` (the configuration its protocol
    flags make, the options given explicitly, the command line to record)."""
    values: dict[str, Any] = {}
    for s in _SETTINGS:
        if not s.has_flag:
            continue
        value = getattr(args, s.dest)
        if s.info.takes_value:
            value = value is not None
        elif s.name == "script_args":
            value = list(value)
        values[s.name] = value
    return LaunchSpec(**values, **given)


__all__ = ["DEFAULT_GRACE_S", "DEFAULT_NPROC", "DEFAULT_SETTLE_S", "GraphArgument", "LaunchKeywords", "LaunchSpec",
           "START_METHODS", "Setting", "SettingInfo", "add_launch_arguments", "add_positional_arguments",
           "check_settings", "setting", "settings", "spec_from_args", "spec_from_keywords"]

"""`hopnet launch`: run a training script once per node of the communication graph."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from hopnet.errors import ConfigError

NAME = "launch"
HELP = "run a training script once per graph node on this machine"

DEFAULT_GRACE_S = 5.0

DESCRIPTION = """\
Start one worker process per node of the graph on this machine, running
`python SCRIPT ARGS...` with HOPNET_* variables that tell each worker its rank,
the graph, the rendezvous and the protocol configuration. Worker output is
printed line by line, prefixed "[rank R] ". When a worker fails, or the launcher
gets SIGINT/SIGTERM, every worker is stopped (SIGTERM, then SIGKILL after a grace
period); workers also stop by themselves within seconds if the launcher dies. Everything after SCRIPT is passed to the script untouched; to pass a
leading "--" write `hopnet launch [options] -- SCRIPT -- ARGS`.
"""

EPILOG = """\
Sockets bound to anything but loopback (--bind 0.0.0.0, a LAN address) use CurveZMQ:
only processes holding the run key (made per run, or --key-file) can connect to a
worker, the rendezvous or the coordinator; --insecure turns that off.

When a run fails, a closing line names the rank that caused it (the first to fail,
or the peer it blames: stalled, left early, died) and what it did to the others.
Protocol options given on the command line cannot be changed in code
(hopnet.init(..., max_ig=4) with --max-ig 3 is an error); the others can, and the
line "running ..." shows the options that run, once every worker has started.

exit status: 0 when every worker exits 0, or with --max-failures K when at most K
workers failed and every other worker finished; 1 when a worker fails (more than
K with --max-failures); 2 for bad arguments (an unreadable or ill-formed --key-file too); 128+N when the launcher is stopped by
signal N (130 for Ctrl-C, 143 for SIGTERM).
"""


def _nproc(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {value})")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (got {value})")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        NAME,
        help=HELP,
        description=DESCRIPTION,
        epilog=EPILOG,
        allow_abbrev=False,  # a script's --slow must reach it, not be taken for a prefix of --slowdown
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    launcher = parser.add_argument_group("launcher")
    launcher.add_argument("--graph", default=None, metavar="G",
                          help="graph JSON file or builder spec such as ring:8, torus:2x4 "
                               "(default: a ring over --nproc workers)")
    launcher.add_argument("--nproc", type=_nproc, default=None, metavar="N",
                          help="number of workers (default: the graph's size, or 4 without --graph)")
    launcher.add_argument("--run-dir", default=None, metavar="DIR",
                          help="directory for graph.json, launch.json and the workers' logs "
                               "(default: runs/<time>-<protocol>-<graph>)")
    launcher.add_argument("--overwrite", action="store_true",
                          help="reuse a --run-dir that holds an earlier run, removing that run's "
                               "launch.json, graph.json and rank*.jsonl (other files stay); "
                               "a directory a running launch holds is refused even so")
    launcher.add_argument("--bind", default="127.0.0.1", metavar="HOST",
                          help="host the workers bind their sockets to (default: 127.0.0.1)")
    launcher.add_argument("--no-prefix", dest="prefix", action="store_false",
                          help="let workers write straight to this terminal, without [rank R] prefixes")
    launcher.add_argument("--no-progress", dest="progress", action="store_false",
                          help="no live status line (it is shown only on a terminal anyway); "
                               "the per-rank summary table is still printed at the end")
    launcher.add_argument("--grace", type=float, default=DEFAULT_GRACE_S, metavar="SECONDS",
                          help="after SIGTERM, how long workers get before SIGKILL "
                               f"(default: {DEFAULT_GRACE_S:g})")
    launcher.add_argument("--start-method", choices=("forkserver", "exec"), default=None,
                          help="forkserver: fork workers from one process that imported torch once (faster "
                               "start-up; the default on Linux); exec: each worker a new interpreter")
    launcher.add_argument("-m", "--module", action="store_true",
                          help="SCRIPT is a module name, run as `python -m SCRIPT`")
    launcher.add_argument("--save-model", action="store_true",
                          help="write the consensus model's state_dict to RUN_DIR/model.pt (the script calls "
                               "worker.consensus() after training; the lowest live rank writes it)")
    launcher.add_argument("--checkpoint-every", type=_count, default=0, metavar="N",
                          help="every worker saves its model, optimizer, RNG and registered state every N "
                               "iterations (default: 0, never)")
    launcher.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                          help="where the checkpoints go (default: RUN_DIR/checkpoints)")
    launcher.add_argument("--resume", default=None, metavar="RUN_DIR",
                          help="restart the stopped or crashed run in RUN_DIR with its recorded script, "
                               "arguments and options, from the last iteration every rank has a checkpoint of "
                               "(no SCRIPT; a flag that conflicts with the recorded run is refused)")
    launcher.add_argument("--max-failures", type=_count, default=0, metavar="K",
                          help="let up to K workers fail while the others finish training "
                               "(default: 0, stop the run at the first failure)")
    launcher.add_argument("--max-restarts", type=_count, default=0, metavar="K",
                          help="replace a worker that dies (crash, kill, declared dead by its peers) with a new "
                               "process that rejoins the running job, up to K times per launcher "
                               "(default: 0, a dead worker is lost)")
    machines = parser.add_argument_group("several machines (one launcher per machine)")
    machines.add_argument("--nnodes", type=_nproc, default=1, metavar="N",
                          help="number of machines, each running its own `hopnet launch` (default: 1)")
    machines.add_argument("--node-rank", type=_count, default=0, metavar="R",
                          help="this machine's index, 0 to N-1; node 0 hosts the rendezvous (default: 0)")
    machines.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                          help="node 0's address and a free port on it, the same on every machine; "
                               "node 0's launcher listens there")
    security = parser.add_argument_group("security")
    security.add_argument("--key-file", default=None, metavar="PATH",
                          help="CurveZMQ run key: a ZeroMQ certificate with public-key and secret-key "
                               "(made by `hopnet keygen PATH`); turns CURVE on, on loopback too. "
                               "Default: a fresh key per run when --bind is not loopback")
    security.add_argument("--secure", action="store_true",
                          help="use CurveZMQ even on loopback (other users of this machine can reach "
                               "loopback ports)")
    security.add_argument("--insecure", action="store_true",
                          help="plain ZeroMQ sockets even off loopback: no authentication, no encryption")
    from hopnet.config import add_protocol_arguments  # here, not above: `hopnet --help` needs none of it

    add_protocol_arguments(parser)
    parser.add_argument("script", metavar="SCRIPT", nargs="?", default=None,
                        help="the training script (a .py file)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="arguments for the script, passed through untouched")
    parser.set_defaults(func=run, exit_at_once=True)  # the launcher's teardown would only delay the shell


RESUME_DISPLAY_FLAGS = frozenset({"progress", "prefix", "grace"})
"""What a resume may set afresh: how the launcher shows and stops the run, not what it runs."""


def _parse_launch(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hopnet")
    register(parser.add_subparsers())
    return parser.parse_args(["launch", *argv])


def resumed_args(args: argparse.Namespace) -> argparse.Namespace:
    """The recorded run's arguments (``RUN_DIR/launch.json``), for ``--resume RUN_DIR``; a flag of
    ``args`` that differs from both its default and the recorded value raises ConfigError. The
    launcher moves to the recorded working directory, where the recorded relative paths point."""
    from hopnet.config import explicit_options

    run_dir = Path(args.resume)
    try:
        record = json.loads((run_dir / "launch.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--resume {args.resume}: cannot read its launch.json ({exc})") from None
    argv = list(record.get("resumable_argv") or [])
    if not argv:
        raise ConfigError(f"--resume {args.resume}: launch.json records no resumable command line")
    recorded = _parse_launch(argv)
    defaults = _parse_launch([])
    protocol_options = set(explicit_options(args))  # present only when given
    for name, value in vars(args).items():
        if name in ("resume", "func", "script_args") or name in RESUME_DISPLAY_FLAGS:
            continue
        given = name in protocol_options or (hasattr(defaults, name) and value != getattr(defaults, name))
        if given and value != getattr(recorded, name, None):
            flag = "SCRIPT" if name == "script" else "--" + name.replace("_", "-")
            raise ConfigError(f"--resume {args.resume}: {flag} conflicts with the recorded run "
                              "(a resumed run takes its script, arguments and options from launch.json)")
    if args.script_args and list(args.script_args) != list(recorded.script_args):
        raise ConfigError(f"--resume {args.resume}: script arguments conflict with the recorded run")
    for name in RESUME_DISPLAY_FLAGS:
        setattr(recorded, name, getattr(args, name))
    recorded.run_dir = str(run_dir.resolve())
    cwd = record.get("cwd")
    if isinstance(cwd, str) and Path(cwd).is_dir():
        os.chdir(cwd)  # the recorded paths (script, --graph, --checkpoint-dir) may be relative to it
    recorded.overwrite = False
    recorded.resume = args.resume
    recorded.recorded_argv = record.get("argv") or ["hopnet", "launch", *argv]
    return recorded


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()  # the launch's account of its time: start-up includes these checks
    argv = list(sys.argv)
    if args.resume is not None:
        args = resumed_args(args)
        argv = list(args.recorded_argv)
    elif args.script is None:
        raise ConfigError("hopnet launch: SCRIPT is required (or --resume RUN_DIR)")
    from hopnet.config import config_from_args, explicit_options
    from hopnet.launch.spec import LaunchSpec, validate

    plan = validate(LaunchSpec(
        script=args.script,
        script_args=list(args.script_args),
        config=config_from_args(args),
        graph=args.graph,
        nproc=args.nproc,
        run_dir=args.run_dir,
        bind=args.bind,
        prefix=args.prefix,
        module=args.module,
        grace_s=args.grace,
        argv=argv,
        max_failures=args.max_failures,
        max_restarts=args.max_restarts,
        explicit_options=sorted(explicit_options(args)),
        progress=args.progress,
        overwrite=args.overwrite,
        insecure=args.insecure,
        secure=args.secure,
        key_file=args.key_file,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        save_model=args.save_model,
        start_method=args.start_method,
        checkpoint_every=args.checkpoint_every,
        checkpoint_dir=args.checkpoint_dir,
        resume=args.resume is not None,
    ))
    # Only now torch: every argument was checked above, a bad one costs no torch import.
    from hopnet.launch.launcher import run_plan

    result = run_plan(plan, started=started)
    return result.returncode

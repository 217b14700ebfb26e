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


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        NAME,
        help=HELP,
        description=DESCRIPTION,
        epilog=EPILOG,
        allow_abbrev=False,  # a script's --slow must reach it, not be taken for a prefix of --slowdown
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # here, not above: `hopnet --help` needs none of it
    from hopnet.config import add_protocol_arguments
    from hopnet.launch.settings import add_launch_arguments, add_positional_arguments

    add_launch_arguments(parser)

    add_protocol_arguments(parser)
    add_positional_arguments(parser)
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
    from hopnet.launch.settings import spec_from_args
    from hopnet.launch.spec import validate

    plan = validate(spec_from_args(args, config=config_from_args(args), explicit_options=sorted(explicit_options(args)),
                                   argv=argv))
    # Only now torch: every argument was checked above, a bad one costs no torch import.
    from hopnet.launch.launcher import run_plan

    result = run_plan(plan, started=started)
    return result.returncode

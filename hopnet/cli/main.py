"""Entry point of the `hopnet` command: dispatches to one module per subcommand.

Each subcommand module exposes ``register(subparsers)`` which adds its parser and
sets ``func`` to a callable taking the parsed namespace and returning an exit code.
User errors (:class:`hopnet.errors.ConfigError`) become one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hopnet.errors import ConfigError

SUBCOMMAND_MODULES = ("graph_cmd", "launch_cmd", "simulate_cmd", "report_cmd", "keygen_cmd")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="hopnet",
        description="Decentralized, heterogeneity-tolerant data-parallel training for PyTorch.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in SUBCOMMAND_MODULES:
        module = importlib.import_module(f"hopnet.cli.{name}")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"hopnet {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if argv is None and getattr(args, "exit_at_once", False):
        _exit_at_once(code)
    return code


def _exit_at_once(code: int) -> None:
    """The program's end without the interpreter's teardown: with torch loaded that takes
    seconds on a busy machine, after everything was said (`hopnet launch` asks for it)."""
    import atexit
    import os

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())

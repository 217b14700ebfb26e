"""Entry point of the `hopnet` command: dispatches to one module per subcommand.

Each subcommand module exposes ``NAME``, ``HELP`` (its line in `hopnet --help`) and
``register(subparsers)``, which adds its parser and sets ``func`` to a callable taking the
parsed namespace and returning an exit code. Only the parser of the command being run is
built; the others are listed by name and help. A subcommand module's own imports load
neither torch nor numpy (what a command needs it imports when it runs), so `hopnet --help`
and an argument error cost well under a second (tests/test_cli_imports.py, bench/cli_startup.py).
User errors (:class:`hopnet.errors.ConfigError`) become one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Collection, Sequence

from hopnet.errors import ConfigError

SUBCOMMAND_MODULES = ("graph_cmd", "launch_cmd", "join_cmd", "simulate_cmd", "report_cmd", "keygen_cmd")


def build_parser(full: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The `hopnet` parser, with the full parsers of the subcommands named in ``full`` (default:
    all); the others are only listed."""
    parser = argparse.ArgumentParser(
        prog="hopnet",
        description="Decentralized, heterogeneity-tolerant data-parallel training for PyTorch.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in SUBCOMMAND_MODULES:
        module = importlib.import_module(f"hopnet.cli.{name}")
        if full is None or module.NAME in full:
            module.register(subparsers)
        else:
            subparsers.add_parser(module.NAME, help=module.HELP)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names: its first argument that is not an option (`hopnet`
    itself takes no option but ``--help``)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = _command(args_list)
    parser = build_parser(() if command is None else (command,))
    args = parser.parse_args(args_list)
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
    from hopnet.bootstrap.quick_exit import exit_now

    exit_now(code)


if __name__ == "__main__":
    sys.exit(main())

"""`hopnet keygen PATH`: write a CurveZMQ run key for `hopnet launch --key-file PATH`."""

from __future__ import annotations

import argparse
import os
import sys

from hopnet.errors import ConfigError

NAME = "keygen"
HELP = "write a CurveZMQ run key for `hopnet launch --key-file`"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        NAME,
        help=HELP,
        description="Write a fresh CurveZMQ keypair to PATH (a ZeroMQ certificate, readable by "
                    "you only). Give the same file to every launcher of a run with --key-file; "
                    "whoever holds it can join the run.",
    )
    parser.add_argument("path", metavar="PATH", help="file to create (refused if it exists)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hopnet.security import CurveKeys, write_key_file

    keys = CurveKeys.generate()
    try:
        write_key_file(args.path, keys)
    except FileExistsError:
        raise ConfigError(f"{args.path} exists; not overwriting a key file") from None
    except OSError as exc:
        raise ConfigError(f"cannot write {args.path}: {exc.strerror or exc}") from None
    print(f"wrote {os.fspath(args.path)} (public key {keys.public.decode('ascii')})", file=sys.stderr)
    return 0

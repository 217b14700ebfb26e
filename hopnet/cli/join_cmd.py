"""`hopnet join RUN_DIR --nproc K`: add K workers to a running elastic run."""

from __future__ import annotations

import argparse

NAME = "join"
HELP = "add workers to a running elastic run (launched with --max-nproc)"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        NAME,
        help=HELP,
        description="Start K workers that join the running job in RUN_DIR: each gets a new rank, takes its "
                    "state from a neighbour that was there before it, and trains until the run ends. The run "
                    "must have been launched elastic (--max-nproc or --min-nproc). From another machine, give "
                    "the run's rendezvous address (launch.json's \"rendezvous\") and its key file.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="the run's directory (its launch.json says where the run is); the joiners' logs go here")
    parser.add_argument("--nproc", type=int, default=1, metavar="K", help="workers to add (default: 1)")
    parser.add_argument("--rendezvous", metavar="tcp://HOST:PORT", default=None,
                        help="the run's rendezvous, when RUN_DIR holds no launch.json (another machine)")
    parser.add_argument("--key-file", metavar="PATH", default=None,
                        help="the run's key file (`hopnet keygen`), when the run is secured")
    parser.add_argument("--bind", metavar="HOST", default=None,
                        help="host the joiners bind to (default: the run's --bind)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hopnet.launch.join import join_run

    return join_run(args.run_dir, args.nproc, rendezvous=args.rendezvous, key_file=args.key_file, bind=args.bind)

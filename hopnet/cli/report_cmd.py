"""`hopnet report`: plots, tables and a trace of a finished (or running) run, from its run directory."""

from __future__ import annotations

import argparse

NAME = "report"
HELP = "plots and tables of a run, from its run directory"

DESCRIPTION = """\
Read a run directory written by `hopnet launch` (graph.json, launch.json and the
rank{R}.jsonl event logs) and write a report: loss and iteration against wall time per
worker, each worker's time split into compute, waiting for updates, waiting for tokens
and mixing, and the largest iteration gap between neighbours beside Hop's Table 1
bound, under a diagnosis: which ranks or links limited the run, whom each worker waited
on, and an option to try with the simulator's predicted effect. HTML is one
self-contained page; md writes a Markdown page with PNGs beside it.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(NAME, help=HELP,
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (runs/<time>-<protocol>-<graph>)")
    parser.add_argument("-o", "--output", default=None, metavar="OUT",
                        help="the page to write (default: RUN_DIR/report.html or RUN_DIR/report.md)")
    parser.add_argument("--format", choices=("html", "md"), default=None,
                        help="html (default, or from OUT's suffix) or md (PNGs beside the page)")
    parser.add_argument("--trace", default=None, metavar="TRACE.json",
                        help="also write Chrome trace events (open in Perfetto or chrome://tracing)")
    parser.add_argument("--no-predict", action="store_true",
                        help="diagnose without the simulator's predictions (faster; no torch import)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hopnet.report.build import write_report
    from hopnet.report.diagnosis import Predictor

    predictor: Predictor | None = None
    if not args.no_predict:
        from hopnet.sim.whatif import predict

        predictor = predict
    for path in write_report(args.run_dir, args.output, args.format, args.trace, predictor=predictor,
                             echo=lambda line: print(f"diagnosis: {line}")):
        print(f"wrote {path}")
    return 0

"""A hopnet worker for the dead-peer tests: trains (by sleeping) and reports how it ended.

Started with the ``HOPNET_*`` environment of a launcher (the tests start it themselves,
so that no launcher stops the survivors when one worker dies). When a wait fails the
worker writes ``failure_rank{R}.json`` (error class, message, the blamed peer and its
state, the iteration) into the run directory and prints it on stderr as ``FAILED {json}``,
then closes its worker (its neighbours see a ``bye``) and exits 1. A worker that trains to
the end prints ``done at iteration K``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

import hopnet
from hopnet.errors import HopnetError


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--iterations-rank", action="append", default=[], metavar="R:N",
                        help="rank R runs N iterations instead (repeatable)")
    parser.add_argument("--compute-ms", type=float, default=5.0)
    parser.add_argument("--dim", type=int, default=1000)
    parser.add_argument("--gradients", action="store_true",
                        help="start hopnet.init(model) with a linear model (for gradient protocols)")
    parser.add_argument("--model", action="store_true",
                        help="a linear model of --dim inputs with flat gradients (for gradient protocols)")
    args = parser.parse_args()

    rank = int(os.environ["HOPNET_RANK"])
    run_dir = Path(os.environ["HOPNET_RUN_DIR"])
    total = args.iterations
    for item in args.iterations_rank:
        r, n = item.split(":")
        if int(r) == rank:
            total = int(n)
    if args.gradients:  # a gradient protocol reduces the model's flat gradient buffer
        model = torch.nn.Linear(args.dim, 1, bias=False).double()
        worker = hopnet.init(model)
    elif args.model:
        torch.manual_seed(0)
        worker = hopnet.init(torch.nn.Linear(args.dim, 1))
    else:
        params = torch.randn(args.dim, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
        worker = hopnet.init(params=params)
    try:
        for _ in worker.iterations(total):
            time.sleep(args.compute_ms / 1000.0)
            worker.step()
    except HopnetError as exc:
        failure = {"error": type(exc).__name__, "message": str(exc), "peer": getattr(exc, "peer", None),
                   "peer_state": getattr(exc, "peer_state", None), "iter": getattr(exc, "iteration", None)}
        (run_dir / f"failure_rank{rank}.json").write_text(json.dumps(failure))
        print(f"FAILED {json.dumps(failure)}", file=sys.stderr, flush=True)
        worker.close()
        sys.exit(1)
    worker.close()
    print(f"done at iteration {worker.iteration}", flush=True)


if __name__ == "__main__":
    main()

"""A hopnet worker for the multi-process tests: run under `hopnet launch`.

Parameters start at a rank-dependent random vector. With ``--lr 0`` no gradient is
applied, so the run is pure gossip averaging; compute is emulated by sleeping, so
several workers fit on a small machine and slowdowns are exact.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

import hopnet


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=1000)
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--compute-ms", type=float, default=2.0)
    parser.add_argument("--stop-rank", type=int, default=None, help="this rank leaves early")
    parser.add_argument("--stop-at", type=int, default=None, help="iteration at which it leaves")
    parser.add_argument("--stall-rank", type=int, default=None, help="this rank sleeps forever in compute")
    parser.add_argument("--exit-rank", type=int, default=None, help="this rank calls sys.exit(--exit-code)")
    parser.add_argument("--exit-code", type=int, default=3)
    parser.add_argument("--raise-rank", type=int, default=None, help="this rank raises an exception")
    parser.add_argument("--fail-at", type=int, default=5, help="iteration of --stall/--exit/--raise-rank")
    parser.add_argument("--no-close", action="store_true", help="never call worker.close()")
    parser.add_argument("--init-option", action="append", default=[], metavar="NAME=INT",
                        help="pass NAME=INT to hopnet.init (on every rank, or R:NAME=INT on rank R)")
    parser.add_argument("--sleep-before-init", type=float, default=0.0,
                        help="sleep this long before hopnet.init (a worker still starting up)")
    parser.add_argument("--report-loss", action="store_true", help="report the parameters' mean square as loss")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: each rank on GPU LOCAL_RANK mod count")
    args = parser.parse_args()

    rank = int(os.environ["HOPNET_RANK"])
    time.sleep(args.sleep_before_init)
    params = torch.randn(args.dim, generator=torch.Generator().manual_seed(1234 + rank), dtype=torch.float64)
    run_dir = Path(os.environ["HOPNET_RUN_DIR"])
    torch.save(params.clone(), run_dir / f"initial_rank{rank}.pt")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["HOPNET_LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        params = params.to(device)
    options: dict[str, int] = {}
    for item in args.init_option:
        target, _, assignment = item.rpartition(":")
        if target and int(target) != rank:
            continue
        name, _, value = assignment.partition("=")
        options[name] = int(value)
    worker = hopnet.init(params=params, **options)
    for step in worker.iterations(args.iterations):
        if rank == args.stop_rank and step >= args.stop_at:
            break
        if step >= args.fail_at:
            if rank == args.stall_rank:
                time.sleep(3600)
            if rank == args.exit_rank:
                sys.exit(args.exit_code)
            if rank == args.raise_rank:
                raise RuntimeError(f"rank {rank} broke in iteration {step}")
        time.sleep(args.compute_ms / 1000.0)
        if args.report_loss:
            worker.report(loss=float(params.pow(2).mean()))
        worker.step()
    if args.no_close:
        print(f"done at iteration {worker.iteration}, not closing", flush=True)
        return
    worker.close()
    assert params.device.type == args.device  # the model stayed where it was
    torch.save(params.cpu(), run_dir / f"final_rank{rank}.pt")
    print(f"done at iteration {worker.iteration}, dropped {worker.dropped}", flush=True)


if __name__ == "__main__":
    main()

"""A hopnet worker for the multi-process tests: run under `hopnet launch`.

Parameters start at a rank-dependent random vector. With ``--lr 0`` no gradient is
applied, so the run is pure gossip averaging; compute is emulated by sleeping, so
several workers fit on a small machine and slowdowns are exact.
"""

from __future__ import annotations

import argparse
import os
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
    parser.add_argument("--report-loss", action="store_true", help="report the parameters' mean square as loss")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: each rank on GPU LOCAL_RANK mod count")
    args = parser.parse_args()

    rank = int(os.environ["HOPNET_RANK"])
    params = torch.randn(args.dim, generator=torch.Generator().manual_seed(1234 + rank), dtype=torch.float64)
    run_dir = Path(os.environ["HOPNET_RUN_DIR"])
    torch.save(params.clone(), run_dir / f"initial_rank{rank}.pt")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["HOPNET_LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        params = params.to(device)
    worker = hopnet.init(params=params)
    for step in worker.iterations(args.iterations):
        if rank == args.stop_rank and step >= args.stop_at:
            break
        time.sleep(args.compute_ms / 1000.0)
        if args.report_loss:
            worker.report(loss=float(params.pow(2).mean()))
        worker.step()
    worker.close()
    assert params.device.type == args.device  # the model stayed where it was
    torch.save(params.cpu(), run_dir / f"final_rank{rank}.pt")
    print(f"done at iteration {worker.iteration}, dropped {worker.dropped}", flush=True)


if __name__ == "__main__":
    main()

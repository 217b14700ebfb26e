"""What a rank's checkpoints cost its neighbours: their wait, against the copy rank 0 pays.

    python bench/checkpoint_stall.py [--nproc 2] [--model-mb 16] [--compute-ms 20] [--iterations 120]
                                     [--every 20] [--window 10] [--repeat 2] [--writers none,torch,format2]

Real processes: ``hopnet launch --protocol allreduce`` of bench/checkpoint_stall_worker.py
(sleep-emulated compute, a model of ``--model-mb`` MB with SGD momentum: a checkpoint is twice
that). Only rank 0 saves, every ``--every`` iterations, so the other ranks' ``wait_updates_s``
show what its checkpoints cost them: for each checkpoint after iteration K, the time the
neighbours took for iterations K+1 .. K+window (end to end: compute and step, so every wait on
rank 0), minus window times their median iteration outside those windows, is the stall it
caused (median over checkpoints and neighbours; under ``none`` the same iterations give the
measure's value for no stall, a control). Against it:
``save_s``, what ``save_checkpoint`` took rank 0 (the copy, and waiting for a previous write).

Writers, alternated within each repeat so the machine's load hits them alike: ``none`` (no
checkpoint: the it/s baseline), ``torch`` (``torch.save`` as before format 2) and ``format2``
(:func:`hopnet.checkpoint.dump`). Numbers: docs/performance/index.md, "Checkpoints".
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hopnet.analysis import load_run  # noqa: E402

WORKER = str(ROOT / "bench" / "checkpoint_stall_worker.py")


def run_once(writer: str, args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        run_dir = Path(folder) / "run"
        cmd = [sys.executable, "-m", "hopnet.cli.main", "launch", "--nproc", str(args.nproc), "--protocol",
               "allreduce", "--bulk", "zmq", "--run-dir", str(run_dir), "--no-progress", WORKER,
               "--writer", writer, "--model-mb", str(args.model_mb), "--compute-ms", str(args.compute_ms),
               "--iterations", str(args.iterations), "--every", str(args.every)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
        return measure(load_run(run_dir), args)


def measure(logs: dict[int, list[dict[str, Any]]], args: argparse.Namespace) -> dict[str, float]:
    saved = [r for r in logs[0] if r.get("event") == "checkpoint_cost"]
    # Without checkpoints, the same iterations as a control: what the measure gives for no stall.
    points = [int(r["iter"]) for r in saved] or list(range(args.every - 1, args.iterations - 1, args.every))
    stalls: list[float] = []
    rates: list[float] = []
    for rank, records in logs.items():
        ends = {int(r["iter"]): float(r["mono"]) for r in records if r.get("event") == "iteration"}
        first, last = min(ends) + 5, max(ends)  # leave out the start
        rates.append((last - first) / (ends[last] - ends[first]))
        if rank == 0:
            continue
        took = {k: ends[k] - ends[k - 1] for k in ends if k > first}  # compute + step, waits included
        inside = {k for p in points for k in range(p + 1, p + 1 + args.window)}
        baseline = statistics.median(s for k, s in took.items() if k not in inside)
        for p in points:
            spans = [took[k] for k in range(p + 1, p + 1 + args.window) if k in took]
            stalls.append(sum(spans) - baseline * len(spans))
    return {"it_s": statistics.mean(rates),
            "save_ms": statistics.median(r["save_s"] for r in saved) * 1e3 if saved else 0.0,
            "stall_ms": statistics.median(stalls) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--model-mb", type=float, default=16.0)
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--iterations", type=int, default=120)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--window", type=int, default=10, help="iterations after a checkpoint charged to it")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--writers", default="none,torch,format2")
    parser.add_argument("--dir", default=None, help="where the runs write (default: a temporary directory)")
    args = parser.parse_args()
    writers = args.writers.split(",")
    results: dict[str, list[dict[str, float]]] = {w: [] for w in writers}
    for repeat in range(args.repeat):
        for writer in writers:
            result = run_once(writer, args)
            results[writer].append(result)
            print(f"repeat {repeat} {writer:8s} {result['it_s']:7.1f} it/s  rank 0 save {result['save_ms']:7.1f} ms  "
                  f"neighbours' stall per checkpoint {result['stall_ms']:7.1f} ms", flush=True)
    print(f"{args.nproc} ranks, {args.model_mb} MB model (+ momentum), compute {args.compute_ms} ms, "
          f"checkpoint every {args.every} on rank 0, window {args.window}; medians of {args.repeat}:")
    for writer, rows in results.items():
        print(f"  {writer:8s} {statistics.median(r['it_s'] for r in rows):7.1f} it/s  "
              f"save {statistics.median(r['save_ms'] for r in rows):7.1f} ms  "
              f"stall {statistics.median(r['stall_ms'] for r in rows):7.1f} ms")


if __name__ == "__main__":
    main()

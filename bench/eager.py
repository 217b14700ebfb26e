"""eager-SGD against synchronous all-reduce under a random straggler, real processes.

8 workers (`hopnet launch --nproc 8`), 40 ms of sleep-emulated compute per iteration,
``--slowdown random:4:0.125`` (each iteration each worker is 4x slower, +120 ms, with
probability 1/8: one straggler per iteration on average), a 65,536-element float32
gradient all-reduced for real over ZeroMQ. The three protocols run back to back in one
invocation; compare their ratios, not the absolute rates (the machine is shared).

Rate: from each worker's event log, iterations [warmup, end) over the time they took
(``mono`` of the iteration records), averaged over the workers.

    python bench/eager.py                 # ~3 minutes on 2 cores
    python bench/eager.py --iterations 60 # quicker, noisier
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(Path(__file__).resolve().parent / "eager_worker.py")
SETTINGS = {
    "allreduce": ["--protocol", "allreduce"],
    "eager solo": ["--protocol", "eager-sgd", "--eager-mode", "solo"],
    "eager majority": ["--protocol", "eager-sgd", "--eager-mode", "majority"],
}


def rate(run_dir: Path, nproc: int, warmup: int) -> tuple[float, float | None]:
    """Mean iterations/s over the workers, and the mean active processes per round (eager)."""
    rates, active = [], None
    for rank in range(nproc):
        records = [json.loads(line) for line in (run_dir / f"rank{rank}.jsonl").read_text().splitlines()]
        iterations = [r for r in records if r.get("event") == "iteration" and r["iter"] >= warmup]
        first, last = iterations[0], iterations[-1]
        rates.append((last["iter"] - first["iter"]) / (last["mono"] - first["mono"]))
        stop = [r for r in records if r.get("event") == "stop"]
        if stop and stop[-1].get("active_mean") is not None:
            active = stop[-1]["active_mean"]
    return sum(rates) / len(rates), active


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--compute-ms", type=float, default=40.0)
    parser.add_argument("--slowdown", default="random:4:0.125")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results: dict[str, dict[str, float | None]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in SETTINGS.items():
            run_dir = Path(tmp) / name.replace(" ", "_")
            cmd = [sys.executable, "-m", "hopnet.cli.main", "launch", "--nproc", str(args.nproc), *flags,
                   "--slowdown", args.slowdown, "--seed", str(args.seed), "--run-dir", str(run_dir),
                   WORKER, "--compute-ms", str(args.compute_ms), "--iterations", str(args.iterations)]
            began = time.perf_counter()
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                sys.exit(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
            it_s, active = rate(run_dir, args.nproc, args.warmup)
            results[name] = {"it_s": it_s, "active_mean": active, "wall_s": time.perf_counter() - began}
    base = results["allreduce"]["it_s"]
    print(f"{args.nproc} workers, {args.compute_ms:g} ms compute, --slowdown {args.slowdown}, "
          f"{args.iterations} iterations (rates over [{args.warmup}, end))")
    print("| protocol | it/s | x allreduce | mean active per round |")
    print("| --- | ---: | ---: | ---: |")
    for name, r in results.items():
        active = "" if r["active_mean"] is None else f"{r['active_mean']:.2f}"
        print(f"| {name} | {r['it_s']:.2f} | {r['it_s'] / base:.2f} | {active} |")


if __name__ == "__main__":
    main()

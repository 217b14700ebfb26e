"""eager-SGD (solo, majority) against --protocol allreduce and torch DDP under a random straggler.

    python bench/eager.py                              # 8 workers, 3 interleaved rounds (~8-10 min on 2 cores)
    python bench/eager.py --repeat 1 --iterations 100  # one round, quicker, noisier
    python bench/eager.py --runs allreduce,solo,solo-sync --repeat 2

Every run trains bench/ddp.py's digits MLP (64-64-10, 4,810 parameters, SGD momentum 0.9,
cosine learning rate, batches of 32 from the rank's shard) on 8 workers with 40 ms of
sleep-emulated compute per iteration, and each iteration exactly one random worker of the
8 (``straggler(seed, iteration)`` in bench/ddp.py: the same worker in every run) computes
120 ms longer. hopnet runs go through ``hopnet launch`` (real processes over ZeroMQ), DDP
through torchrun (gloo).

The settings take turns, ``--repeat`` rounds of all of them, so a change of the machine's
load hits each alike; tables show medians over rounds, and ratios are medians of each
round's ratio to allreduce in that round.

* ms / iteration: mean over the workers of their own clock over iterations
  ``[--warmup, end)`` (bench/ddp.py's ``summarize``); throughput = its inverse.
* accuracy: each worker's own model on the held-out split after the last iteration
  (min and mean over the 8), and seconds until every worker's model scored >= --target.
* NAP: mean number of active processes (fresh gradients) per eager round.

Numbers: docs/performance/index.md, "eager-SGD".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ddp  # noqa: E402  (bench/ddp.py: the training worker, its launchers and summary)

RUNS = {
    "ddp": None,
    "allreduce": ["--protocol", "allreduce"],
    "solo": ["--protocol", "eager-sgd", "--eager-mode", "solo"],
    "majority": ["--protocol", "eager-sgd", "--eager-mode", "majority"],
    "solo-sync": ["--protocol", "eager-sgd", "--eager-mode", "solo", "--full-sync-every", "30"],
    "majority-sync": ["--protocol", "eager-sgd", "--eager-mode", "majority", "--full-sync-every", "30"],
}
LABELS = {"ddp": "DDP (gloo)", "allreduce": "hopnet allreduce", "solo": "eager-SGD solo",
          "majority": "eager-SGD majority", "solo-sync": "eager-SGD solo, --full-sync-every 30",
          "majority-sync": "eager-SGD majority, --full-sync-every 30"}


def load() -> str:
    return (f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
            f"at {time.strftime('%H:%M:%S', time.gmtime())} UTC")


def active_mean(run_dir: Path) -> float | None:
    """Mean active processes per round (eager-sgd's ``stop`` record), mean over ranks."""
    values = []
    for log in run_dir.glob("rank*.jsonl"):
        for line in log.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == "stop" and record.get("active_mean") is not None:
                values.append(record["active_mean"])
    return statistics.mean(values) if values else None


def one_run(name: str, args: argparse.Namespace) -> dict:
    run_dir = Path(args.out).resolve() / name
    flags = RUNS[name]
    for attempt in (1, 2):
        try:
            if flags is None:
                wall = ddp.run_ddp([], run_dir, args)
            else:
                wall = ddp.run_hopnet(name, flags, [], run_dir, args)
            break
        except SystemExit as failure:  # a worker died (gloo once aborted a rank under heavy load): say so, retry once
            print(f"{name} attempt {attempt} failed: {str(failure).splitlines()[0]}", flush=True)
            if attempt == 2:
                raise
    row = ddp.summarize(name, run_dir, args.nproc, wall, args)
    row["nap"] = active_mean(run_dir)
    row["final_acc"] = [json.loads((run_dir / f"bench_rank{r}.json").read_text())["evals"][-1][2]
                        for r in range(args.nproc)]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="ddp,allreduce,solo,majority",
                        help=f"settings, in order, from {','.join(RUNS)}")
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--compute-ms", type=float, default=40.0)
    parser.add_argument("--straggler-ms", type=float, default=120.0)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/bench-eager")
    parser.add_argument("--json", default=None, help="also write every run's numbers to this file")
    args = parser.parse_args()
    names = args.runs.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise SystemExit(f"bench/eager.py: error: unknown run(s) {', '.join(unknown)} (choose from {', '.join(RUNS)})")

    print(f"{args.nproc} workers, {args.compute_ms:g} ms compute, +{args.straggler_ms:g} ms on one random worker "
          f"per iteration, {args.iterations} iterations; start: {load()}", flush=True)
    rounds: list[dict[str, dict]] = []
    for i in range(args.repeat):
        rounds.append({})
        for name in names:
            row = one_run(name, args)
            rounds[-1][name] = row
            print(f"round {i + 1} {name}: {row['ms_per_iter']:.1f} ms/it, acc min {row['final_acc_min']:.3f} "
                  f"mean {row['final_acc_mean']:.3f}, NAP {row['nap']}, to {args.target}: {row['to_target_max']:.2f} s; "
                  f"{load()}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rounds, indent=1) + "\n")

    med = statistics.median
    base = "allreduce" if "allreduce" in names else names[0]
    print(f"\nmedians over {args.repeat} round(s); ratios: median of each round's ratio to {base}")
    print(f"| run | ms / iteration | it/s | throughput x {base} | x DDP | final accuracy min / mean "
          f"(of {args.nproc} workers) | x {base}, points (mean) | s to {args.target:.2f} | NAP |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for name in names:
        rows = [r[name] for r in rounds]
        ms = med(r["ms_per_iter"] for r in rows)
        x_base = med(r[base]["ms_per_iter"] / r[name]["ms_per_iter"] for r in rounds)
        x_ddp = med(r["ddp"]["ms_per_iter"] / r[name]["ms_per_iter"] for r in rounds) if "ddp" in names else float("nan")
        acc_min, acc_mean = med(r["final_acc_min"] for r in rows), med(r["final_acc_mean"] for r in rows)
        points = med(100 * (r[name]["final_acc_mean"] - r[base]["final_acc_mean"]) for r in rounds)
        naps = [r["nap"] for r in rows if r["nap"] is not None]
        nap = f"{med(naps):.2f} of {args.nproc}" if naps else ""
        print(f"| {LABELS[name]} | {ms:.1f} | {1000 / ms:.2f} | {x_base:.2f}x | {x_ddp:.2f}x | "
              f"{acc_min:.3f} / {acc_mean:.3f} | {points:+.1f} | {med(r['to_target_max'] for r in rows):.2f} | {nap} |")
    print("\nfinal accuracy per rank, per round:")
    for name in names:
        print(f"  {name}: " + "; ".join(" ".join(f"{a:.3f}" for a in r[name]["final_acc"]) for r in rounds))
    print(f"end: {load()}")


if __name__ == "__main__":
    main()

"""Time to a target held-out loss on a language model: hopnet's protocols against torch DDP in one invocation.

    python bench/lm.py --scenario none        # 4 workers, homogeneous
    python bench/lm.py --scenario straggler   # rank 0 4x slower (--slowdown rank=0:4; DDP: the same stretch)
    python bench/lm.py --preset small --iterations 600 --eval-every 50   # 10.7M parameters: a bigger machine

Every run trains examples/train_lm.py (the byte-level decoder on the stdlib's source, AdamW,
warm-up + cosine, two micro-batches, clipping, bf16) for ``--iterations`` on ``--nproc`` workers:
DDP first, through torchrun and its twin bench/lm_ddp.py (gloo), then each hopnet run through
``hopnet launch`` with the example unchanged. The **target** is the held-out loss DDP reaches after
``--budget`` of its ``--iterations`` (default: half; every run has the same schedule, so that a
protocol whose iterations each gain less than DDP's has room to get there in more of them). A
run's time to target is the time until *every* worker's own model first scores at or below it
(each worker's clock from the start of its training loop, evaluated every ``--eval-every``
iterations; the evaluations' own time is in it, alike for all). ``DDP / this`` above 1 is sooner than DDP. Hop runs with the options the README gives for
a persistent straggler under ``--scenario straggler`` (``hop-skip``); ``diloco-avg`` is DiLoCo with
a plain average for its outer step (``--outer-lr 1 --outer-momentum 0``), ``allreduce-torch`` the
all-reduce over gloo (``--bulk torch``); ``--runs`` picks others.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_lm.py"
TWIN = ROOT / "bench" / "lm_ddp.py"

SCENARIOS = {"none": [], "straggler": ["rank=0:4"]}
RUNS = {
    "allreduce": ["--protocol", "allreduce"],
    "hop": [],
    "hop-skip": ["--backup-workers", "1", "--skip-threshold", "2", "--max-jump", "10", "--max-ig", "4"],
    "ad-psgd": ["--protocol", "ad-psgd"],
    "partial-reduce": ["--protocol", "partial-reduce"],
    "diloco": ["--protocol", "diloco", "--local-steps", "10"],
    "diloco-avg": ["--protocol", "diloco", "--local-steps", "10", "--outer-lr", "1", "--outer-momentum", "0"],
    "diloco-quorum": ["--protocol", "diloco", "--local-steps", "10", "--outer-quorum", "3"],
    "allreduce-torch": ["--protocol", "allreduce", "--bulk", "torch"],
}
DEFAULT_RUNS = {"none": "ddp,allreduce,allreduce-torch,hop,ad-psgd,partial-reduce,diloco,diloco-avg",
                "straggler": "ddp,allreduce,hop-skip,ad-psgd,partial-reduce,diloco,diloco-avg"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def example_args(args: argparse.Namespace) -> list[str]:
    return ["--preset", args.preset, "--iterations", str(args.iterations), "--eval-every", str(args.eval_every),
            "--seed", str(args.seed), "--device", args.device, *args.example_args.split()]


def run(name: str, cmd: list[str]) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [
        str(ROOT), os.environ.get("PYTHONPATH")])))
    start = time.monotonic()
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-20:])
        raise SystemExit(f"bench/lm.py: {name} failed (exit {result.returncode}):\n{tail}")
    return time.monotonic() - start


def run_ddp(run_dir: Path, slowdown: list[str], args: argparse.Namespace) -> list[list[tuple[int, float, float]]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(TWIN), "--out", str(run_dir),
           *[f"--slowdown={spec}" for spec in slowdown], *example_args(args)]
    for old in run_dir.glob("lm_rank*.json"):
        old.unlink()
    run("ddp", cmd)
    ranks = [json.loads((run_dir / f"lm_rank{r}.json").read_text()) for r in range(args.nproc)]
    return [[(int(i), float(t), float(loss)) for i, t, loss in data["evals"]] for data in ranks]


def run_hopnet(name: str, run_dir: Path, slowdown: list[str],
               args: argparse.Namespace) -> tuple[list[list[tuple[int, float, float]]], float | None]:
    cmd = [sys.executable, "-m", "hopnet.cli.main", "launch", "--nproc", str(args.nproc), "--run-dir", str(run_dir),
           "--overwrite", "--no-progress", "--seed", str(args.seed), *RUNS[name],
           *[f"--slowdown={spec}" for spec in slowdown], str(EXAMPLE), *example_args(args)]
    run(name, cmd)
    evals: list[list[tuple[int, float, float]]] = []
    consensus = None
    for r in range(args.nproc):
        mine = []
        for line in (run_dir / f"rank{r}.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record.get("event") != "eval":
                continue
            if record.get("consensus"):
                consensus = record["loss"] if consensus is None else consensus
            else:
                iteration = args.iterations - 1 if record.get("final") else record["iter"]
                mine.append((int(iteration), float(record["elapsed"]), float(record["loss"])))
        evals.append(mine)
    return evals, consensus


def summarize(name: str, evals: list[list[tuple[int, float, float]]], consensus: float | None,
              target: float, args: argparse.Namespace) -> dict:
    reach = [next(((t, i + 1) for i, t, loss in rank if i >= 0 and loss <= target), (math.inf, math.inf))
             for rank in evals]
    finals = [rank[-1][2] for rank in evals]
    return {"name": name, "to_target_s": max(t for t, _ in reach), "iters_to_target": max(i for _, i in reach),
            "s_per_iteration": statistics.mean(rank[-1][1] for rank in evals) / args.iterations,
            "final_worst": max(finals), "final_best": min(finals),
            "consensus": finals[0] if consensus is None else consensus}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="none")
    parser.add_argument("--runs", default=None, help=f"comma-separated, ddp first; of ddp, {', '.join(RUNS)}")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--budget", type=int, default=None,
                        help="DDP's iterations that set the target (default: half of --iterations)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--example-args", default="", help="more flags for examples/train_lm.py, quoted")
    parser.add_argument("--out", default="runs/bench-lm")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    budget = args.budget or args.eval_every * max(1, round(0.5 * args.iterations / args.eval_every))
    names = (args.runs or DEFAULT_RUNS[args.scenario]).split(",")
    if names[0] != "ddp" or any(n not in RUNS for n in names[1:]):
        raise SystemExit(f"bench/lm.py: error: --runs must start with ddp and name runs of {', '.join(RUNS)}")
    slowdown = SCENARIOS[args.scenario]
    out = Path(args.out).resolve() / args.scenario
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)

    ddp_evals = run_ddp(out / "ddp", slowdown, args)
    at_budget = [loss for i, _, loss in ddp_evals[0] if i + 1 == budget]
    if not at_budget:
        raise SystemExit(f"bench/lm.py: error: --budget {budget} is not an evaluation point (--eval-every)")
    target = at_budget[0]
    print(f"target: held-out loss {target:.4f}, DDP's after {budget} of {args.iterations} iterations", flush=True)
    rows = [summarize("ddp", ddp_evals, None, target, args)]
    for name in names[1:]:
        try:
            evals, consensus = run_hopnet(name, out / name, slowdown, args)
        except SystemExit as failed:  # one run's failure is a row of the table, not the end of the others
            print(failed, file=sys.stderr, flush=True)
            rows.append({"name": f"{name} (failed)", "to_target_s": math.inf, "iters_to_target": math.inf,
                         "s_per_iteration": math.nan, "final_worst": math.nan, "final_best": math.nan,
                         "consensus": math.nan})
            continue
        rows.append(summarize(name, evals, consensus, target, args))
    for row in rows:
        print(f"{args.scenario} {row['name']}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                          for k, v in row.items() if k != "name"), flush=True)
    print(f"load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")

    ddp = rows[0]
    print(f"\n| {args.scenario}: run | s / iteration | s to {target:.3f} (all workers) | DDP / this | "
          "iterations to target | final loss (worst worker) | consensus model |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        reached = math.isfinite(r["to_target_s"])
        print(f"| {r['name']} | {r['s_per_iteration']:.3f} | {r['to_target_s']:.1f} | "
              f"{ddp['to_target_s'] / r['to_target_s'] if reached else 0.0:.2f}x | "
              f"{r['iters_to_target'] if reached else 'not reached'} | {r['final_worst']:.4f} | {r['consensus']:.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"target": target, "budget": budget, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

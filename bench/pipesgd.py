"""Pipe-SGD benchmark: K = 1 vs K = 2 (+ compression) vs --protocol allreduce and torch DDP, same run.

    python bench/pipesgd.py [--nproc 4] [--model-mb 4] [--iterations 40] [--warmup 8] [--repeat 3]
                            [--compute-ms C] [--only NAME,NAME] [--json FILE] [--accuracy]

Real processes: ``hopnet launch`` of bench/pipesgd_worker.py over ZeroMQ on 127.0.0.1
(``--bulk zmq``: the ring, which carries the compression), and the same worker under
torchrun with torch DDP (gloo):

1. Calibrate: ``--protocol allreduce`` with no compute; M is its all-reduce time, from
   the last rank's arrival to the last rank's end (the ranks' timelines lined up on the
   machine's shared monotonic clock).
2. Set the compute C = M (a sleep, so the workers' CPUs stay free for the all-reduce)
   and run DDP, allreduce, pipe-sgd K=1, K=2, K=2 trunc16 and K=2 int8, ``--repeat``
   rounds of all of them; the table shows medians over rounds (ratios are medians of each
   round's ratio), so slow drift of the machine's load hits every setting alike. Per
   setting: seconds per iteration, its ratio to max(C, M) (Eq. 4: 1.0 is perfect
   overlap) with the calibration's M and with the M of the round's allreduce run, the
   speed-ups, and where the iteration went (compute, time in step(), the all-reduce once
   all ranks arrived, the ranks' arrival skew, CPU per worker-iteration, cores busy), and
   the bytes each worker sent per iteration.
3. ``--accuracy``: the digits example (examples/train_digits.py, 300 iterations) with
   allreduce, pipe-sgd K=2 and K=2 int8: held-out accuracy, mean over ranks.

Numbers: docs/performance/index.md, "Pipe-SGD".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "bench" / "pipesgd_worker.py")
DIGITS = str(ROOT / "examples" / "train_digits.py")
RESULT = re.compile(r"^\[rank (\d+)\] (\{.*\})$", re.MULTILINE)
ACCURACY = re.compile(r"^\[rank (\d+)\] final held-out accuracy ([0-9.]+)", re.MULTILINE)


def launch(flags: list[str], script: str, script_args: list[str], nproc: int) -> str:
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "hopnet.cli.main", "launch", "--nproc", str(nproc), "--run-dir",
               str(Path(run_dir) / "run"), "--no-progress", "--bulk", "zmq", *flags, script, *script_args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def launch_ddp(script_args: list[str], nproc: int) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
               "127.0.0.1", "--master-port", str(port), WORKER, "--role", "ddp", "--out", out, *script_args]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        return "\n".join(f"[rank {r}] {Path(out, f'rank{r}.json').read_text()}" for r in range(nproc))


def timed(flags: list[str] | None, args: argparse.Namespace, compute_ms: float) -> dict[str, float]:
    """One run: means over ranks of the workers' numbers, and the ranks' timelines lined up
    (``flags`` None runs torch DDP). See :func:`timeline` for ``ring_s`` and ``skew_s``."""
    script_args = ["--compute-ms", f"{compute_ms:.3f}", "--model-mb", str(args.model_mb),
                   "--iterations", str(args.iterations), "--warmup", str(args.warmup)]
    out = launch_ddp(script_args, args.nproc) if flags is None else launch(flags, WORKER, script_args, args.nproc)
    rows = [json.loads(text) for _, text in RESULT.findall(out)]
    if len(rows) != args.nproc:
        raise SystemExit(f"expected {args.nproc} results, got:\n{out}")
    result = {key: statistics.mean(r[key] for r in rows) for key in rows[0]
              if isinstance(rows[0][key], float)}
    result.update(timeline(rows))
    result["cores_used"] = args.nproc * result["cpu_s"] / result["s_per_iter"]
    return result


def timeline(rows: list[dict]) -> dict[str, float]:
    """Line up the ranks on the shared monotonic clock, per iteration t:

    * ``skew_s``: the last rank's arrival at its all-reduce of t minus the first's (arrival:
      step() began for allreduce / DDP; the all-reduce task could start for pipe-sgd, i.e.
      launched and its predecessor done);
    * ``ring_s``: the all-reduce of t from the last arrival to the last rank's end: the
      communication itself, once nobody is waited for.
    """
    arrive: dict[int, list[float]] = {}
    end: dict[int, list[float]] = {}
    for r in rows:
        if r["comm"]:
            for t, launched, began, ended in r["comm"]:
                arrive.setdefault(t, []).append(max(launched, began))
                end.setdefault(t, []).append(ended)
        else:
            for t, _, step_began, step_ended in r["trace"]:
                arrive.setdefault(t, []).append(step_began)
                end.setdefault(t, []).append(step_ended)
    full = [t for t in arrive if len(arrive[t]) == len(rows) and len(end[t]) == len(rows)]
    return {"skew_s": statistics.mean(max(arrive[t]) - min(arrive[t]) for t in full),
            "ring_s": statistics.mean(max(end[t]) - max(arrive[t]) for t in full)}


def load() -> str:
    return f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at {time.strftime('%H:%M:%S', time.gmtime())} UTC"


SETTINGS: list[tuple[str, list[str] | None]] = [
    ("DDP (gloo)", None),
    ("allreduce", ["--protocol", "allreduce"]),
    ("pipe-sgd K=1", ["--protocol", "pipe-sgd", "--pipeline-k", "1"]),
    ("pipe-sgd K=2", ["--protocol", "pipe-sgd", "--pipeline-k", "2"]),
    ("pipe-sgd K=2 trunc16", ["--protocol", "pipe-sgd", "--compress", "trunc16"]),
    ("pipe-sgd K=2 int8", ["--protocol", "pipe-sgd", "--compress", "int8"]),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--model-mb", type=float, default=4.0)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3, help="rounds of all settings (default: 3)")
    parser.add_argument("--compute-ms", type=float, default=None,
                        help="compute C (default: C = the all-reduce time M measured first)")
    parser.add_argument("--only", default=None, help="comma-separated setting names (default: all)")
    parser.add_argument("--json", default=None, help="also write every run's numbers to this file")
    parser.add_argument("--accuracy", action="store_true", help="also train digits and compare accuracy")
    args = parser.parse_args()
    settings = SETTINGS if args.only is None else [s for s in SETTINGS if s[0] in args.only.split(",")]

    print(f"start: {load()}", flush=True)
    calibration = timed(["--protocol", "allreduce"], args, 0.0)
    comm_s = calibration["ring_s"]
    compute_ms = comm_s * 1000 if args.compute_ms is None else args.compute_ms
    print(f"{args.nproc} workers, {args.model_mb} MB gradient. Calibration (allreduce, no compute): "
          f"M = {comm_s * 1000:.1f} ms per all-reduce once all arrived ({calibration['step_s'] * 1000:.1f} ms in "
          f"step(), {calibration['s_per_iter'] * 1000:.1f} ms per iteration, arrival skew "
          f"{calibration['skew_s'] * 1000:.1f} ms, CPU {calibration['cpu_s'] * 1000:.1f} ms per worker-iteration). Compute sleep C = {compute_ms:.1f} ms. "
          f"{load()}", flush=True)
    rounds = []
    for i in range(args.repeat):
        rounds.append({name: timed(flags, args, compute_ms) for name, flags in settings})
        print(f"round {i + 1}: " + ", ".join(f"{name} {r['s_per_iter'] * 1000:.0f}" for name, r in rounds[-1].items())
              + f" ms/it; {load()}", flush=True)
    med = statistics.median
    measured_c = med(r[name]["compute_s"] for r in rounds for name, _ in settings)
    bound = max(measured_c, comm_s)
    in_round = "allreduce" in rounds[0]
    # M as the machine's load had it in each round: that round's allreduce, from the last
    # arrival to the last rank's end (the load moves between calibration and the rounds).
    round_m = [r["allreduce"]["ring_s"] if in_round else comm_s for r in rounds]
    print(f"\nmeasured C (trainer's time outside step(), median over runs) = {measured_c * 1000:.1f} ms; "
          f"calibration M = {comm_s * 1000:.1f} ms; M in the rounds (allreduce's all-reduce once all arrived) = "
          + ", ".join(f"{m * 1000:.1f}" for m in round_m) + " ms; "
          f"max(C, calibration M) = {bound * 1000:.1f} ms; C + M = {(measured_c + comm_s) * 1000:.1f} ms\n")
    print("| setting | ms / iteration | / max(C, M) | / max(C, M of the round) | speed-up vs allreduce | vs DDP | "
          "C: compute (trainer) ms | in step() ms | all-reduce once all arrived ms | arrival skew ms | "
          "CPU ms / worker-it | cores busy | MB sent / iteration | bytes vs allreduce |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, flags in settings:
        cell = lambda key: med(r[name][key] for r in rounds)  # noqa: E731
        s = cell("s_per_iter")
        of_round = med(r[name]["s_per_iter"] / max(r[name]["compute_s"], m) for r, m in zip(rounds, round_m))
        speedup = med(r["allreduce"]["s_per_iter"] / r[name]["s_per_iter"] for r in rounds) \
            if in_round else float("nan")
        vs_ddp = med(r["DDP (gloo)"]["s_per_iter"] / r[name]["s_per_iter"] for r in rounds) \
            if "DDP (gloo)" in rounds[0] else float("nan")
        sent = cell("bytes_per_iter")
        fewer = "" if flags is None or not in_round else \
            f"{med(r['allreduce']['bytes_per_iter'] / r[name]['bytes_per_iter'] for r in rounds):.2f}x fewer"
        print(f"| {name} | {s * 1000:.1f} | {s / bound:.2f} | {of_round:.2f} | {speedup:.2f}x | {vs_ddp:.2f}x | "
              f"{cell('compute_s') * 1000:.1f} | {cell('step_s') * 1000:.1f} | {cell('ring_s') * 1000:.1f} | "
              f"{cell('skew_s') * 1000:.1f} | {cell('cpu_s') * 1000:.1f} | {cell('cores_used'):.2f} | "
              f"{'' if flags is None else f'{sent / 1e6:.3f}'} | {fewer} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"M_s": comm_s, "C_s": measured_c, "rounds": rounds}, indent=1))
    print(f"\nend: {load()}")

    if args.accuracy:
        print("\n| digits, 300 iterations | held-out accuracy (mean of ranks) |\n| --- | --- |")
        for name, flags in [("allreduce", ["--protocol", "allreduce"]),
                            ("pipe-sgd K=2", ["--protocol", "pipe-sgd"]),
                            ("pipe-sgd K=2 int8", ["--protocol", "pipe-sgd", "--compress", "int8"])]:
            out = launch(flags, DIGITS, [], args.nproc)
            accuracies = [float(a) for _, a in ACCURACY.findall(out)]
            print(f"| {name} | {statistics.mean(accuracies):.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

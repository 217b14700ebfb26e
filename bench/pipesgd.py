"""Pipe-SGD benchmark: K = 1 vs K = 2 vs --protocol allreduce, and compressed bytes, same run.

    python bench/pipesgd.py [--nproc 4] [--model-mb 4] [--iterations 40] [--warmup 8] [--repeat 3] [--accuracy]

Real processes (``hopnet launch`` of bench/pipesgd_worker.py over ZeroMQ on 127.0.0.1):

1. Calibrate: ``--protocol allreduce`` with no compute; its time per iteration is the
   all-reduce time M of a ``--model-mb`` gradient among ``--nproc`` workers.
2. Set the compute C = M (a sleep, so the workers' CPUs stay free for the all-reduce)
   and run allreduce, pipe-sgd K=1, K=2, K=2 trunc16 and K=2 int8. Report seconds per
   iteration (mean over ranks, after the warm-up), its ratio to max(C, M) (Eq. 4: 1.0 is
   perfect overlap), the speed-up over allreduce, and the bytes each worker sent per
   iteration, as a ratio of the uncompressed bytes. The settings take turns, ``--repeat``
   rounds of all of them; the table shows medians over rounds (ratios are medians of
   each round's ratio), so slow drift of the machine's load hits every setting alike.
3. ``--accuracy``: the digits example (examples/train_digits.py, 300 iterations) with
   allreduce, pipe-sgd K=2 and K=2 int8: held-out accuracy, mean over ranks.

Numbers: bench/README.md, "Pipe-SGD".
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "bench" / "pipesgd_worker.py")
DIGITS = str(ROOT / "examples" / "train_digits.py")
RESULT = re.compile(r"^\[rank (\d+)\] (\{.*\})$", re.MULTILINE)
ACCURACY = re.compile(r"^\[rank (\d+)\] final held-out accuracy ([0-9.]+)", re.MULTILINE)


def launch(flags: list[str], script: str, script_args: list[str], nproc: int) -> str:
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "hopnet.cli.main", "launch", "--nproc", str(nproc), "--run-dir",
               str(Path(run_dir) / "run"), *flags, script, *script_args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def timed(flags: list[str], args: argparse.Namespace, compute_ms: float) -> tuple[float, float]:
    """Seconds per iteration and bytes sent per iteration, means over ranks."""
    out = launch(flags, WORKER, ["--compute-ms", f"{compute_ms:.3f}", "--model-mb", str(args.model_mb),
                                 "--iterations", str(args.iterations), "--warmup", str(args.warmup)], args.nproc)
    rows = [json.loads(text) for _, text in RESULT.findall(out)]
    if len(rows) != args.nproc:
        raise SystemExit(f"expected {args.nproc} results, got:\n{out}")
    return statistics.mean(r["s_per_iter"] for r in rows), statistics.mean(r["bytes_per_iter"] for r in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--model-mb", type=float, default=4.0)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3, help="rounds of all settings (default: 3)")
    parser.add_argument("--accuracy", action="store_true", help="also train digits and compare accuracy")
    args = parser.parse_args()

    comm_s, _ = timed(["--protocol", "allreduce"], args, 0.0)
    compute_ms = comm_s * 1000
    bound = max(comm_s, compute_ms / 1000)
    print(f"{args.nproc} workers, {args.model_mb} MB gradient: all-reduce M = {comm_s * 1000:.1f} ms; "
          f"compute C = M; max(C, M) = {bound * 1000:.1f} ms, C + M = {2 * bound * 1000:.1f} ms\n")
    settings = [("allreduce", ["--protocol", "allreduce"]),
                ("pipe-sgd K=1", ["--protocol", "pipe-sgd", "--pipeline-k", "1"]),
                ("pipe-sgd K=2", ["--protocol", "pipe-sgd", "--pipeline-k", "2"]),
                ("pipe-sgd K=2 trunc16", ["--protocol", "pipe-sgd", "--compress", "trunc16"]),
                ("pipe-sgd K=2 int8", ["--protocol", "pipe-sgd", "--compress", "int8"])]
    rounds = []
    for _ in range(args.repeat):
        rounds.append({name: timed(flags, args, compute_ms) for name, flags in settings})
    med = statistics.median
    print("| setting | ms / iteration | / max(C, M) | speed-up vs allreduce | MB sent / iteration | bytes vs uncompressed |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, _ in settings:
        s = med(r[name][0] for r in rounds)
        sent = med(r[name][1] for r in rounds)
        speedup = med(r["allreduce"][0] / r[name][0] for r in rounds)
        fewer = med(r["allreduce"][1] / r[name][1] for r in rounds)
        print(f"| {name} | {s * 1000:.1f} | {s / bound:.2f} | {speedup:.2f}x | {sent / 1e6:.3f} | {fewer:.2f}x fewer |")
    print("\nper round, ms / iteration: " + "; ".join(
        ", ".join(f"{name} {r[name][0] * 1000:.0f}" for name, _ in settings) for r in rounds))

    if args.accuracy:
        print("\n| digits, 300 iterations | held-out accuracy (mean of ranks) |\n| --- | --- |")
        for name, flags in [("allreduce", ["--protocol", "allreduce"]),
                            ("pipe-sgd K=2", ["--protocol", "pipe-sgd"]),
                            ("pipe-sgd K=2 int8", ["--protocol", "pipe-sgd", "--compress", "int8"])]:
            out = launch(flags, DIGITS, [], args.nproc)
            accuracies = [float(a) for _, a in ACCURACY.findall(out)]
            print(f"| {name} | {statistics.mean(accuracies):.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

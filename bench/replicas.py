"""Replica groups against one process per replica: bytes each process sends between replicas per
iteration, peak memory per process, and the time spent inside the replica.

Three settings of the same model (bench/replica_worker.py, an MLP of ``--model-mb`` MB), Hop
between 2 replicas:

* ``leader``: 2 processes, each the only process of its replica: it holds the whole model and
  carries all of its replica's traffic between replicas (what one leader per replica would send);
* ``ddp``: 2 replicas of ``--replica-size`` processes, DDP inside: each process sends its shard;
* ``fsdp``: the same with FSDP inside: parameters, gradients, optimizer state and Hop's buffers
  sharded too.

Bytes are the kernel's counters of each process's connections to its lane peers (the ``links``
record, taken at the consensus), divided by the iterations; so they include the consensus and the
protocol's headers. Memory is each process's peak RSS (``VmHWM``) less its RSS before
``hopnet.init`` (the model already built), in MB of 10^6 bytes.

    python bench/replicas.py --model-mb 40 --iterations 30
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "bench" / "replica_worker.py"
MB = 1e6


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(setting: str, size: int, args: argparse.Namespace, where: Path) -> dict:
    run_dir = where / setting
    replicas = 2
    flags = ["--nproc", str(replicas)] if setting == "leader" else \
        ["--nproc", str(replicas * size), "--replica-size", str(size), "--replica-mode", setting]
    command = [sys.executable, "-m", "hopnet.cli.main", "launch", *flags, "--bulk", "zmq", "--run-dir", str(run_dir),
               "--no-progress",
               str(WORKER), "--model-mb", str(args.model_mb), "--iterations", str(args.iterations)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{setting}: {done.stderr[-2000:]}")
    logs = sorted(run_dir.glob("rank*.jsonl")) + sorted(run_dir.glob("lane*/rank*.jsonl"))
    processes = []
    for log in logs:
        records = _records(log)
        bench = next(r for r in records if r["event"] == "replica_bench")
        links = next((r for r in records if r["event"] == "links"), {"peers": {}})
        sent = sum(p.get("bytes_sent", 0) for p in links["peers"].values())
        replica_s = sum(r.get("replica_s", 0.0) for r in records if r["event"] == "iteration")
        busy = sum(sum(r.get(p, 0.0) for p in ("compute_s", "wait_updates_s", "wait_tokens_s", "mix_s"))
                   for r in records if r["event"] == "iteration")
        processes.append({"sent_per_iter": sent / args.iterations, "peak": bench["peak_kb"] * 1024 / MB,
                          "beyond": (bench["peak_kb"] - bench["baseline_kb"]) * 1024 / MB, "rate": bench["rate"],
                          "inside": replica_s / busy if busy else 0.0})
    return {"setting": setting, "processes": len(processes),
            "max_sent": max(p["sent_per_iter"] for p in processes) / MB,
            "replica_sent": sum(p["sent_per_iter"] for p in processes) / replicas / MB,
            "peak": max(p["peak"] for p in processes), "beyond": max(p["beyond"] for p in processes),
            "rate": min(p["rate"] for p in processes), "inside": max(p["inside"] for p in processes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-mb", type=float, default=40.0)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--replica-size", type=int, default=2)
    parser.add_argument("--settings", default="leader,ddp,fsdp")
    args = parser.parse_args()
    print(f"model {args.model_mb:g} MB, Hop between 2 replicas, {args.iterations} iterations")
    print("| setting | processes | MB sent per iteration, busiest process | per replica | peak RSS MB | "
          "beyond the model's build MB | it/s | time inside the replica |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for setting in args.settings.split(","):
            row = run(setting, args.replica_size, args, Path(tmp))
            print(f"| {row['setting']} | {row['processes']} | {row['max_sent']:.1f} | {row['replica_sent']:.1f} | "
                  f"{row['peak']:.0f} | {row['beyond']:.0f} | {row['rate']:.2f} | {100 * row['inside']:.0f}% |",
                  flush=True)


if __name__ == "__main__":
    main()

"""Elastic runs, measured: 4 workers on digits, 2 join with one `hopnet join` once training runs,
then rank 2 gets SIGTERM once they trained; per protocol, how the run ended and what the changes cost.

    python bench/elastic.py [--protocols hop allreduce diloco] [--iterations 6000] [--keep DIR]
    python bench/elastic.py --protocols diloco --hidden 340000 --iterations 400 --join-after 40   # ~100 MB

Columns: the launcher's and `hopnet join`'s exit codes, rank 2's exit code, the views, the time
from `hopnet join` to a joiner's first iteration (process start, torch import and admission
included), the joiners' wait inside hopnet.init (admission and state transfer), the longest
stall a member had at a view change, and the lowest final accuracy of the members that finished."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DIGITS = str(ROOT / "examples" / "train_digits.py")
FLAGS = {"diloco": ["--local-steps", "8"]}


def _records(run_dir: Path, rank: int, event: str) -> list[dict[str, Any]]:
    path = run_dir / f"rank{rank}.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == event:
            out.append(record)
    return out


def _wait(what: str, ready: Any, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def run(protocol: str, iterations: int, base: Path, hidden: int, join_after: int, keep: bool = False
        ) -> dict[str, Any]:
    run_dir = base / protocol
    base.mkdir(parents=True, exist_ok=True)
    # kept: the launcher's and hopnet join's output beside the run dir (PROTOCOL.launch.log, PROTOCOL.join.log)
    launch_out: Any = open(base / f"{protocol}.launch.log", "w") if keep else subprocess.DEVNULL
    join_out: Any = open(base / f"{protocol}.join.log", "w") if keep else subprocess.DEVNULL
    launcher = subprocess.Popen([sys.executable, "-m", "hopnet.cli.main", "launch", "--nproc", "4", "--max-nproc",
                                 "6", "--protocol", protocol, *FLAGS.get(protocol, []), "--run-dir", str(run_dir),
                                 DIGITS, "--iterations", str(iterations), "--eval-every", "100000",
                                 "--hidden", str(hidden)],
                                cwd=ROOT, stdout=launch_out, stderr=subprocess.STDOUT)
    _wait("training", lambda: len(_records(run_dir, 0, "iteration")) >= join_after, 600)
    joined_at = time.monotonic()
    joiner = subprocess.Popen([sys.executable, "-m", "hopnet.cli.main", "join", str(run_dir), "--nproc", "2"],
                              cwd=ROOT, stdout=join_out, stderr=subprocess.STDOUT)
    _wait("the joiners' first iterations", lambda: all(_records(run_dir, r, "iteration") for r in (4, 5)), 600)
    first_iteration_s = max(_records(run_dir, r, "iteration")[0]["mono"] for r in (4, 5)) - joined_at
    pid = json.loads((run_dir / "launch.json").read_text())["worker_pids"]["2"]
    os.kill(pid, signal.SIGTERM)
    launch_rc, join_rc = launcher.wait(timeout=1200), joiner.wait(timeout=300)
    record = json.loads((run_dir / "launch.json").read_text())
    sent = [r["bytes"] for rank in range(6) for r in _records(run_dir, rank, "state_sent")]
    stalls = [r["stall_s"] for rank in range(6) for r in _records(run_dir, rank, "view_entered")]
    waits = [r["wait_s"] for rank in (4, 5) for r in _records(run_dir, rank, "joined")]
    finals = [r["accuracy"] for rank in range(6) for r in _records(run_dir, rank, "eval") if r.get("final")]
    return {"protocol": protocol, "launch": launch_rc, "join": join_rc,
            "rank 2": record["result"]["worker_returncodes"].get("2"), "views": len(record["views"]),
            "state (MB)": round(max(sent) / 1e6, 3), "join to 1st iteration (s)": round(first_iteration_s, 2),
            "admission + state (s)": round(max(waits), 3),
            "max stall (s)": round(max(stalls), 3), "min accuracy": round(min(finals), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--protocols", nargs="+", default=["hop", "allreduce", "diloco", "eager-sgd", "pipe-sgd",
                                                              "partial-reduce", "prague"])
    parser.add_argument("--iterations", type=int, default=6000)
    parser.add_argument("--hidden", type=int, default=64, help="the MLP's width (340000: a model of about 100 MB)")
    parser.add_argument("--join-after", type=int, default=200, help="rank 0's iterations before the join")
    parser.add_argument("--keep", type=Path, help="keep the run dirs under this folder (DIR/PROTOCOL), and the "
                        "launcher's and hopnet join's output beside them (DIR/PROTOCOL.launch.log, .join.log)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for i, protocol in enumerate(args.protocols):
            row = run(protocol, args.iterations, args.keep or Path(tmp), args.hidden, args.join_after,
                      keep=args.keep is not None)
            if i == 0:
                print("| " + " | ".join(row) + " |")
                print("|" + " --- |" * len(row))
            print("| " + " | ".join(str(v) for v in row.values()) + " |", flush=True)


if __name__ == "__main__":
    main()

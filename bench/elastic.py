"""Elastic runs, measured: 4 workers on digits, 2 join with one `hopnet join` once training runs,
then rank 2 gets SIGTERM once they trained; per protocol, how the run ended and what the changes cost.

    python bench/elastic.py [--protocols hop allreduce diloco] [--iterations 6000] [--keep DIR]
    python bench/elastic.py --protocols diloco --hidden 340000 --iterations 400 --join-after 40   # ~100 MB
    python bench/elastic.py --replica-size 2 [--replica-mode fsdp]   # replicas of 2 processes
    python bench/elastic.py --replica-size 2 --step-cost [--runs 3]

With ``--replica-size R`` the run has 4 replicas of R processes, one replica joins (`hopnet join
--nproc R`), and member R-1 of replica 2 gets the SIGTERM (its whole replica leaves); the columns
name replicas. ``--step-cost`` measures what an elastic run of replica groups adds to each step
instead (the replica's per-step agreement): the same run of 2 replicas, 2000 iterations, with and
without ``--max-nproc``, alternated ``--runs`` times, each run's training time from its launcher.

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


def _records(run_dir: Path, rank: int, event: str, member: int = 0) -> list[dict[str, Any]]:
    path = run_dir / (f"rank{rank}.jsonl" if member == 0 else f"lane{member}/rank{rank}.jsonl")
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


def _wait(what: str, ready: Any, timeout_s: float = 120.0, launcher: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        if launcher is not None and launcher.poll() is not None:
            raise SystemExit(f"the launcher exited {launcher.returncode} before {what}")
        time.sleep(0.05)


def run(protocol: str, iterations: int, base: Path, hidden: int, join_after: int, keep: bool = False,
        size: int = 1, mode: str = "ddp") -> dict[str, Any]:
    run_dir = base / protocol
    base.mkdir(parents=True, exist_ok=True)
    # kept: the launcher's and hopnet join's output beside the run dir (PROTOCOL.launch.log, PROTOCOL.join.log)
    launch_out: Any = open(base / f"{protocol}.launch.log", "w") if keep else subprocess.DEVNULL
    join_out: Any = open(base / f"{protocol}.join.log", "w") if keep else subprocess.DEVNULL
    grouped = ["--replica-size", str(size), "--replica-mode", mode] if size > 1 else []
    launcher = subprocess.Popen([sys.executable, "-m", "hopnet.cli.main", "launch", "--nproc", str(4 * size),
                                 "--max-nproc", str(6 * size), *grouped, "--protocol", protocol,
                                 *FLAGS.get(protocol, []), "--run-dir", str(run_dir),
                                 DIGITS, "--iterations", str(iterations), "--eval-every", "100000",
                                 "--hidden", str(hidden)],
                                cwd=ROOT, stdout=launch_out, stderr=subprocess.STDOUT)
    _wait("training", lambda: len(_records(run_dir, 0, "iteration")) >= join_after, 600, launcher)
    joined_at = time.monotonic()
    joiner = subprocess.Popen([sys.executable, "-m", "hopnet.cli.main", "join", str(run_dir), "--nproc", str(2 * size)],
                              cwd=ROOT, stdout=join_out, stderr=subprocess.STDOUT)
    members = range(size)  # (the views name replicas; each process logs in its lane's file)
    _wait("the joiners' first iterations",
          lambda: all(_records(run_dir, r, "iteration", m) for r in (4, 5) for m in members), 600)
    first_iteration_s = max(_records(run_dir, r, "iteration", m)[0]["mono"] for r in (4, 5) for m in members) \
        - joined_at
    leaver = 2 * size + size - 1  # rank 2, or the last member of replica 2
    pid = json.loads((run_dir / "launch.json").read_text())["worker_pids"][str(leaver)]
    os.kill(pid, signal.SIGTERM)
    launch_rc, join_rc = launcher.wait(timeout=1200), joiner.wait(timeout=300)
    record = json.loads((run_dir / "launch.json").read_text())
    every = [(rank, m) for rank in range(6) for m in members]
    sent = [r["bytes"] for rank, m in every for r in _records(run_dir, rank, "state_sent", m)]
    stalls = [r["stall_s"] for rank, m in every for r in _records(run_dir, rank, "view_entered", m)]
    waits = [r["wait_s"] for rank in (4, 5) for m in members for r in _records(run_dir, rank, "joined", m)]
    finals = [r["accuracy"] for rank, m in every for r in _records(run_dir, rank, "eval", m) if r.get("final")]
    return {"protocol": protocol + (f" ({size} x {mode})" if size > 1 else ""), "launch": launch_rc,
            "join": join_rc, ("rank 2" if size == 1 else "replica 2"):
            record["result"]["worker_returncodes"].get(str(leaver)), "views": len(record["views"]),
            "state (MB)": round(max(sent) / 1e6, 3), "join to 1st iteration (s)": round(first_iteration_s, 2),
            "admission + state (s)": round(max(waits), 3),
            "max stall (s)": round(max(stalls), 3), "min accuracy": round(min(finals), 4)}


def step_cost(protocol: str, size: int, mode: str, runs: int, base: Path) -> None:
    """Training time of one run of 2 replicas, elastic or not, alternated; the ratio per pair."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(runs):
        for elastic in (False, True):
            run_dir = base / f"{protocol}-cost{i}{'e' if elastic else ''}"
            grouped = ["--replica-size", str(size), "--replica-mode", mode] if size > 1 else []
            done = subprocess.run([sys.executable, "-m", "hopnet.cli.main", "launch", "--nproc", str(2 * size),
                                   *grouped, "--protocol", protocol,
                                   *FLAGS.get(protocol, []), *(["--max-nproc", str(4 * size)] if elastic else []),
                                   "--run-dir", str(run_dir), DIGITS, "--iterations", "2000", "--eval-every",
                                   "100000"], cwd=ROOT, capture_output=True, text=True, timeout=600)
            if done.returncode:
                raise SystemExit(done.stderr[-2000:])
            times[elastic].append(json.loads((run_dir / "launch.json").read_text())["result"]["phases"]["training_s"])
    ratios = [e / f for f, e in zip(times[False], times[True])]
    what = f"2 replicas of {size} ({mode})" if size > 1 else "2 workers"
    print(f"{protocol}, {what}, 2000 iterations: training {times[False]} s fixed, "
          f"{times[True]} s elastic; elastic/fixed per pair {[round(r, 3) for r in ratios]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--protocols", nargs="+", default=["hop", "allreduce", "diloco", "eager-sgd", "pipe-sgd",
                                                              "partial-reduce", "prague"])
    parser.add_argument("--iterations", type=int, default=6000)
    parser.add_argument("--hidden", type=int, default=64, help="the MLP's width (340000: a model of about 100 MB)")
    parser.add_argument("--join-after", type=int, default=200, help="rank 0's iterations before the join")
    parser.add_argument("--keep", type=Path, help="keep the run dirs under this folder (DIR/PROTOCOL), and the "
                        "launcher's and hopnet join's output beside them (DIR/PROTOCOL.launch.log, .join.log)")
    parser.add_argument("--replica-size", type=int, default=1, help="processes per replica group")
    parser.add_argument("--replica-mode", default="ddp", choices=("ddp", "fsdp"))
    parser.add_argument("--step-cost", action="store_true", help="measure the per-step cost of an elastic run "
                        "instead (of 2 replicas of --replica-size, or of 2 workers)")
    parser.add_argument("--runs", type=int, default=3, help="--step-cost: pairs of runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.step_cost:
            for protocol in args.protocols:
                step_cost(protocol, args.replica_size, args.replica_mode, args.runs, args.keep or Path(tmp))
            return
        for i, protocol in enumerate(args.protocols):
            row = run(protocol, args.iterations, args.keep or Path(tmp), args.hidden, args.join_after,
                      keep=args.keep is not None, size=args.replica_size, mode=args.replica_mode)
            if i == 0:
                print("| " + " | ".join(row) + " |")
                print("|" + " --- |" * len(row))
            print("| " + " | ".join(str(v) for v in row.values()) + " |", flush=True)


if __name__ == "__main__":
    main()

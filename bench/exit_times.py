"""Where the time after the last iteration goes: workers' exit, the launcher's release, its own exit.

    python bench/exit_times.py --source OLD_CHECKOUT --source . --repeat 3

Runs ``hopnet launch --nproc 4 examples/train_digits.py`` with each ``--source`` first on
``PYTHONPATH`` (a checkout of hopnet: compare two in one invocation, alternating, on the same
load), with each start method, reading the launcher's merged output line by line as it comes.
One ``CLOCK_MONOTONIC`` serves every process of the machine, so this reader's clock and the
event logs' ``mono`` compare directly. Per launch:

* ``last it``: the last ``iteration`` record of any rank (the run dir's logs);
* ``to summary``: from there to the launcher's per-rank summary line (every worker exited
  and the launcher released the fork server, the rendezvous and the store);
* ``to exit``: from there to the launcher process's end (its stdout closes);
* ``workers``: each worker's exit after its own last iteration, where ``launch.json``
  records it (``result.phases.worker_exit_s``, this change on).

Prints one row per launch and the medians per (source, method).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def last_iteration(run_dir: Path) -> float:
    last = 0.0
    for log in run_dir.glob("rank*.jsonl"):
        for line in log.read_text().splitlines():
            if '"event":"iteration"' in line.replace(" ", ""):
                last = max(last, json.loads(line)["mono"])
    return last


def one_launch(source: Path, method: str, run_dir: Path) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOPNET_")}
    env["PYTHONPATH"] = str(source.resolve())
    cmd = [sys.executable, "-m", "hopnet.cli.main", "launch", "--nproc", "4", "--start-method", method,
           "--no-progress", "--run-dir", str(run_dir), "examples/train_digits.py"]
    proc = subprocess.Popen(cmd, cwd=source.resolve(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    summary_at = None
    for line in proc.stdout:
        if "per-rank summary" in line and summary_at is None:
            summary_at = time.monotonic()
    exit_at = time.monotonic()
    assert proc.wait() == 0 and summary_at is not None
    last = last_iteration(run_dir)
    phases = json.loads((run_dir / "launch.json").read_text())["result"].get("phases") or {}
    return {"to_summary": summary_at - last, "to_exit": exit_at - summary_at, "total": exit_at - last,
            "workers": phases.get("worker_exit_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", action="append", required=True, help="a hopnet checkout (repeatable)")
    parser.add_argument("--method", action="append", default=None, help="forkserver, exec (default: both)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    methods = args.method or ["forkserver", "exec"]
    results: dict[tuple[str, str], list[dict[str, object]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            for method in methods:
                for source in args.source:
                    run_dir = Path(tmp) / f"run{i}-{method}-{len(results)}-{abs(hash(source))}"
                    row = one_launch(Path(source), method, run_dir)
                    results.setdefault((source, method), []).append(row)
                    print(f"{source:>24} {method:>10}  last it -> summary {row['to_summary']:5.2f}s, "
                          f"summary -> exit {row['to_exit']:5.2f}s, total {row['total']:5.2f}s"
                          + (f", workers {row['workers']}" if row["workers"] else ""), flush=True)
    print("\nmedians (s): source, method, last it -> summary, summary -> exit, last it -> exit")
    for (source, method), rows in results.items():
        med = {k: statistics.median(float(r[k]) for r in rows) for k in ("to_summary", "to_exit", "total")}  # type: ignore[arg-type]
        print(f"{source:>24} {method:>10}  {med['to_summary']:5.2f}  {med['to_exit']:5.2f}  {med['total']:5.2f}")


if __name__ == "__main__":
    main()

"""How long workers outlive a launcher killed with SIGKILL.

Starts `hopnet launch --nproc N tests/workers/hop_worker.py` (training, or still
sleeping before hopnet.init), SIGKILLs the launcher, and measures the time until every
worker process is gone. Repeats and prints min / median / max per phase.

    python bench/launcher_death.py --nproc 4 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "workers" / "hop_worker.py")


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _entered(run_dir: Path, rank: int, iteration: int) -> bool:
    path = run_dir / f"rank{rank}.jsonl"
    if not path.exists():
        return False
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == "enter" and record.get("iter", -1) >= iteration:
            return True
    return False


def once(nproc: int, phase: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        extra = ["--sleep-before-init", "600"] if phase == "starting" else []
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.Popen([sys.executable, "-m", "hopnet.cli.main", "launch", "--nproc", str(nproc),
                                 "--run-dir", str(run_dir), WORKER, "--dim", "100", "--compute-ms", "1",
                                 "--iterations", "1000000", *extra],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        workers: list[int] = []
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                workers = _children(proc.pid)
                ready = len(workers) == nproc and (phase == "starting" or
                                                   all(_entered(run_dir, r, 3) for r in range(nproc)))
                if ready:
                    break
                time.sleep(0.05)
            if phase == "starting":
                time.sleep(1.0)
            proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            while any(_alive(p) for p in workers):
                time.sleep(0.01)
                if time.monotonic() - killed > 30:
                    break
            return time.monotonic() - killed
        finally:
            for pid in workers:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    for phase in ("training", "starting"):
        times = [once(args.nproc, phase) for _ in range(args.repeat)]
        print(f"{phase:9s} workers gone after launcher SIGKILL: min {min(times):.2f}s  "
              f"median {statistics.median(times):.2f}s  max {max(times):.2f}s  (n={len(times)})", flush=True)


if __name__ == "__main__":
    main()

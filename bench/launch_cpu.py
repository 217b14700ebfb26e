"""CPU seconds and wall time of whole `hopnet launch` runs (launcher, fork server, coordinator,
workers: every process the launch starts).

    python bench/launch_cpu.py [--runs 3] [-- LAUNCH ARGS...]

Each run is a fresh `python -m hopnet.cli.main launch ARGS` in the current environment,
started in a temporary directory so that ``PYTHONPATH`` picks the hopnet measured; its CPU
time is what ``getrusage(RUSAGE_CHILDREN)`` gains over it (user + system of every
descendant that was waited for). Without ARGS it runs a coordinated launch: 4 workers of
tests/workers/hop_worker.py, 30 iterations, ``--protocol partial-reduce``.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ["--nproc", "4", "--protocol", "partial-reduce", "--no-progress",
           str(ROOT / "tests" / "workers" / "hop_worker.py"), "--iterations", "30"]


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_run(args: list[str], tmp: Path) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one launch in ``tmp``; raises if it fails."""
    command = [sys.executable, "-m", "hopnet.cli.main", "launch", "--run-dir", str(tmp / "run"), "--overwrite", *args]
    cpu, wall = children_cpu_s(), time.monotonic()
    proc = subprocess.run(command, cwd=tmp, capture_output=True, text=True)
    wall, cpu = time.monotonic() - wall, children_cpu_s() - cpu
    if proc.returncode != 0:
        raise SystemExit(f"launch failed ({proc.returncode}):\n{proc.stderr}")
    return cpu, wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("launch_args", nargs=argparse.REMAINDER, help="after --: the launch's arguments")
    args = parser.parse_args()
    launch_args = [a for a in args.launch_args if a != "--"] or DEFAULT
    with tempfile.TemporaryDirectory(prefix="hopnet-launch-cpu-") as tmp:
        results = [one_run(launch_args, Path(tmp)) for _ in range(args.runs)]
    for i, (cpu, wall) in enumerate(results):
        print(f"run {i}: {cpu:.2f} CPU-s, {wall:.2f} s wall")
    cpus, walls = sorted(r[0] for r in results), sorted(r[1] for r in results)
    print(f"median: {cpus[len(cpus) // 2]:.2f} CPU-s, {walls[len(walls) // 2]:.2f} s wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())

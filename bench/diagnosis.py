"""The report's prediction against the real thing: does the option the diagnosis suggests speed a run up
as much as the simulator says?

    python bench/diagnosis.py [--iterations 200] [--compute-ms 5] [--factor 20]
    python bench/diagnosis.py --case quickstart [--iterations 3000]

``straggler`` (the default): ``tests/workers/hop_worker.py`` on ``ring:4`` with rank 1 ``--factor``
times slower (``--slowdown rank=1:F``). ``quickstart``: the README's quick start as a user runs it,
``hopnet launch --nproc 4 examples/train_digits.py``, on whatever machine this is. Each run is
diagnosed (:func:`hopnet.report.diagnosis.diagnose` with the simulator's predictor, as `hopnet
report` does), then every option the diagnosis simulated is launched, and the predicted speedup
is printed beside the measured one. Time is the run's span from the first worker's first
iteration to the last worker's last one (the launcher's start-up left out); ratios compare runs
of the same invocation only.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hopnet.report.diagnosis import diagnose
from hopnet.report.rundir import load_run_dir
from hopnet.report.stats import run_stats
from hopnet.sim.whatif import predict

REPO = Path(__file__).resolve().parent.parent
WORKER = str(REPO / "tests" / "workers" / "hop_worker.py")
DIGITS = str(REPO / "examples" / "train_digits.py")


def launch(run_dir: Path, flags: list[str], args: argparse.Namespace) -> float:
    """Launch one run; return its span (first iteration to last) in seconds."""
    launcher = [sys.executable, "-m", "hopnet.cli.main", "launch", "--run-dir", str(run_dir)]
    if args.case == "quickstart":
        cmd = [*launcher, "--nproc", "4", *flags, DIGITS, "--iterations", str(args.iterations)]
    else:
        cmd = [*launcher, "--graph", "ring:4", "--slowdown", f"rank=1:{args.factor}", *flags, WORKER,
               "--iterations", str(args.iterations), "--compute-ms", str(args.compute_ms), "--dim", "100"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)
    stats = run_stats(load_run_dir(run_dir))
    return max(s.last or 0.0 for s in stats.ranks.values()) - min(s.began or 0.0 for s in stats.ranks.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=("straggler", "quickstart"), default="straggler")
    parser.add_argument("--iterations", type=int, default=None, help="default: 200 (straggler), 3000 (quickstart)")
    parser.add_argument("--compute-ms", type=float, default=5.0)
    parser.add_argument("--factor", type=float, default=20.0)
    args = parser.parse_args()
    if args.iterations is None:
        args.iterations = 3000 if args.case == "quickstart" else 200
    with tempfile.TemporaryDirectory() as tmp:
        base_s = launch(Path(tmp) / "base", [], args)
        began = time.perf_counter()
        diagnosis = diagnose(load_run_dir(Path(tmp) / "base"), predictor=predict)
        diagnose_s = time.perf_counter() - began
        print("\n".join(f"diagnosis: {line}" for line in diagnosis.lines()))
        print(f"diagnosis with predictions took {diagnose_s:.2f} s")
        print(f"{'option':<66} {'predicted':>9} {'measured':>9} {'run (s)':>8}")
        print(f"{'(as run)':<66} {'1.0x':>9} {'1.0x':>9} {base_s:8.2f}")
        for n, prediction in enumerate(diagnosis.predictions):
            run_s = launch(Path(tmp) / f"option{n}", prediction.option.flags.split(), args)
            predicted = "-" if prediction.speedup is None else f"{prediction.speedup:.1f}x"
            print(f"{prediction.option.flags:<66} {predicted:>9} {base_s / run_s:8.1f}x {run_s:8.2f}")


if __name__ == "__main__":
    main()

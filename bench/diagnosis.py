"""The report's prediction against the real thing: does the option the diagnosis suggests speed a run up
as much as the simulator says?

    python bench/diagnosis.py [--iterations 200] [--compute-ms 5] [--factor 20]
    python bench/diagnosis.py --case quickstart [--iterations 3000]
    python bench/diagnosis.py --case lm [--iterations 150] [--factor 4]

``straggler`` (the default): ``tests/workers/hop_worker.py`` on ``ring:4`` with rank 1 ``--factor``
times slower (``--slowdown rank=1:F``). ``quickstart``: the README's quick start as a user runs it,
``hopnet launch --nproc 4 examples/train_digits.py``, on whatever machine this is. Each run is
diagnosed (:func:`hopnet.report.diagnosis.diagnose` with the simulator's predictor, as `hopnet
report` does), then every option the diagnosis simulated is launched, and the predicted speedup
is printed beside the measured one. Time is the run's span from the first worker's first
iteration to the last worker's last one (the launcher's start-up left out); ratios compare runs
of the same invocation only. ``lm``: the language model (``examples/train_lm.py --preset tiny``, 4 workers)
with rank 0 ``--factor`` times slower.
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
LM = str(REPO / "examples" / "train_lm.py")


DEFAULT_ITERATIONS = {"straggler": 200, "quickstart": 3000, "lm": 150}


def launch(run_dir: Path, flags: list[str], args: argparse.Namespace) -> float:
    """Launch one run; return its span (first iteration to last) in seconds."""
    launcher = [sys.executable, "-m", "hopnet.cli.main", "launch", "--run-dir", str(run_dir)]
    if args.case == "quickstart":
        cmd = [*launcher, "--nproc", "4", *flags, DIGITS, "--iterations", str(args.iterations)]
    elif args.case == "lm":
        cmd = [*launcher, "--nproc", "4", "--slowdown", f"rank=0:{args.factor}", *flags, LM, "--preset", "tiny",
               "--iterations", str(args.iterations), "--eval-every", str(args.iterations)]
    else:
        cmd = [*launcher, "--graph", "ring:4", "--slowdown", f"rank=1:{args.factor}", *flags, WORKER,
               "--iterations", str(args.iterations), "--compute-ms", str(args.compute_ms), "--dim", "100"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)
    stats = run_stats(load_run_dir(run_dir))
    return max(s.last or 0.0 for s in stats.ranks.values()) - min(s.began or 0.0 for s in stats.ranks.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=tuple(DEFAULT_ITERATIONS), default="straggler")
    parser.add_argument("--iterations", type=int, default=None,
                        help=", ".join(f"default {n} ({case})" for case, n in DEFAULT_ITERATIONS.items()))
    parser.add_argument("--compute-ms", type=float, default=5.0)
    parser.add_argument("--factor", type=float, default=None, help="default 20 (straggler), 4 (lm)")
    args = parser.parse_args()
    if args.iterations is None:
        args.iterations = DEFAULT_ITERATIONS[args.case]
    if args.factor is None:
        args.factor = 4.0 if args.case == "lm" else 20.0
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

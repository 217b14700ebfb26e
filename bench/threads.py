"""The README's embedding snippet against examples/train_digits.py: torch threads per worker.

torch gives every process a thread pool as large as the machine. Several workers on
one machine then oversubscribe the cores; the example avoids it with
``torch.set_num_threads(1)``, the README's snippet does not. The launcher now sets
``OMP_NUM_THREADS`` to cores / local workers (hopnet/launch/threads.py). This runs,
under `hopnet launch --nproc N`, each a few times, interleaved:

* ``snippet, before``: the README snippet with ``OMP_NUM_THREADS`` set to what torch
  picks on its own (``torch.get_num_threads()`` in a fresh process): the old behaviour;
* ``snippet, after``: the README snippet with the launcher's default;
* ``example``: examples/train_digits.py (``torch.set_num_threads(1)``).

The snippet is taken from README.md as printed, after a harness that defines its
placeholders the way the example does (the same MLP, loss and batch size on the
digits data). Reported: each run's time per iteration, from the workers' ``enter``
records (first to last iteration, averaged over ranks, so start-up is not counted),
the launch's wall time, and each setting's median relative to the example.

    python bench/threads.py [--nproc 4] [--iterations N] [--repeats 3]

``--iterations`` replaces the snippet's ``worker.iterations(1000)`` count (the time per
iteration is what is compared, so a loaded machine can use fewer).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from hopnet.analysis import load_run  # noqa: E402
from readme_blocks import DOCUMENTS, fenced_blocks, launch_script  # noqa: E402

DIGITS_PRELUDE = '''\
# --- bench harness: the README snippet's placeholders, as examples/train_digits.py has them
import os as _os

import torch as _torch
from sklearn.datasets import load_digits as _load_digits

_torch.manual_seed(0)
_digits = _load_digits()
_rank = int(_os.environ["HOPNET_RANK"])
_g = _torch.Generator().manual_seed(_rank)
_pick = _torch.randint(len(_digits.data), (32,), generator=_g)
x = _torch.tensor(_digits.data, dtype=_torch.float32)[_pick] / 16.0
y = _torch.tensor(_digits.target, dtype=_torch.long)[_pick]
loss_fn = _torch.nn.CrossEntropyLoss()


def build_model():
    return _torch.nn.Sequential(_torch.nn.Linear(64, 64), _torch.nn.ReLU(), _torch.nn.Linear(64, 10))


# --- the README's block ------------------------------------------------------------
'''


def readme_snippet() -> str:
    readme = DOCUMENTS[0]
    block = next(b for b in fenced_blocks(readme) if b.mode == "launch" and "hopnet.init(model)" in b.text)
    return launch_script(block, DIGITS_PRELUDE)


def snippet_iterations(text: str) -> int:
    match = re.search(r"worker\.iterations\((\d+)\)", text)
    if not match:
        raise SystemExit("README snippet: worker.iterations(N) not found")
    return int(match.group(1))


def torch_default_threads() -> int:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                         env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def run(script: list[str], nproc: int, run_dir: Path, omp: str | None) -> tuple[float, float]:
    """(seconds per iteration, launch wall seconds)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "hopnet.cli.main", "launch", "--nproc", str(nproc),
                           "--run-dir", str(run_dir), *script], env=env, cwd=ROOT,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"launch failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    per_rank = []
    for records in load_run(run_dir).values():
        enters = sorted((r["mono"], r["iter"]) for r in records if r.get("event") == "enter")
        (m0, k0), (m1, k1) = enters[0], enters[-1]
        per_rank.append((m1 - m0) / (k1 - k0))
    return statistics.mean(per_rank), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=None, help="default: the snippet's own count")
    args = parser.parse_args()

    snippet = readme_snippet()
    iterations = snippet_iterations(snippet)
    if args.iterations is not None:
        snippet = snippet.replace(f"worker.iterations({iterations})", f"worker.iterations({args.iterations})")
        iterations = args.iterations
    default = torch_default_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{cores} usable cores, torch's default {default} threads per process, {args.nproc} workers, "
          f"{iterations} iterations")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        script = work / "readme_snippet.py"
        script.write_text(snippet)
        settings = {
            "snippet, before (OMP_NUM_THREADS=%d)" % default: ([str(script)], str(default)),
            "snippet, after (launcher default)": ([str(script)], None),
            "example (set_num_threads(1))": ([str(ROOT / "examples" / "train_digits.py"), "--iterations",
                                              str(iterations)], None),
        }
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in settings}
        for repeat in range(args.repeats):
            for name, (argv, omp) in settings.items():
                results[name].append(run(argv, args.nproc, work / f"run-{len(results[name])}-{hash(name)}", omp))
                print(f"  repeat {repeat + 1}: {name}: {results[name][-1][0] * 1000:.2f} ms/iteration, "
                      f"{results[name][-1][1]:.1f} s wall", flush=True)
    example = statistics.median(t for t, _ in results["example (set_num_threads(1))"])
    print(f"\n| setting | ms / iteration (median of {args.repeats}) | wall s (median) | vs example |")
    print("| --- | --- | --- | --- |")
    for name, runs in results.items():
        per_iter = statistics.median(t for t, _ in runs)
        wall = statistics.median(w for _, w in runs)
        print(f"| {name} | {per_iter * 1000:.2f} | {wall:.1f} | {per_iter / example:.2f}x |")


if __name__ == "__main__":
    main()

"""Start-up cost of the `hopnet` commands that train nothing (issue 19: a fast command line).

    python bench/cli_startup.py [--runs 7] [--top 8] [--compare-with /path/to/other/checkout]

Runs each command ``--runs`` times as a new interpreter (``python -m hopnet.cli.main ...``,
this checkout first on ``PYTHONPATH``), round-robin so that a change of the machine's load
falls on every command alike, and prints the median wall time, its ratio to ``python -c pass``
and to ``python -c "import torch"`` measured in the same invocation, the median CPU time
(user + system: what the wall time would be on an idle machine, near enough, for these
single-threaded start-ups), and whether the command imported torch. ``--compare-with`` runs the same commands against another checkout (the code
before a change, say) in the same rounds. Then the ``--top`` largest cumulative entries of
``python -X importtime`` for `hopnet --help` and `hopnet launch nosuch.py`.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

COMMANDS: list[tuple[str, list[str]]] = [
    ("hopnet --help", ["--help"]),
    ("hopnet launch --help", ["launch", "--help"]),
    ("hopnet graph show ring:8", ["graph", "show", "ring:8"]),
    ("hopnet keygen KEY", ["keygen", "{key}"]),
    ("hopnet launch nosuch.py", ["launch", "nosuch.py"]),
]
BASELINES: list[tuple[str, list[str]]] = [
    ("python -c pass", ["-c", "pass"]),
    ('python -c "import torch"', ["-c", "import torch"]),
]


def _env(checkout: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOPNET_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(checkout), env.get("PYTHONPATH", "")) if p)
    return env


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _time(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of one run."""
    started, cpu = time.perf_counter(), _cpu_s()
    subprocess.run([sys.executable, *argv], env=env, cwd=cwd, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - started, _cpu_s() - cpu


def _imports_torch(argv: list[str], env: dict[str, str], cwd: Path) -> bool:
    proc = subprocess.run([sys.executable, "-X", "importtime", *argv], env=env, cwd=cwd, capture_output=True,
                          text=True, check=False)
    return any(line.rsplit("|", 1)[-1].strip() == "torch" for line in proc.stderr.splitlines())


def _importtime_top(argv: list[str], env: dict[str, str], cwd: Path, top: int) -> list[str]:
    proc = subprocess.run([sys.executable, "-X", "importtime", *argv], env=env, cwd=cwd, capture_output=True,
                          text=True, check=False)
    rows = []
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, self_us, cumulative_us, name = (part.strip() for part in line.replace("import time:", "|").split("|"))
        rows.append((int(cumulative_us), int(self_us), name))
    rows.sort(reverse=True)
    return [f"    {cum / 1000:8.1f} ms cumulative {own / 1000:7.1f} ms self  {name}" for cum, own, name in rows[:top]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--compare-with", type=Path, default=None, metavar="CHECKOUT")
    args = parser.parse_args()
    checkouts = {"this": ROOT} | ({"other": args.compare_with.resolve()} if args.compare_with else {})
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        key = cwd / "run.key"
        jobs: list[tuple[str, str, list[str], dict[str, str]]] = [
            (name, "", argv, _env(ROOT)) for name, argv in BASELINES]
        for label, checkout in checkouts.items():
            for name, argv in COMMANDS:
                cli = ["-m", "hopnet.cli.main", *(a.replace("{key}", str(key)) for a in argv)]
                jobs.append((name, label, cli, _env(checkout)))
        times: dict[tuple[str, str], list[float]] = {(name, label): [] for name, label, _, _ in jobs}
        cpus: dict[tuple[str, str], list[float]] = {(name, label): [] for name, label, _, _ in jobs}
        load_before = os.getloadavg()
        for _ in range(args.runs):
            for name, label, argv, env in jobs:
                key.unlink(missing_ok=True)
                wall, cpu = _time(argv, env, cwd)
                times[name, label].append(wall)
                cpus[name, label].append(cpu)
        load_after = os.getloadavg()
        medians = {k: statistics.median(v) for k, v in times.items()}
        bare, torch_s = medians["python -c pass", ""], medians['python -c "import torch"', ""]
        print(f"{args.runs} runs each, round-robin; load average {load_before[0]:.2f} before, "
              f"{load_after[0]:.2f} after; {sys.executable}")
        print()
        print("| command | checkout | median wall s | x `python -c pass` | x `import torch` | median CPU s "
              "| imports torch |")
        print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
        for name, label, argv, env in jobs:
            key.unlink(missing_ok=True)
            median = medians[name, label]
            torch_flag = "yes" if _imports_torch(argv, env, cwd) else "no"
            print(f"| {name} | {label or '-'} | {median:.3f} | {median / bare:.2f} | {median / torch_s:.2f} "
                  f"| {statistics.median(cpus[name, label]):.3f} | {torch_flag} |")
        for label, checkout in checkouts.items():
            for name, argv in (COMMANDS[0], COMMANDS[4]):
                print()
                print(f"`python -X importtime -m hopnet.cli.main {' '.join(argv)}` ({label}), top {args.top}:")
                print("\n".join(_importtime_top(["-m", "hopnet.cli.main", *argv], _env(checkout), cwd, args.top)))


if __name__ == "__main__":
    main()

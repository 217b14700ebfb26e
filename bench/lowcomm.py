"""Low-communication training side by side: time to a target accuracy and bytes across a slow link.

    sudo python bench/lowcomm.py [--iterations 120] [--hidden 512] [--cap 10mbit] [--target 0.93]
                                 [--only capped|stragglers] [--rows NAME,NAME]

The same workload for every protocol configuration in :data:`CONFIGS` (one list: a row is a
name and the `hopnet launch` flags; a row whose protocol this tree does not have, such as
``diloco`` before it merges, is listed as skipped):

1. ``capped``: two emulated hosts (bench/netns_hosts.py, as bench/multihost.py), 2 workers each,
   with host 1's link capped at ``--cap`` both ways (tc tbf). Bytes across the link are host 1's
   veth counters (both ways, the whole launch: start-up included).
2. ``stragglers``: one machine, 4 workers, with rank 3 always 4x slower (``--slowdown rank=3:4``),
   then with random 6x slowdowns (``--slowdown random:6:0.1``).

Workload: examples/train_digits.py (``--hidden`` units, cosine learning rate over
``--iterations``, an ``eval`` record every 10 iterations). Time to target: from the first
rank's ``plan`` record (its training loop starts; torch imports and start-up are left out) to the
moment the last rank first evaluates at ``--target`` or better; ``-`` when some rank never does.
Ratios compare rows of one invocation only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netns_hosts import NamespacedHosts, unavailable_reason  # noqa: E402

from hopnet.registry import specs  # noqa: E402
from hopnet.runtime.events import read_events  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DIGITS = str(REPO / "examples" / "train_digits.py")
RING = ["--graph", "ring:4"]
EVAL_EVERY = 10

CONFIGS: list[tuple[str, list[str]]] = [
    ("diloco H=10", ["--protocol", "diloco", "--local-steps", "10", "--nproc", "4"]),
    ("diloco H=50", ["--protocol", "diloco", "--local-steps", "50", "--nproc", "4"]),
    ("diloco H=10 int8", ["--protocol", "diloco", "--local-steps", "10", "--compress", "int8", "--nproc", "4"]),
    ("diloco H=50 int8", ["--protocol", "diloco", "--local-steps", "50", "--compress", "int8", "--nproc", "4"]),
    ("hop staleness", [*RING, "--backup-workers", "1", "--staleness", "8", "--max-ig", "16"]),
    ("hop", RING),
    ("hop H=10", [*RING, "--local-steps", "10"]),
    ("partial-reduce", ["--protocol", "partial-reduce", "--group-size", "2", "--nproc", "4"]),
    ("partial-reduce H=10", ["--protocol", "partial-reduce", "--group-size", "2", "--local-steps", "10",
                             "--nproc", "4"]),
    ("allreduce", ["--protocol", "allreduce", "--nproc", "4"]),
]
"""Every row of both settings: its name and its `hopnet launch` flags (``--nproc 4`` or a graph of 4)."""

STRAGGLERS = [("rank 3 4x slower", ["--slowdown", "rank=3:4"]),
              ("random 6x slowdowns", ["--slowdown", "random:6:0.1"])]


@dataclass
class Result:
    codes: list[int]
    time_to_target_s: float | None
    train_s: float | None
    link_bytes: int | None
    accuracy: float | None


def protocol_of(flags: list[str]) -> str:
    return flags[flags.index("--protocol") + 1] if "--protocol" in flags else "hop"


def _launch_argv(flags: list[str], run_dir: Path, script: list[str], multi: list[str]) -> list[str]:
    return [sys.executable, "-m", "hopnet.cli.main", "launch", *multi, "--no-progress", "--run-dir", str(run_dir),
            *flags, *script]


def _run(argvs: list[list[str]], run_dirs: list[Path], target: float, counters: list[Path]) -> Result:
    before = sum(int(c.read_text()) for c in counters)
    procs = [subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin:/usr/sbin:/sbin"})
             for argv in argvs]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    link = sum(int(c.read_text()) for c in counters) - before if counters else None
    codes = [p.returncode for p in procs]
    if any(codes):
        print("\n".join(o[-1500:] for o in outs), file=sys.stderr)
    logs = [read_events(path) for run_dir in run_dirs for path in sorted(run_dir.glob("rank*.jsonl"))]
    return Result(codes, *_timings(logs, target), link, _final_accuracy(logs))


def _timings(logs: list[list[dict]], target: float) -> tuple[float | None, float | None]:
    """Time to ``target`` and to the end of training, from the first rank's plan record."""
    plans = [r["mono"] for log in logs for r in log if r.get("event") == "plan"]
    if not plans or not logs:
        return None, None
    start = min(plans)
    reached, ended = [], []
    for log in logs:
        hits = [r["mono"] for r in log if r.get("event") == "eval" and r.get("accuracy", 0) >= target]
        reached.append(hits[0] if hits else None)
        ended.extend(r["mono"] for r in log if r.get("event") in ("iteration", "eval"))
    to_target = None if any(t is None for t in reached) else max(t for t in reached if t is not None) - start
    return to_target, (max(ended) - start) if ended else None


def _final_accuracy(logs: list[list[dict]]) -> float | None:
    finals = []
    for log in logs:
        evals = [r["accuracy"] for r in log if r.get("event") == "eval"]
        if evals:
            finals.append(evals[-1])
    return min(finals) if len(finals) == len(logs) and finals else None


def capped(hosts: NamespacedHosts, port: int, base: Path, name: str, flags: list[str], script: list[str],
           target: float) -> Result:
    """The row on the two hosts: one launcher per host, 2 of the 4 workers each."""
    argvs, dirs = [], []
    for node in range(2):
        run_dir = base / f"{name.replace(' ', '_')}-node{node}"
        multi = ["--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", f"{hosts.addresses[0]}:{port}",
                 "--bind", hosts.addresses[node], "--insecure"]
        argvs.append(hosts.command(node, _launch_argv(flags, run_dir, script, multi)))
        dirs.append(run_dir)
    stats = Path("/sys/class/net") / hosts.outer[1] / "statistics"
    return _run(argvs, dirs, target, [stats / "rx_bytes", stats / "tx_bytes"])


def one_machine(base: Path, name: str, flags: list[str], script: list[str], target: float) -> Result:
    run_dir = base / name.replace(" ", "_").replace("=", "")
    return _run([_launch_argv(flags, run_dir, script, [])], [run_dir], target, [])


def show(setting: str, name: str, result: Result | None, why: str = "") -> None:
    if result is None:
        print(f"{setting:<22} {name:<22} skipped: {why}", flush=True)
        return

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    link = "" if result.link_bytes is None else f"  link {result.link_bytes / 1e6:7.2f} MB"
    print(f"{setting:<22} {name:<22} exit {result.codes}  to target {num(result.time_to_target_s, '6.2f')}s  "
          f"training {num(result.train_s, '6.2f')}s{link}  final min accuracy {num(result.accuracy, '.3f')}",
          flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=120)
    parser.add_argument("--hidden", type=int, default=512, help="hidden units (model size: ~74 x hidden floats)")
    parser.add_argument("--cap", default="10mbit", help="tbf rate of host 1's link")
    parser.add_argument("--target", type=float, default=0.93, help="held-out accuracy to reach")
    parser.add_argument("--only", choices=("capped", "stragglers"), help="one setting only")
    parser.add_argument("--rows", help="comma-separated row names of CONFIGS to run (default: all)")
    args = parser.parse_args()
    rows = CONFIGS
    if args.rows:
        wanted = [r.strip() for r in args.rows.split(",")]
        unknown = sorted(set(wanted) - {name for name, _ in CONFIGS})
        if unknown:
            parser.error(f"--rows: no row named {', '.join(unknown)} (rows: {', '.join(n for n, _ in CONFIGS)})")
        rows = [row for row in CONFIGS if row[0] in wanted]
    known = {spec.name for spec in specs()}
    script = [DIGITS, "--iterations", str(args.iterations), "--hidden", str(args.hidden),
              "--eval-every", str(EVAL_EVERY)]
    print(json.dumps({"iterations": args.iterations, "hidden": args.hidden, "cap": args.cap,
                      "target": args.target}), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        if args.only != "stragglers":
            why = unavailable_reason()
            if why is not None:
                print(f"bench/lowcomm.py: cannot emulate hosts: {why}", file=sys.stderr)
                return 2
            with NamespacedHosts(2) as hosts:
                hosts.cap(1, args.cap)
                for i, (name, flags) in enumerate(rows):
                    if protocol_of(flags) not in known:
                        show(f"capped {args.cap}", name, None, f"no --protocol {protocol_of(flags)} in this tree")
                        continue
                    show(f"capped {args.cap}", name,
                         capped(hosts, 29950 + i, base / "capped", name, flags, script, args.target))
        if args.only != "capped":
            for setting, slow in STRAGGLERS:
                for name, flags in rows:
                    if protocol_of(flags) not in known:
                        show(setting, name, None, f"no --protocol {protocol_of(flags)} in this tree")
                        continue
                    show(setting, name, one_machine(base / setting.replace(" ", "_"), name, [*flags, *slow],
                                                    script, args.target))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Two emulated hosts against one: the digits example on network namespaces (needs root).

    python bench/multihost.py [--iterations 60] [--hidden 512] [--cap 10mbit]

Runs, each a fresh launch of ``examples/train_digits.py`` with 4 workers:

1. ``1 host``: one `hopnet launch --nproc 4` inside one namespace (loopback only);
2. ``2 hosts``: two launchers, 2 workers each, on two namespaces joined by a bridge;
3. the same two hosts with host 1's link capped both ways with ``tc ... tbf`` (``--cap``),
   for Hop, Hop with backup workers (complete graph, each worker needs one update of
   three, its own host's neighbour can give it; ring with one backup worker, with and
   without bounded staleness, which lets a newer update replace one still waiting for
   the link) and the all-reduce baseline.

Reports, per run: the launch wall time (both launchers started to both finished), the
iterations per second of each rank (the launcher's per-rank table, from the event logs),
and the final held-out accuracy. Ratios compare runs of the same invocation only.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netns_hosts import NamespacedHosts, unavailable_reason  # noqa: E402

from hopnet.runtime.events import read_events  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DIGITS = str(REPO / "examples" / "train_digits.py")
ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s+([0-9.]+)\s", re.M)
ACCURACY = re.compile(r"^\[rank (\d+)\] final held-out accuracy ([0-9.]+)", re.M)


def _launcher(hosts: NamespacedHosts, node: int, nnodes: int, port: int, run_dir: Path, flags: list[str],
              script: list[str]) -> list[str]:
    multi = ["--nnodes", str(nnodes), "--node-rank", str(node), "--rdzv-endpoint", f"{hosts.addresses[0]}:{port}",
             "--bind", hosts.addresses[node], "--insecure"] if nnodes > 1 else []
    return hosts.command(node, [sys.executable, "-m", "hopnet.cli.main", "launch", *multi, "--no-progress",
                                "--run-dir", str(run_dir), *flags, *script])


def run(hosts: NamespacedHosts, nnodes: int, port: int, base: Path, name: str, flags: list[str],
        script: list[str]) -> dict[str, object]:
    started = time.monotonic()
    procs = [subprocess.Popen(_launcher(hosts, n, nnodes, port, base / f"{name}-node{n}", flags, script),
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin:/usr/sbin:/sbin"})
             for n in range(nnodes)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    wall = time.monotonic() - started
    codes = [p.returncode for p in procs]
    rates = {int(r): float(s) for out in outs for r, _, s in ROW.findall(out)}
    accuracy = {int(r): float(a) for out in outs for r, a in ACCURACY.findall(out)}
    if any(codes):
        print("\n".join(o[-1500:] for o in outs), file=sys.stderr)
    stops = [_stop_record(log) for n in range(nnodes) for log in (base / f"{name}-node{n}").glob("rank*.jsonl")]
    return {"name": name, "codes": codes, "wall_s": wall, "rates": dict(sorted(rates.items())),
            "accuracy": min(accuracy.values()) if accuracy else None,
            "superseded": sum(s.get("dropped", {}).get("superseded", 0) for s in stops),
            "late": sum(s.get("late_updates_dropped", 0) or 0 for s in stops)}


def _stop_record(log: Path) -> dict[str, object]:
    return next((r for r in reversed(read_events(log)) if r.get("event") == "stop"), {})


def show(result: dict[str, object]) -> None:
    rates = result["rates"]
    assert isinstance(rates, dict)
    per_rank = " ".join(f"{r}:{v:.1f}" for r, v in rates.items())
    mean = statistics.fmean(rates.values()) if rates else float("nan")
    held = f"  superseded {result['superseded']} late {result['late']}" if result["superseded"] else ""
    print(f"{result['name']:<40} exit {result['codes']}  wall {result['wall_s']:6.1f}s  "
          f"mean it/s {mean:6.1f}  per rank {per_rank}  min accuracy {result['accuracy']}{held}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--hidden", type=int, default=512, help="hidden units (model size: ~74 x hidden floats)")
    parser.add_argument("--cap", default="10mbit", help="tbf rate of host 1's link in the capped runs")
    parser.add_argument("--capped-only", action="store_true", help="only the runs with the capped link")
    parser.add_argument("--staleness", type=int, default=8, help="--staleness of the superseding Hop run")
    args = parser.parse_args()
    why = unavailable_reason()
    if why is not None:
        print(f"bench/multihost.py: cannot emulate hosts: {why}", file=sys.stderr)
        return 2
    script = [DIGITS, "--iterations", str(args.iterations), "--hidden", str(args.hidden), "--eval-every", "100000"]
    ring, complete = ["--graph", "ring:4"], ["--graph", "complete:4"]
    with tempfile.TemporaryDirectory() as tmp, NamespacedHosts(2) as hosts:
        base = Path(tmp)
        if not args.capped_only:
            show(run(hosts, 1, 0, base, "1 host x 4, hop ring", ["--nproc", "4"], script))
            show(run(hosts, 2, 29901, base, "2 hosts x 2, hop ring", ring, script))
            show(run(hosts, 2, 29902, base, "2 hosts x 2, allreduce", ["--protocol", "allreduce", "--nproc", "4"],
                     script))
            show(run(hosts, 2, 29908, base, f"2 hosts x 2, hop ring bw=1 s={args.staleness} ig=16",
                     [*ring, "--backup-workers", "1", "--staleness", str(args.staleness), "--max-ig", "16"], script))
        hosts.cap(1, args.cap)
        show(run(hosts, 2, 29907, base, f"capped {args.cap}: hop ring bw=1 s={args.staleness} ig=16",
                 [*ring, "--backup-workers", "1", "--staleness", str(args.staleness), "--max-ig", "16"], script))
        show(run(hosts, 2, 29906, base, f"capped {args.cap}: hop ring bw=1 ig=16",
                 [*ring, "--backup-workers", "1", "--max-ig", "16"], script))
        show(run(hosts, 2, 29903, base, f"capped {args.cap}: hop ring", ring, script))
        show(run(hosts, 2, 29904, base, f"capped {args.cap}: hop complete bw=2",
                 [*complete, "--backup-workers", "2"], script))
        show(run(hosts, 2, 29905, base, f"capped {args.cap}: allreduce", ["--protocol", "allreduce", "--nproc", "4"],
                 script))
    return 0


if __name__ == "__main__":
    sys.exit(main())

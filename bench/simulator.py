"""Simulator scale: wall-clock time of `hopnet simulate`'s engine for growing worker counts.

    python bench/simulator.py [--sizes 16,256,1024] [--iterations 100] [--repeat 3]

Each size N runs Hop with default options on ``ring_based:N`` (every worker has 3
in-neighbours) with a constant 10 ms compute per iteration, ``--repeat`` times in this
process; the table shows the median (and min) wall-clock seconds of
:func:`hopnet.sim.engine.simulate` and, separately, of building the graph. Every repeat
must give the same virtual time (the simulator is deterministic); the script checks it.
Target (bench/README.md, "Simulator scale"): 1024 workers x 100 iterations in <= 10 s.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hopnet.config import ProtocolConfig  # noqa: E402
from hopnet.graph import Graph  # noqa: E402
from hopnet.sim.engine import ComputeModel, SimSpec, simulate  # noqa: E402

TARGET_S = 10.0
TARGET_N = 1024


def run_once(n: int, iterations: int, compute_ms: float) -> tuple[float, float, float, int]:
    """(graph build seconds, simulate seconds, virtual time, iterations completed by rank 0)."""
    gc.collect()
    t0 = time.perf_counter()
    graph = Graph.by_name(f"ring_based:{n}")
    t1 = time.perf_counter()
    spec = SimSpec(graph=graph, config=ProtocolConfig(), iterations=iterations,
                   compute=ComputeModel.parse(str(compute_ms)))
    result = simulate(spec)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, result.virtual_time, result.iterations[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="16,256,1024", help="worker counts (default 16,256,1024)")
    p.add_argument("--iterations", type=int, default=100, help="iterations per run (default 100)")
    p.add_argument("--repeat", type=int, default=3, help="runs per size; the median is shown (default 3)")
    p.add_argument("--compute-ms", type=float, default=10.0, help="constant compute per iteration (default 10)")
    p.add_argument("--out", default=None, metavar="FILE", help="write the numbers as JSON to FILE")
    args = p.parse_args()
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]

    print(f"hopnet simulator scale: Hop defaults on ring_based:N, {args.iterations} iterations, "
          f"const {args.compute_ms:g} ms compute, median of {args.repeat}; {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}", flush=True)
    header = ["workers", "simulate s (median)", "min", "graph s", "worker-iters/s", "us/worker-iter",
              "virtual s"]
    rows, results = [], []
    for n in sizes:
        runs = [run_once(n, args.iterations, args.compute_ms) for _ in range(args.repeat)]
        graph_s = statistics.median(r[0] for r in runs)
        sim_s = [r[1] for r in runs]
        vts = {r[2] for r in runs}
        if len(vts) != 1:
            print(f"warning: N={n}: virtual time differs between repeats: {sorted(vts)}", file=sys.stderr)
        med = statistics.median(sim_s)
        work = n * args.iterations
        results.append({"workers": n, "simulate_s": [round(s, 3) for s in sim_s], "median_s": round(med, 3),
                        "graph_s": round(graph_s, 4), "virtual_s": runs[0][2],
                        "worker_iterations_per_s": round(work / med), "completed": runs[0][3]})
        rows.append([str(n), f"{med:.2f}", f"{min(sim_s):.2f}", f"{graph_s:.3f}", f"{work / med:,.0f}",
                     f"{1e6 * med / work:.1f}", f"{runs[0][2]:.3f}"])
        print("  " + " ".join(rows[-1]), flush=True)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print()
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    verdict = None
    for res in results:
        if res["workers"] == TARGET_N and args.iterations == 100:
            verdict = res["median_s"] <= TARGET_S
            print(f"\ntarget: {TARGET_N} workers x 100 iterations <= {TARGET_S:g} s: "
                  f"{'MET' if verdict else 'MISSED'} ({res['median_s']:.2f} s)")
    if args.out:
        doc = {"inputs": vars(args), "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                  "python": platform.python_version()},
               "results": results, "target_met": verdict}
        Path(args.out).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

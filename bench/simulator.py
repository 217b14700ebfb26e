"""Simulator scale: wall-clock time, CPU time and peak memory of `hopnet simulate` for growing worker counts.

    python bench/simulator.py [--sizes 16,256,1024] [--protocol hop] [--iterations 100] [--repeat 3]
    python bench/simulator.py --scale        # hop at 1024, 4096, 10000; prague, partial-reduce at 4096

Each case runs ``--protocol`` with default options on ``ring_based:N`` (every worker has 3
in-neighbours) with a constant 10 ms compute per iteration, ``--repeat`` times, each in a fresh
child process (so that its peak RSS is its own). A child times building the graph, the
simulation (:func:`hopnet.sim.engine.simulate`) and writing the ``--json`` document
(:func:`hopnet.cli.simulate_cmd.result_json`), and reports the CPU time of all three and its
peak RSS. Every repeat must give the same JSON bytes (the simulator is deterministic); the
script checks it. Targets (docs/performance/index.md, "Simulator: accuracy and scale"): 1024 workers x 100 iterations
in <= 10 s; 10,000 workers x 100 iterations of Hop in <= 60 s and 4 GB.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TARGETS = {1024: (10.0, None), 10_000: (60.0, 4096.0)}
"""workers -> (seconds, MB) that Hop's 100 iterations must stay within."""
SCALE_CASES = [("hop", 1024), ("hop", 4096), ("hop", 10_000), ("prague", 4096), ("partial-reduce", 4096)]
OPTIONS: dict[str, dict[str, object]] = {}
"""Options other than the defaults, per protocol (none: every case runs its protocol's defaults)."""


def child(protocol: str, n: int, iterations: int, compute_ms: float) -> dict[str, object]:
    """One run in this process: the numbers, and a digest of the JSON it would write."""
    from hopnet.cli.simulate_cmd import result_json
    from hopnet.config import ProtocolConfig
    from hopnet.graph import Graph
    from hopnet.sim.engine import ComputeModel, SimSpec, simulate

    cpu0, t0 = time.process_time(), time.perf_counter()
    graph = Graph.by_name(f"ring_based:{n}")
    t1 = time.perf_counter()
    spec = SimSpec(graph=graph, config=ProtocolConfig(protocol, **OPTIONS.get(protocol, {})),
                   iterations=iterations,
                   compute=ComputeModel.parse(str(compute_ms)))
    result = simulate(spec)
    t2 = time.perf_counter()
    text = result_json(result, {"graph": graph.name})
    t3 = time.perf_counter()
    return {"graph_s": t1 - t0, "simulate_s": t2 - t1, "json_s": t3 - t2, "total_s": t3 - t0,
            "cpu_s": time.process_time() - cpu0,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "virtual_s": result.virtual_time, "completed": min(result.iterations),
            "json_sha256": hashlib.sha256(text.encode()).hexdigest()[:16], "json_mb": len(text) / 1e6}


def run_case(protocol: str, n: int, args: argparse.Namespace) -> dict[str, object]:
    runs = []
    for _ in range(args.repeat):
        cmd = [sys.executable, __file__, "--child", f"{protocol}:{n}", "--iterations", str(args.iterations),
               "--compute-ms", str(args.compute_ms)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    digests = {r["json_sha256"] for r in runs}
    if len(digests) != 1:
        print(f"warning: {protocol} N={n}: the JSON differs between repeats: {sorted(digests)}", file=sys.stderr)
    med = lambda key: statistics.median(float(r[key]) for r in runs)  # noqa: E731
    return {"protocol": protocol, "workers": n, "runs": runs, "total_s": med("total_s"),
            "simulate_s": med("simulate_s"), "cpu_s": med("cpu_s"),
            "peak_rss_mb": max(float(r["peak_rss_mb"]) for r in runs),
            "graph_s": med("graph_s"), "json_s": med("json_s"), "virtual_s": runs[0]["virtual_s"],
            "identical_json": len(digests) == 1, "load_before": os.getloadavg()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="16,256,1024", help="worker counts (default 16,256,1024)")
    p.add_argument("--protocol", default="hop", help="protocol for --sizes (default hop)")
    p.add_argument("--scale", action="store_true", help="the cluster-scale cases instead: " +
                   ", ".join(f"{proto} at {n}" for proto, n in SCALE_CASES))
    p.add_argument("--iterations", type=int, default=100, help="iterations per run (default 100)")
    p.add_argument("--repeat", type=int, default=None, help="runs per case; the median is shown "
                   "(default 3, 1 with --scale)")
    p.add_argument("--compute-ms", type=float, default=10.0, help="constant compute per iteration (default 10)")
    p.add_argument("--out", default=None, metavar="FILE", help="write the numbers as JSON to FILE")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        protocol, _, n = args.child.rpartition(":")
        print(json.dumps(child(protocol, int(n), args.iterations, args.compute_ms)))
        return 0
    args.repeat = args.repeat or (1 if args.scale else 3)
    cases = SCALE_CASES if args.scale else [(args.protocol, int(x)) for x in args.sizes.split(",") if x.strip()]

    print(f"hopnet simulator scale: default options on ring_based:N, {args.iterations} iterations, "
          f"const {args.compute_ms:g} ms compute, median of {args.repeat}, one child process per run; "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, load {os.getloadavg()[0]:.1f}", flush=True)
    header = ["protocol", "workers", "total s", "simulate s", "CPU s", "peak RSS MB", "graph s", "json s",
              "us/worker-iter (CPU)", "virtual s", "same JSON"]
    rows, results = [], []
    for protocol, n in cases:
        res = run_case(protocol, n, args)
        results.append(res)
        work = n * args.iterations
        rows.append([protocol, str(n), f"{res['total_s']:.2f}", f"{res['simulate_s']:.2f}", f"{res['cpu_s']:.2f}",
                     f"{res['peak_rss_mb']:.0f}", f"{res['graph_s']:.2f}", f"{res['json_s']:.2f}",
                     f"{1e6 * float(res['cpu_s']) / work:.1f}", f"{res['virtual_s']:.3f}",
                     "yes" if res["identical_json"] else "NO"])
        print("  " + " ".join(rows[-1]) + f"   (load {os.getloadavg()[0]:.1f})", flush=True)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print()
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    verdicts = {}
    for res in results:
        target = TARGETS.get(int(res["workers"]))  # type: ignore[call-overload]
        if res["protocol"] != "hop" or target is None or args.iterations != 100:
            continue
        seconds, mb = target
        ok_time = float(res["total_s"]) <= seconds
        ok_cpu = float(res["cpu_s"]) <= seconds
        ok_mem = mb is None or float(res["peak_rss_mb"]) <= mb
        verdicts[str(res["workers"])] = ok_time and ok_mem
        print(f"\ntarget: hop, {res['workers']} workers x 100 iterations <= {seconds:g} s"
              + (f" and {mb:g} MB" if mb else "") + f": {'MET' if ok_time and ok_mem else 'MISSED'} "
              f"({float(res['total_s']):.2f} s wall, {float(res['cpu_s']):.2f} s CPU"
              + ("" if ok_time or not ok_cpu else ", within it in CPU time: the machine was loaded")
              + f", {float(res['peak_rss_mb']):.0f} MB)")
    if args.out:
        doc = {"inputs": {k: v for k, v in vars(args).items() if k != "child"},
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                           "python": platform.python_version()},
               "results": results, "targets_met": verdicts}
        Path(args.out).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

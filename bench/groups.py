"""Issue 9's group protocols side by side: allreduce, AD-PSGD, Prague (random, smart, static),
Partial Reduce (const, dynamic; P = 3) and Hop with backup workers, in one run.

    python bench/groups.py --sim-only                        # simulator, 16 workers on 4 machines
    python bench/groups.py --real-only --config straggler    # 8 real processes on 2 machines' labels

Configurations (``--config``, repeatable; default all three):

* ``homogeneous``: no slowdown;
* ``straggler``: one worker 5x slower (``--slowdown rank=5:5``, 5x the total time of each of
  its iterations, the digest's reading of "k x slowdown");
* ``random``: random 6x slowdowns with probability 1/N per worker and iteration
  (``random:6:0.0625`` at 16 workers as in bench/heterogeneity.py, ``random:6:0.125`` at 8
  as in bench/ddp.py: on average one slowed worker per iteration).

Graphs: nodes carry ``machine`` labels, 4 consecutive ranks per machine (``m0`` .. ``m3`` in
the simulator, ``m0``, ``m1`` for real). Hop, allreduce, Prague and Partial Reduce run on
``ring_based:N`` (Hop's usual graph; allreduce, Prague and Partial Reduce use only its
machine labels); AD-PSGD needs a bipartite graph and runs on ``ring:N`` (even ranks active).

Simulator: 20 ms compute per iteration, a 1 MB model over 1 Gbit/s links with 0.1 ms latency
(8 ms per model transfer), --sim-iterations iterations. Throughput = mean over workers of the
worker's iterations per second of virtual time over iterations [warmup, iterations - tail).

Real processes: bench/ddp.py's digits worker (``--role hopnet``: the digits MLP, 40 ms of
emulated compute per iteration, held-out accuracy every 10 iterations) under ``hopnet launch``.
Throughput as in the simulator but on the workers' clocks; time to target = seconds from a
worker's first iteration until its own model first scores >= --target on the held-out split,
for the median worker and for the slowest. Protocols are interleaved across --repeat rounds
and ``/proc/loadavg`` is recorded with every run; ratios are to allreduce of the same round.
Results: docs/performance/index.md ("Each protocol's own numbers"); discussion:
docs/performance/archive.md ("Group protocols").
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from hopnet.config import ProtocolConfig  # noqa: E402
from hopnet.graph import Graph  # noqa: E402

# name -> (ProtocolConfig fields, launch flags)
PROTOCOLS: dict[str, tuple[dict[str, Any], list[str]]] = {
    "allreduce": ({"protocol": "allreduce"}, ["--protocol", "allreduce"]),
    "ad-psgd": ({"protocol": "ad-psgd"}, ["--protocol", "ad-psgd"]),
    "prague-random": ({"protocol": "prague", "group_generator": "random", "group_size": 3},
                      ["--protocol", "prague", "--group-generator", "random", "--group-size", "3"]),
    "prague-smart": ({"protocol": "prague", "group_generator": "smart", "group_size": 3},
                     ["--protocol", "prague", "--group-generator", "smart", "--group-size", "3"]),
    "prague-static": ({"protocol": "prague", "group_generator": "static", "group_size": 3},
                      ["--protocol", "prague", "--group-generator", "static", "--group-size", "3"]),
    "preduce-const": ({"protocol": "partial-reduce", "weights": "const", "group_size": 3},
                      ["--protocol", "partial-reduce", "--weights", "const", "--group-size", "3"]),
    "preduce-dynamic": ({"protocol": "partial-reduce", "weights": "dynamic", "group_size": 3},
                        ["--protocol", "partial-reduce", "--weights", "dynamic", "--group-size", "3"]),
    "hop-backup": ({"backup_workers": 1}, ["--backup-workers", "1"]),
}
STRAGGLER_RANK = 5


def slowdowns(config: str, n: int) -> list[str]:
    if config == "homogeneous":
        return []
    if config == "straggler":
        return [f"rank={STRAGGLER_RANK}:5"]
    return [f"random:6:{1 / n:g}"]


def labelled(graph: Graph, per_machine: int = 4) -> Graph:
    """``graph`` with machine labels m0, m1, ...: ``per_machine`` consecutive ranks each."""
    data = graph.to_dict()
    data["nodes"] = [{"id": v, "machine": f"m{v // per_machine}"} for v in range(graph.n)]
    return Graph.from_dict(data)


def graph_for(protocol: str, n: int) -> Graph:
    return labelled(Graph.ring(n) if protocol == "ad-psgd" else Graph.ring_based(n))


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def window_rate(times: list[tuple[int, float]], warmup: int, tail: int, iterations: int) -> float:
    """Iterations advanced per second between the first iteration >= warmup and the last
    <= iterations - 1 - tail (an AD-PSGD passive's last step waits for its actives)."""
    start = next(((k, t) for k, t in times if k >= warmup), None)
    stop = next(((k, t) for k, t in reversed(times) if k <= iterations - 1 - tail), None)
    if start is None or stop is None or stop[1] <= start[1]:
        return math.nan
    return (stop[0] - start[0]) / (stop[1] - start[1])


# ---------------------------------------------------------------------------- simulator
def run_sim(protocol: str, config: str, args: argparse.Namespace) -> dict[str, Any]:
    from hopnet.sim.engine import ComputeModel, SimSpec, simulate
    from hopnet.transports.inproc import LinkModel

    import torch

    # The simulator is one thread; torch's intra-op threads only wait for each other on a
    # loaded machine (a 65,536-element mul_ took 0.27 s at load 25 with 2 threads).
    torch.set_num_threads(1)
    n = args.sim_workers
    fields, _ = PROTOCOLS[protocol]
    spec = SimSpec(graph=graph_for(protocol, n),
                   config=ProtocolConfig(slowdown=slowdowns(config, n), seed=args.seed, **fields),
                   iterations=args.sim_iterations, compute=ComputeModel.parse(str(args.sim_compute_ms)),
                   link=LinkModel(latency_s=0.0001, bytes_per_s=args.sim_gbps * 1e9 / 8),
                   model_bytes=int(args.sim_model_mb * 1e6))
    started = time.monotonic()
    result = simulate(spec)
    rates = [window_rate(list(enumerate(times)), args.warmup, args.tail, args.sim_iterations)
             for times in result.finish_times]
    return {"protocol": protocol, "config": config, "rate": statistics.mean(rates), "min_rate": min(rates),
            "max_rate": max(rates), "virtual_s": result.virtual_time, "wall_s": time.monotonic() - started,
            "coordinator": result.coordinator}


def sim_table(rows: list[dict[str, Any]], configs: list[str]) -> str:
    lines = ["| protocol | " + " | ".join(f"{c}: it/s | x allreduce" for c in configs) + " |",
             "| --- | " + " | ".join("---: | ---:" for _ in configs) + " |"]
    by = {(r["protocol"], r["config"]): r for r in rows}
    for protocol in [p for p in PROTOCOLS if any(r["protocol"] == p for r in rows)]:
        cells = []
        for c in configs:
            r, base = by.get((protocol, c)), by.get(("allreduce", c))
            cells.append(f"{r['rate']:.2f} | {r['rate'] / base['rate']:.2f}x" if r and base else " | ")
        lines.append(f"| {protocol} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- real processes
def run_real(protocol: str, config: str, rnd: int, args: argparse.Namespace) -> dict[str, Any]:
    import ddp

    n = args.nproc
    out = Path(args.out).resolve() / config / f"{protocol}-r{rnd}"
    out.mkdir(parents=True, exist_ok=True)
    graph_file = out.parent / f"graph-{protocol}.json"
    graph_for(protocol, n).to_json(graph_file)
    load_before = loadavg()
    flags = ["--graph", str(graph_file), *PROTOCOLS[protocol][1]]
    try:
        wall = ddp.run_hopnet(protocol, flags, slowdowns(config, n), out, args)
    except SystemExit as exc:  # a failed run is a result too; the others go on
        return {"protocol": protocol, "config": config, "round": rnd, "error": str(exc)[-2000:],
                "load": load_before}
    ranks = [json.loads((out / f"bench_rank{r}.json").read_text()) for r in range(n)]
    rates = [window_rate([(k, t) for k, t in d["ends"]], args.warmup, args.tail, args.iterations) for d in ranks]
    evals = [[(t, acc) for _, t, acc in d["evals"]] for d in ranks]
    return {"protocol": protocol, "config": config, "round": rnd, "rate": statistics.mean(rates),
            "min_rate": min(rates), **to_target(evals, args.target), "evals": evals,
            "final_acc_min": min(d["evals"][-1][2] for d in ranks),
            "final_acc_median": statistics.median(d["evals"][-1][2] for d in ranks),
            "process_wall_s": wall, "load": load_before, "load_after": loadavg()}


def to_target(evals: list[list[tuple[float, float]]], target: float) -> dict[str, float]:
    """Seconds until each worker's model first scores >= target: the median worker's and the last one's."""
    reach = [next((t for t, acc in worker if acc >= target), math.inf) for worker in evals]
    return {"to_target_median": statistics.median(reach), "to_target_max": max(reach)}


def real_table(rows: list[dict[str, Any]], target: float | None = None) -> str:
    """The real runs' table; with ``target``, time to target recomputed from the rows' evals."""
    if target is not None:
        rows = [dict(r, **to_target(r["evals"], target)) if "evals" in r else r for r in rows]
    lines = ["| config | round | protocol | load (1/5/15 min) | it/s (mean worker) | x allreduce | "
             "s to target, median worker | x allreduce | s to target, all workers | x allreduce | "
             "final acc (min) |",
             "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    base = {(r["config"], r["round"]): r for r in rows if r["protocol"] == "allreduce" and "rate" in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['round']} | {r['protocol']} | {r['load']} | failed: "
                         f"{r['error'].splitlines()[0]} | | | | | | |")
            continue
        b = base.get((r["config"], r["round"]))

        def ratio(key: str, faster_is_smaller: bool) -> str:
            if not b or not math.isfinite(r[key]) or not math.isfinite(b[key]):
                return "-"
            return f"{(b[key] / r[key]) if faster_is_smaller else (r[key] / b[key]):.2f}x"

        lines.append(f"| {r['config']} | {r['round']} | {r['protocol']} | {r['load']} | {r['rate']:.2f} | "
                     f"{ratio('rate', False)} | {r['to_target_median']:.2f} | {ratio('to_target_median', True)} | "
                     f"{r['to_target_max']:.2f} | {ratio('to_target_max', True)} | {r['final_acc_min']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", choices=["homogeneous", "straggler", "random"])
    parser.add_argument("--protocols", default=",".join(PROTOCOLS),
                        help="comma-separated, from: " + ",".join(PROTOCOLS))
    parser.add_argument("--sim-only", action="store_true")
    parser.add_argument("--real-only", action="store_true")
    parser.add_argument("--sim-workers", type=int, default=16)
    parser.add_argument("--sim-iterations", type=int, default=100)
    parser.add_argument("--sim-compute-ms", type=float, default=20.0)
    parser.add_argument("--sim-model-mb", type=float, default=1.0)
    parser.add_argument("--sim-gbps", type=float, default=1.0)
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=60,
                        help="real runs' iterations (the cosine schedule's length)")
    parser.add_argument("--compute-ms", type=float, default=40.0, help="real runs' emulated compute")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.85,
                        help="held-out accuracy to reach (why 0.85: docs/performance/archive.md, \"Group protocols\")")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--repeat", type=int, default=1, help="real-run rounds, protocols interleaved")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--tail", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/bench-groups")
    parser.add_argument("--json", default=None, help="write all rows to this file")
    parser.add_argument("--table-from", nargs="+", metavar="JSON",
                        help="print the real runs' table from --json files of earlier runs (with --target) and exit")
    args = parser.parse_args()
    if args.table_from:
        rows_from = [r for f in args.table_from for r in json.loads(Path(f).read_text())["real"]]
        print(real_table(rows_from, args.target))
        return
    configs = args.config or ["homogeneous", "straggler", "random"]
    protocols = args.protocols.split(",")
    unknown = [p for p in protocols if p not in PROTOCOLS]
    if unknown:
        parser.error(f"unknown protocol {unknown[0]!r}")
    rows: dict[str, list[dict[str, Any]]] = {"sim": [], "real": []}

    if not args.real_only:
        for config in configs:
            for protocol in protocols:
                r = run_sim(protocol, config, args)
                rows["sim"].append(r)
                print(f"sim {config} {protocol}: {r['rate']:.2f} it/s (min {r['min_rate']:.2f}, "
                      f"max {r['max_rate']:.2f}), {r['wall_s']:.1f} s wall", flush=True)
        print(f"\nsimulator, {args.sim_workers} workers, {args.sim_iterations} iterations "
              "(mean worker it/s of virtual time)\n" + sim_table(rows["sim"], configs), flush=True)

    if not args.sim_only:
        args.batch_size = 32
        for config in configs:
            for rnd in range(args.repeat):
                order = protocols if rnd % 2 == 0 else protocols[::-1]
                for protocol in order:
                    r = run_real(protocol, config, rnd, args)
                    rows["real"].append(r)
                    if "error" in r:
                        print(f"real {config} r{rnd} {protocol}: FAILED (load {r['load']})\n{r['error']}", flush=True)
                    else:
                        print(f"real {config} r{rnd} {protocol}: {r['rate']:.2f} it/s, to {args.target}: "
                              f"median {r['to_target_median']:.2f} s, all {r['to_target_max']:.2f} s, "
                              f"acc min {r['final_acc_min']:.3f}, wall {r['process_wall_s']:.1f} s, "
                              f"load {r['load']}", flush=True)
        print(f"\nreal processes, {args.nproc} workers, {args.iterations} iterations, target {args.target}\n"
              + real_table(rows["real"]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()

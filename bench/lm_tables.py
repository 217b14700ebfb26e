"""bench/lm.py's other two tables: DiLoCo's loss against inner steps and bytes, and memory and waits.

    python bench/lm.py --table diloco   # allreduce, DiLoCo H=1, 10, 50, 200 and H=50 int8; 600 iterations
    python bench/lm.py --table memory   # allreduce, hop, ad-psgd, partial-reduce, diloco; 100 iterations

``--table diloco`` (the shape of DiLoCo's main figure): each run's held-out loss at every
``--eval-every`` inner steps (the mean of the workers' own models; under DiLoCo they differ between
outer steps), the final one (after the last outer step: every worker holds the outer model), that
one against allreduce's at the same number of inner steps, and the bytes each worker sent: the
kernel's counters of its connections (the ``links`` record, taken as training ends, before the
consensus; :mod:`hopnet.report.links` reads the same). DiLoCo's runs use its defaults (outer
Nesterov, ``--outer-lr 0.7``, momentum 0.9), as the paper; ``--runs`` can add ``diloco H=50 int8 avg``,
a plain average for the outer step (``--outer-lr 1 --outer-momentum 0``).

``--table memory``: each worker runs the example through bench/memory_worker.py, which writes its
RSS before the example built anything (torch and hopnet imported) and its peak RSS (VmHWM). The
share of time spent waiting is ``hopnet report``'s (:mod:`hopnet.report.stats`: the protocol's wait
fields of the ``iteration`` records over the step's time); beside it the compute per iteration and
the seconds per second each worker waited runnable for a core (:func:`hopnet.report.contention.core_waits`).
No evaluation runs before the last iteration, so that compute is the trainer's own.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from lm import EXAMPLE, ROOT, RUNS, run_hopnet

from hopnet.report.contention import core_waits
from hopnet.report.rundir import load_run_dir
from hopnet.report.stats import run_stats

MEMORY_WORKER = ROOT / "bench" / "memory_worker.py"
MB = 1e6

DILOCO = ["--protocol", "diloco"]
DILOCO_RUNS = {
    "allreduce": RUNS["allreduce"],
    "diloco H=1": [*DILOCO, "--local-steps", "1"],
    "diloco H=10": [*DILOCO, "--local-steps", "10"],
    "diloco H=50": [*DILOCO, "--local-steps", "50"],
    "diloco H=200": [*DILOCO, "--local-steps", "200"],
    "diloco H=50 int8": [*DILOCO, "--local-steps", "50", "--compress", "int8"],
    "diloco H=50 int8 avg": [*DILOCO, "--local-steps", "50", "--compress", "int8", "--outer-lr", "1",
                             "--outer-momentum", "0"],  # a plain average for the outer step; only by --runs
}
MEMORY_RUNS = {name: RUNS[name] for name in ("allreduce", "hop", "ad-psgd", "partial-reduce", "diloco")}
TABLES = {"diloco": DILOCO_RUNS, "memory": MEMORY_RUNS}
DEFAULT_RUNS = {"diloco": [name for name in DILOCO_RUNS if not name.endswith("avg")], "memory": list(MEMORY_RUNS)}


def bytes_sent(run_dir: Path) -> list[int]:
    """Per rank, the bytes the kernel counted on its connections to every peer (``links`` record)."""
    sent = []
    for records in load_run_dir(run_dir).events.values():
        links: dict[str, Any] = next((r for r in records if r.get("event") == "links"), {"peers": {}})
        sent.append(sum(int(peer.get("bytes_sent", 0)) for peer in links["peers"].values()))
    return sent


def loss_curve(evals: list[list[tuple[int, float, float]]]) -> dict[int, float]:
    """Inner steps -> the workers' mean held-out loss, at the steps every worker evaluated."""
    by_step: dict[int, list[float]] = {}
    for rank in evals:
        for iteration, _, loss in rank:
            by_step.setdefault(iteration + 1, []).append(loss)
    return {step: statistics.mean(losses) for step, losses in sorted(by_step.items()) if len(losses) == len(evals)}


def diloco_row(name: str, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    evals, consensus = run_hopnet(name, out / name.replace(" ", "-"), [], args, flags=DILOCO_RUNS[name])
    sent = bytes_sent(out / name.replace(" ", "-"))
    return {"name": name, "curve": loss_curve(evals), "consensus": consensus,
            "mb_sent": statistics.mean(sent) / MB, "mb_sent_max": max(sent) / MB}


def print_diloco(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    steps = [s for s in rows[0]["curve"] if s % (2 * args.eval_every) == 0 or s == args.iterations]
    allreduce = rows[0] if rows[0]["name"] == "allreduce" else None
    print(f"\n| run | {' | '.join(f'loss at {s}' for s in steps)} | final vs allreduce | "
          "MB sent per worker | MB per inner step | allreduce's bytes / this |")
    print("| --- |" + " ---: |" * (len(steps) + 4))
    for row in rows:
        curve = row["curve"]
        final = curve.get(args.iterations, float("nan"))
        versus = fewer = "-"
        if allreduce is not None:
            versus = f"{100 * (final / allreduce['curve'][args.iterations] - 1):+.1f}%"
            fewer = f"{allreduce['mb_sent'] / row['mb_sent']:.1f}x"
        losses = " | ".join(f"{curve[s]:.4f}" if s in curve else "-" for s in steps)
        print(f"| {row['name']} | {losses} | {versus} | {row['mb_sent']:.2f} | "
              f"{row['mb_sent'] / args.iterations:.3f} | {fewer} |")


def memory_row(name: str, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    run_dir, memory = out / name, out / f"{name}-memory"
    memory.mkdir(parents=True, exist_ok=True)
    run_hopnet(name, run_dir, [], args, flags=MEMORY_RUNS[name], script=MEMORY_WORKER,
               extra_env={"HOPNET_MEMORY_OUT": str(memory), "HOPNET_MEMORY_EXAMPLE": str(EXAMPLE)})
    rss = [json.loads((memory / f"rank{r}.json").read_text()) for r in range(args.nproc)]
    data = load_run_dir(run_dir)
    stats = run_stats(data)
    ranks = list(stats.ranks.values())
    waits = [sum(s.share(w.part) for w in stats.shown_waits()) for s in ranks]
    cores = list(core_waits(data).values())
    return {"name": name, "peak_mb": [r["peak_kb"] * 1024 / MB for r in rss],
            "beyond_mb": [(r["peak_kb"] - r["baseline_kb"]) * 1024 / MB for r in rss],
            "wait_share": waits, "waits": [w.label for w in stats.shown_waits()],
            "compute_ms": [1000 * s.time_s["compute_s"] / max(1, s.steps) for s in ranks],
            "s_per_iteration": statistics.mean(1 / s.rate for s in ranks if s.rate > 0),
            "core_wait": cores}


def span(values: list[float], fmt: str) -> str:
    low, high = format(min(values), fmt), format(max(values), fmt)
    return low if low == high else f"{low}-{high}"


def print_memory(rows: list[dict[str, Any]]) -> None:
    print("\n| protocol | peak RSS per worker, MB | beyond the process before the example, MB | "
          "share of time waiting (its waits) | compute per iteration, ms | s / iteration | "
          "waited for a core, s per s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        waits = f"{span([100 * w for w in r['wait_share']], '.1f')}% ({', '.join(r['waits']) or 'none'})"
        cores = span(r["core_wait"], ".2f") if r["core_wait"] else "-"
        print(f"| {r['name']} | {span(r['peak_mb'], '.0f')} | {span(r['beyond_mb'], '.0f')} | {waits} | "
              f"{span(r['compute_ms'], '.0f')} | {r['s_per_iteration']:.3f} | {cores} |")


def main(table: str, names: list[str], out: Path, args: argparse.Namespace) -> None:
    run_row = diloco_row if table == "diloco" else memory_row
    rows = []
    for name in names:
        rows.append(run_row(name, out, args))
        print(json.dumps(rows[-1]), flush=True)
    if table == "diloco":
        print_diloco(rows, args)
    else:
        print_memory(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")

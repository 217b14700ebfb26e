"""Heterogeneity benchmark: Hop's Sec. 7.3 experiments, in the simulator and with real processes.

    python bench/heterogeneity.py [--quick] [--sim-only] [--out results.json]

Three experiments, 16 workers on ``ring_based:16`` (every worker has 3 in- and 3
out-neighbours), fixed compute per iteration (``--compute-ms``, default 50 ms):

1. Random slowdown ``random:6:0.0625`` (Hop Sec. 7.3.1/7.3.3/7.3.4): iterations per
   second of standard Hop (defaults) vs one backup worker vs staleness 5, with larger
   ``--max-ig`` too, and no slowdown as the reference. The *ceiling* line is what no
   protocol can beat without skipping: a worker computes every iteration itself, and
   its mean compute per iteration is ``c * (1 + (6 - 1) / 16)``, so its rate is at most
   ``1 / that`` = 0.762x the no-slowdown rate.
2. Worker 0 always 4x slower, ``rank=0:4`` (Hop Sec. 7.3.5): standard vs backup worker
   vs iteration skipping (``--backup-workers 1 --skip-threshold T --max-jump J``).
   Reported: the straggler's effect on iteration time = mean iteration time of the 15
   other workers / mean iteration time without slowdown (Hop: 3.9x -> ~1.1x).
3. Simulator vs real processes: the settings run for real (``hopnet launch`` of
   ``examples/synthetic.py``, 16 processes) are simulated with the same iterations,
   warm-up and seed - the random slowdown draws are a pure function of (seed, rank,
   iteration), so both slow down exactly the same iterations - and the rates compared.

How rates are measured (the same function for both): from each worker's event log
(``iteration`` records; virtual time in the simulator), over the iterations in
``[warmup, iterations - tail)``, rate = iterations advanced / seconds (a skip counts
as the iterations it jumps). A setting's rate is the mean over workers. Real-process
startup (16 torch imports on a small machine) is thus left out.

Numbers: docs/performance/index.md, "Stragglers and heterogeneity"; their discussion:
docs/performance/archive.md, "Heterogeneity".
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hopnet.analysis import load_run  # noqa: E402
from hopnet.config import ProtocolConfig  # noqa: E402
from hopnet.graph import Graph  # noqa: E402
from hopnet.sim.engine import ComputeModel, SimSpec, simulate  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SYNTHETIC = ROOT / "examples" / "synthetic.py"
GRAPH = "ring_based:16"
N = 16
RANDOM = "random:6:0.0625"
STRAGGLER = "rank=0:4"
STRAGGLER_RANK = 0
RANDOM_FACTOR, RANDOM_PROB = 6.0, 0.0625


@dataclass(frozen=True)
class Setting:
    key: str           # unique id in the JSON
    label: str         # row label
    experiment: int    # 1 (random slowdown) or 2 (straggler); 0 = the no-slowdown reference
    slowdown: tuple[str, ...] = ()
    options: tuple[tuple[str, Any], ...] = ()
    real: bool = False        # run with real processes by default
    quick: bool = False       # part of --quick (sim and real)

    def config(self, seed: int) -> ProtocolConfig:
        return ProtocolConfig(slowdown=list(self.slowdown), seed=seed, **dict(self.options))

    def flags(self) -> str:
        """The protocol flags, besides ``--slowdown`` (which the experiment fixes)."""
        names = {"max_ig": "--max-ig", "backup_workers": "--backup-workers", "staleness": "--staleness",
                 "skip_threshold": "--skip-threshold", "max_jump": "--max-jump"}
        parts = [f"{names[k]} {v}" for k, v in self.options]
        return " ".join(parts) or "(defaults)"


def _o(**kw: Any) -> tuple[tuple[str, Any], ...]:
    order = ("backup_workers", "staleness", "skip_threshold", "max_jump", "max_ig")
    return tuple((k, kw[k]) for k in order if k in kw)


R, S = (RANDOM,), (STRAGGLER,)
SETTINGS: list[Setting] = [
    Setting("none", "no slowdown", 0, (), (), real=True, quick=True),
    # ---- experiment 1: random slowdown
    Setting("rand_standard", "standard", 1, R, (), real=True, quick=True),
    Setting("rand_backup", "backup 1", 1, R, _o(backup_workers=1), real=True, quick=True),
    Setting("rand_stale", "staleness 5", 1, R, _o(staleness=5), real=True, quick=True),
    Setting("rand_backup_ig4", "backup 1, max-ig 4", 1, R, _o(backup_workers=1, max_ig=4)),
    Setting("rand_backup_ig8", "backup 1, max-ig 8", 1, R, _o(backup_workers=1, max_ig=8), real=True, quick=True),
    Setting("rand_stale_ig4", "staleness 5, max-ig 4", 1, R, _o(staleness=5, max_ig=4)),
    Setting("rand_stale_ig8", "staleness 5, max-ig 8", 1, R, _o(staleness=5, max_ig=8), real=True),
    Setting("rand_backup_ig32", "backup 1, max-ig 32", 1, R, _o(backup_workers=1, max_ig=32)),
    Setting("rand_stale_ig32", "staleness 5, max-ig 32", 1, R, _o(staleness=5, max_ig=32)),
    Setting("rand_hybrid_ig32", "backup 1 + staleness 5, max-ig 32", 1, R,
            _o(backup_workers=1, staleness=5, max_ig=32)),
    Setting("rand_nowait", "backup 3 (waits for nobody), max-ig 64", 1, R, _o(backup_workers=3, max_ig=64)),
    # ---- experiment 2: worker 0 always 4x slower
    Setting("str_standard", "standard", 2, S, (), real=True, quick=True),
    Setting("str_backup", "backup 1", 2, S, _o(backup_workers=1), real=True),
    Setting("str_backup_ig8", "backup 1, max-ig 8", 2, S, _o(backup_workers=1, max_ig=8)),
    Setting("str_skip2_t1_ig2", "skip max 2 (T 1, max-ig 2)", 2, S,
            _o(backup_workers=1, skip_threshold=1, max_jump=2, max_ig=2)),
    Setting("str_skip2_t1_ig3", "skip max 2 (T 1, max-ig 3)", 2, S,
            _o(backup_workers=1, skip_threshold=1, max_jump=2, max_ig=3)),
    Setting("str_skip2", "skip max 2 (T 2, max-ig 4)", 2, S,
            _o(backup_workers=1, skip_threshold=2, max_jump=2, max_ig=4), real=True),
    Setting("str_skip10_t1_ig2", "skip max 10 (T 1, max-ig 2)", 2, S,
            _o(backup_workers=1, skip_threshold=1, max_jump=10, max_ig=2)),
    Setting("str_skip10_t1_ig3", "skip max 10 (T 1, max-ig 3)", 2, S,
            _o(backup_workers=1, skip_threshold=1, max_jump=10, max_ig=3)),
    Setting("str_skip10", "skip max 10 (T 2, max-ig 4)", 2, S,
            _o(backup_workers=1, skip_threshold=2, max_jump=10, max_ig=4), real=True, quick=True),
    Setting("str_skip10_t4_ig8", "skip max 10 (T 4, max-ig 8)", 2, S,
            _o(backup_workers=1, skip_threshold=4, max_jump=10, max_ig=8)),
    Setting("str_skip10_t8_ig11", "skip max 10 (T 8, max-ig 11)", 2, S,
            _o(backup_workers=1, skip_threshold=8, max_jump=10, max_ig=11)),
]


# --------------------------------------------------------------------------- measuring
def window_rates(events: dict[int, list[dict[str, Any]]], iterations: int, warmup: int,
                 tail: int) -> dict[int, float]:
    """Per-rank iterations advanced per second over iterations ``[warmup, iterations - tail)``."""
    end_iter = iterations - 1 - tail
    rates: dict[int, float] = {}
    for rank, recs in events.items():
        points = [(r["iter"], r["t"]) for r in recs if r.get("event") == "iteration"]
        start = next(((k, t) for k, t in points if k >= warmup), None)
        stop = next(((k, t) for k, t in reversed(points) if k <= end_iter), None)
        if start is None or stop is None or stop[0] <= start[0] or stop[1] <= start[1]:
            rates[rank] = float("nan")
            continue
        rates[rank] = (stop[0] - start[0]) / (stop[1] - start[1])
    return rates


def _mean(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return sum(values) / len(values) if values else float("nan")


@dataclass
class Measured:
    rates: dict[int, float]
    skips: int = 0
    wall_s: float = 0.0
    self_reported: dict[int, float] = field(default_factory=dict)
    param_mean_drift: float | None = None
    error: str | None = None

    @property
    def mean_rate(self) -> float:
        return _mean(list(self.rates.values()))

    @property
    def others_rate(self) -> float:
        """Mean rate of every worker but the straggler (rank 0)."""
        return _mean([r for k, r in self.rates.items() if k != STRAGGLER_RANK])

    @property
    def others_iter_ms(self) -> float:
        """Mean iteration time of the non-straggler workers, in ms."""
        return 1000.0 * _mean([1.0 / r for k, r in self.rates.items() if k != STRAGGLER_RANK and r > 0])

    @property
    def iter_ms(self) -> float:
        return 1000.0 * _mean([1.0 / r for r in self.rates.values() if r > 0])

    @property
    def straggler_rate(self) -> float:
        return self.rates.get(STRAGGLER_RANK, float("nan"))

    def to_dict(self) -> dict[str, Any]:
        return {"mean_rate": _r(self.mean_rate), "others_rate": _r(self.others_rate),
                "iter_ms": _r(self.iter_ms), "others_iter_ms": _r(self.others_iter_ms),
                "straggler_rate": _r(self.straggler_rate), "skips": self.skips,
                "wall_s": round(self.wall_s, 2),
                "rates": {str(k): _r(v) for k, v in sorted(self.rates.items())},
                "self_reported_mean_rate": _r(_mean(list(self.self_reported.values())))
                if self.self_reported else None,
                "param_mean_drift": self.param_mean_drift, "error": self.error}


def _r(x: float) -> float | None:
    return None if x != x else round(x, 4)


def run_sim(setting: Setting, *, iterations: int, warmup: int, tail: int, compute_ms: float,
            seed: int) -> Measured:
    spec = SimSpec(graph=Graph.by_name(GRAPH), config=setting.config(seed), iterations=iterations,
                   compute=ComputeModel.parse(str(compute_ms)), keep_events=True)
    started = time.perf_counter()
    result = simulate(spec)
    wall = time.perf_counter() - started
    assert result.events is not None
    events = dict(enumerate(result.events))
    return Measured(window_rates(events, iterations, warmup, tail), skips=len(result.skips), wall_s=wall)


def run_real(setting: Setting, *, iterations: int, warmup: int, tail: int, compute_ms: float,
             model_mb: float, seed: int, runs_dir: Path) -> Measured:
    from hopnet.launch.launcher import launch

    run_dir = runs_dir / setting.key
    out = io.StringIO()
    args = ["--compute-ms", str(compute_ms), "--model-mb", str(model_mb), "--iterations", str(iterations),
            "--warmup", str(warmup)]
    started = time.perf_counter()
    result = launch(SYNTHETIC, args, graph=GRAPH, config=setting.config(seed), run_dir=run_dir,
                    stdout=out, stderr=out, argv=["bench/heterogeneity.py", setting.key])
    wall = time.perf_counter() - started
    if not result.ok:
        tail_text = "\n".join(out.getvalue().splitlines()[-15:])
        return Measured({}, wall_s=wall, error=f"rank {result.failed_rank}: {result.reason}\n{tail_text}")
    events = load_run(run_dir)
    skips = sum(1 for recs in events.values() for r in recs if r.get("event") == "skip")
    reported = {k: r["rate"] for k, recs in events.items() for r in recs if r.get("event") == "rate"}
    means = [float(line.rsplit("param mean", 1)[1]) for line in out.getvalue().splitlines()
             if "param mean" in line]
    # Workers start at params = rank, so the average over workers starts at (N - 1) / 2 and, when
    # every update is mixed (doubly stochastic W, no backup/staleness/skip), stays there, plus
    # the fake update's 1e-6 per iteration: a cheap check that the bytes mixed were the right ones.
    drift = round(sum(means) / len(means) - (N - 1) / 2, 6) if len(means) == N else None
    return Measured(window_rates(events, iterations, warmup, tail), skips=skips, wall_s=wall,
                    self_reported=reported, param_mean_drift=drift)


# --------------------------------------------------------------------------- output
def _f(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None or x != x else format(x, fmt)


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer iterations and settings (~3 minutes)")
    p.add_argument("--sim-only", action="store_true", help="skip the real-process runs")
    p.add_argument("--out", default=None, metavar="FILE", help="write every number as JSON to FILE")
    p.add_argument("--compute-ms", type=float, default=50.0, help="compute per iteration (default 50)")
    p.add_argument("--model-mb", type=float, default=0.05,
                   help="model size for real runs, MB (default 0.05: under the zmq transport's 64 KiB "
                        "zero-copy threshold; see docs/performance/archive.md, \"Heterogeneity\", for why)")
    p.add_argument("--sim-iterations", type=int, default=None, help="iterations per simulated run "
                   "(default 1000, --quick 400)")
    p.add_argument("--real-iterations", type=int, default=None, help="iterations per real run "
                   "(default 200, --quick 120)")
    p.add_argument("--warmup", type=int, default=20, help="iterations left out at the start (default 20)")
    p.add_argument("--tail", type=int, default=10, help="iterations left out at the end (default 10)")
    p.add_argument("--seed", type=int, default=0, help="slowdown seed (default 0)")
    p.add_argument("--only", default=None, metavar="KEYS", help="comma-separated setting keys to run")
    p.add_argument("--keep-runs", default=None, metavar="DIR", help="keep the real runs' logs under DIR")
    args = p.parse_args()

    sim_iters = args.sim_iterations or (400 if args.quick else 1000)
    real_iters = args.real_iterations or (120 if args.quick else 200)
    warmup, tail, c_ms, seed = args.warmup, args.tail, args.compute_ms, args.seed
    if min(sim_iters, real_iters) <= warmup + tail + 1:
        p.error("iterations must exceed warmup + tail + 1")
    settings = [s for s in SETTINGS if s.quick or not args.quick]
    if args.only:
        keys = set(args.only.split(",")) | {"none"}
        settings = [s for s in SETTINGS if s.key in keys]
    real_settings = [] if args.sim_only else [s for s in settings if s.real]

    t0 = time.perf_counter()
    print(f"hopnet heterogeneity benchmark: {N} workers on {GRAPH}, compute {c_ms:g} ms/iteration, "
          f"seed {seed}; {os.cpu_count()} CPUs; warm-up {warmup}, tail {tail} iterations", flush=True)

    sim: dict[str, Measured] = {}
    for s in settings:
        sim[s.key] = run_sim(s, iterations=sim_iters, warmup=warmup, tail=tail, compute_ms=c_ms, seed=seed)
    print(f"simulated {len(settings)} settings x {sim_iters} iterations in {time.perf_counter() - t0:.1f} s",
          flush=True)

    matched: dict[str, Measured] = {}
    real: dict[str, Measured] = {}
    runs_dir = Path(args.keep_runs) if args.keep_runs else Path(tempfile.mkdtemp(prefix="hopnet-het-"))
    try:
        for s in real_settings:
            matched[s.key] = run_sim(s, iterations=real_iters, warmup=warmup, tail=tail, compute_ms=c_ms,
                                     seed=seed)
            m = run_real(s, iterations=real_iters, warmup=warmup, tail=tail, compute_ms=c_ms,
                         model_mb=args.model_mb, seed=seed, runs_dir=runs_dir)
            real[s.key] = m
            status = f"error: {m.error.splitlines()[0]}" if m.error else (
                f"{m.mean_rate:.2f} it/s (sim {matched[s.key].mean_rate:.2f})")
            print(f"  real {s.key:<16} {status}  [{m.wall_s:.0f} s wall]", flush=True)
    finally:
        if not args.keep_runs:
            shutil.rmtree(runs_dir, ignore_errors=True)

    summary: dict[str, Any] = {}
    print()
    _experiment1(settings, sim, real, summary)
    print()
    _experiment2(settings, sim, real, summary)
    if real:
        print()
        _experiment3(real_settings, matched, real, summary)
    print()
    print("Summary")
    for line in summary.pop("_lines"):
        print("  " + line)
    total = time.perf_counter() - t0
    print(f"\ntotal {total:.0f} s")

    if args.out:
        doc = {
            "inputs": {"graph": GRAPH, "workers": N, "compute_ms": c_ms, "model_mb": args.model_mb,
                       "sim_iterations": sim_iters, "real_iterations": real_iters, "warmup": warmup,
                       "tail": tail, "seed": seed, "quick": args.quick, "sim_only": args.sim_only},
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version()},
            "settings": {s.key: {"label": s.label, "experiment": s.experiment, "flags": s.flags(),
                                 "sim": sim[s.key].to_dict(),
                                 "sim_matched": matched[s.key].to_dict() if s.key in matched else None,
                                 "real": real[s.key].to_dict() if s.key in real else None}
                         for s in settings},
            "summary": summary,
            "total_s": round(total, 1),
        }
        Path(args.out).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")
    return 0


def _ratio(a: float, b: float) -> float:
    return a / b if b and b == b and a == a else float("nan")


def _experiment1(settings: list[Setting], sim: dict[str, Measured], real: dict[str, Measured],
                 summary: dict[str, Any]) -> None:
    lines = summary.setdefault("_lines", [])
    rows = []
    ref_sim, ref_real = sim["none"].mean_rate, real["none"].mean_rate if "none" in real else float("nan")
    std_sim = sim["rand_standard"].mean_rate if "rand_standard" in sim else float("nan")
    std_real = real["rand_standard"].mean_rate if "rand_standard" in real else float("nan")
    slow_mean = 1.0 + (RANDOM_FACTOR - 1.0) * RANDOM_PROB
    ceil_sim, ceil_real = ref_sim / slow_mean, ref_real / slow_mean

    def row(label: str, flags: str, rs: float, rr: float) -> list[str]:
        return [label, flags, _f(rs), _f(_ratio(rs, ref_sim)), _f(_ratio(rs, std_sim)),
                _f(rr), _f(_ratio(rr, ref_real)), _f(_ratio(rr, std_real))]

    for s in settings:
        if s.experiment not in (0, 1):
            continue
        rr = real[s.key].mean_rate if s.key in real else float("nan")
        rows.append(row(s.label, s.flags(), sim[s.key].mean_rate, rr))
        if s.key == "none":
            rows.append(row("ceiling: 1/mean compute", f"no-slowdown rate / {slow_mean:g}", ceil_sim, ceil_real))
    print(f"Experiment 1: random slowdown {RANDOM} (iterations/s, mean over workers)")
    print(table(["setting", "flags", "sim it/s", "x none", "x std", "real it/s", "x none", "x std"], rows))
    best_key = max((s.key for s in settings if s.experiment == 1 and s.key not in ("rand_nowait", "rand_standard")),
                   key=lambda k: sim[k].mean_rate, default=None)
    e1: dict[str, Any] = {
        "sim": {"standard_vs_none": _r(_ratio(std_sim, ref_sim)),
                "ceiling_vs_standard": _r(_ratio(ceil_sim, std_sim)),
                **{f"{k}_vs_standard": _r(_ratio(sim[k].mean_rate, std_sim))
                   for k in sim if k.startswith("rand_") and k != "rand_standard"}},
        "real": {"standard_vs_none": _r(_ratio(std_real, ref_real)),
                 "ceiling_vs_standard": _r(_ratio(ceil_real, std_real)),
                 **{f"{k}_vs_standard": _r(_ratio(real[k].mean_rate, std_real))
                    for k in real if k.startswith("rand_") and k != "rand_standard"}},
        "target": 1.8,
    }
    summary["experiment1"] = e1
    if "rand_standard" not in sim:
        lines.append("[1] no standard run with random slowdown among the settings: no ratios")
        return
    b_sim = _ratio(sim["rand_backup"].mean_rate, std_sim) if "rand_backup" in sim else float("nan")
    has_real = std_real == std_real
    lines.append(f"[1] standard runs at {_f(_ratio(std_sim, ref_sim))}x the no-slowdown rate (sim)"
                 + (f", {_f(_ratio(std_real, ref_real))}x (real)" if has_real else "")
                 + f"; ceiling without skipping: {_f(1 / slow_mean, '.3f')}x, i.e. at most "
                 f"{_f(_ratio(ceil_sim, std_sim))}x over standard (sim)"
                 + (f", {_f(_ratio(ceil_real, std_real))}x (real)" if has_real else ""))
    lines.append(f"[1] backup 1 (Hop defaults otherwise) vs standard: {_f(b_sim)}x sim"
                 + (f", {_f(_ratio(real['rand_backup'].mean_rate, std_real))}x real" if "rand_backup" in real else ""))
    best_real = max((k for k in real if k.startswith("rand_") and k != "rand_standard"),
                    key=lambda k: real[k].mean_rate, default=None)
    lines.append((f"[1] best (sim): {best_key} {_f(_ratio(sim[best_key].mean_rate, std_sim))}x"
                  if best_key else "[1] no other setting simulated")
                 + (f"; best (real): {best_real} {_f(_ratio(real[best_real].mean_rate, std_real))}x"
                    if best_real else "")
                 + "; target backup >= 1.8x: "
                 + ("n/a (backup not run)" if b_sim != b_sim else "MET" if b_sim >= 1.8
                    else f"MISSED (above the {_f(_ratio(ceil_sim, std_sim))}x ceiling)"))


def _experiment2(settings: list[Setting], sim: dict[str, Measured], real: dict[str, Measured],
                 summary: dict[str, Any]) -> None:
    lines = summary.setdefault("_lines", [])
    base_sim = sim["none"].iter_ms
    base_real = real["none"].iter_ms if "none" in real else float("nan")
    rows = []
    e2: dict[str, Any] = {"sim": {}, "real": {}, "target": 1.05}
    for s in settings:
        if s.experiment not in (0, 2):
            continue
        ms = sim[s.key]
        mr = real.get(s.key)
        eff_s = _ratio(ms.others_iter_ms, base_sim)
        eff_r = _ratio(mr.others_iter_ms, base_real) if mr else float("nan")
        e2["sim"][s.key] = _r(eff_s)
        if mr:
            e2["real"][s.key] = _r(eff_r)
        rows.append([s.label, s.flags(), _f(ms.others_iter_ms, ".1f"), _f(eff_s), _f(ms.straggler_rate),
                     str(ms.skips), _f(mr.others_iter_ms if mr else None, ".1f"), _f(eff_r),
                     _f(mr.straggler_rate if mr else None), str(mr.skips) if mr else "-"])
    summary["experiment2"] = e2
    print(f"Experiment 2: worker 0 always 4x slower ({STRAGGLER}); effect = mean iteration time of "
          "workers 1-15 / no-slowdown iteration time")
    print(table(["setting", "flags", "sim ms/it", "effect", "w0 it/s", "skips",
                 "real ms/it", "effect", "w0 it/s", "skips"], rows))
    skip_keys = [s.key for s in settings if s.experiment == 2 and "skip" in s.key]
    for mode, eff in (("sim", e2["sim"]), ("real", e2["real"])):
        if not eff or "str_standard" not in eff:
            continue
        parts = [f"standard {_f(eff['str_standard'])}x"]
        for k in ("str_backup", "str_skip2", "str_skip10"):
            if k in eff:
                parts.append(f"{k[4:]} {_f(eff[k])}x")
        best = min((k for k in skip_keys if k in eff and eff[k] is not None), key=lambda k: eff[k], default=None)
        verdict = ""
        if best is not None:
            verdict = f"; best skip {best} {_f(eff[best])}x: target <= 1.05x " + (
                "MET" if eff[best] <= 1.05 else "MISSED")
        lines.append(f"[2] straggler effect ({mode}): " + ", ".join(parts) + verdict)


def _experiment3(real_settings: list[Setting], matched: dict[str, Measured], real: dict[str, Measured],
                 summary: dict[str, Any]) -> None:
    lines = summary.setdefault("_lines", [])
    rows = []
    e3: dict[str, Any] = {}
    for s in real_settings:
        m, r = matched[s.key], real[s.key]
        ratio = _ratio(r.mean_rate, m.mean_rate)
        ok = abs(ratio - 1.0) <= 0.15 if ratio == ratio else False
        e3[s.key] = {"sim": _r(m.mean_rate), "real": _r(r.mean_rate), "real_over_sim": _r(ratio), "within_15pct": ok,
                     "self_reported_real": _r(_mean(list(r.self_reported.values()))) if r.self_reported else None}
        rows.append([s.label if s.experiment != 2 else f"{s.label} (straggler)", s.flags(), _f(m.mean_rate),
                     _f(r.mean_rate), _f(ratio, ".3f"), "yes" if ok else "NO",
                     _f(_mean(list(r.self_reported.values())) if r.self_reported else None),
                     _f(r.param_mean_drift, ".1e") if r.param_mean_drift is not None else "-"])
    summary["experiment3"] = e3
    print("Experiment 3: simulator vs real processes, same iterations, warm-up and seed (iterations/s)")
    print(table(["setting", "flags", "sim", "real", "real/sim", "<=15%", "real, own clock", "param mean drift"], rows))
    ratios = [v["real_over_sim"] for v in e3.values() if v["real_over_sim"] is not None]
    inside = sum(1 for v in e3.values() if v["within_15pct"])
    if ratios:
        lines.append(f"[3] real/sim rate ratio: {min(ratios):.3f} .. {max(ratios):.3f} "
                     f"(median {statistics.median(ratios):.3f}); within 15% in {inside} of {len(e3)} settings")


if __name__ == "__main__":
    sys.exit(main())

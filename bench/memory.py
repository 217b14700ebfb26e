"""Peak RSS per worker against the model's size (issue 18: memory bounded by the model).

    python bench/memory.py                        # every setting at 1, 100 and 400 MB
    python bench/memory.py --sizes 1 100 --settings hop prague

Each run is one ``hopnet launch --nproc 4`` (the default ring unless the setting names a
graph) of examples/synthetic.py through bench/memory_worker.py: a float32 vector of
``--model-mb`` MB mixed for real, ``--iterations`` iterations of ``--compute-ms`` emulated
compute. Updates travel on the default plane (``--bulk auto``: gloo for messages of 16 MiB
or more, ZeroMQ below) unless the setting says otherwise. Each worker reports its RSS
before the model is built and its peak RSS (VmHWM) over the run.

Columns (MB of 10^6 bytes, as ``--model-mb``; ``min-max`` over ``--repeat`` runs): ``peak``
is the largest worker's peak RSS; ``beyond`` is peak minus the same setting's (highest) peak
with a 1 MB model (the process's baseline: torch, hopnet, the transport),
and ``x model`` is ``beyond / model``; ``x model (own)`` divides peak minus the worker's
own RSS before the model was built (that baseline leaves out what the run allocates
besides the model, so it reads a little higher). ``it/s`` is the ranks' iteration rate
(examples/synthetic.py's ``rate`` records, after the warm-up: slowest-fastest rank, over every run)
and ``held`` the updates (or chunks) Hop held back, summed over the ranks (``updates_held`` in the
stop records; ``-`` for a protocol without them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hopnet.analysis import load_run

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "bench" / "memory_worker.py"
KIB, MB = 1024, 1_000_000  # /proc's "kB" are KiB; --model-mb counts 10^6 bytes

SETTINGS: dict[str, list[str]] = {
    "hop": ["--protocol", "hop"],
    "hop-stale": ["--protocol", "hop", "--staleness", "2", "--max-ig", "4"],
    "hop-backup": ["--protocol", "hop", "--backup-workers", "1"],
    "hop-complete": ["--protocol", "hop", "--graph", "complete:4"],  # in-degree 3 instead of 2
    "hop-zmq": ["--protocol", "hop", "--bulk", "zmq"],  # updates over ZeroMQ (auto: gloo from 16 MiB)
    "hop-nohold": ["--protocol", "hop", "--no-hold-back"],  # the next iteration's updates taken in as they come
    "hop-stream": ["--protocol", "hop", "--stream-mib", "16"],  # updates of 16 MiB or more in chunks
    # Group protocols over ZeroMQ: on --bulk auto a 100 MB Prague run timed out in its first ring
    # all-reduce (chunks of 16 MiB over gloo between ranks that are not graph neighbours).
    "prague": ["--protocol", "prague", "--group-size", "2", "--bulk", "zmq"],
    "ad-psgd": ["--protocol", "ad-psgd"],
    "partial-reduce": ["--protocol", "partial-reduce", "--group-size", "2", "--bulk", "zmq"],
}


class RunFailed(Exception):
    """A launch that failed: (what, its output)."""


def span(values: list[float], scale: float, fmt: str) -> str:
    """``min-max`` of sorted ``values / scale`` (one value alone when they agree)."""
    low, high = format(values[0] / scale, fmt), format(values[-1] / scale, fmt)
    return low if low == high else f"{low}-{high}"


def one_run(setting: str, model_mb: float, args: argparse.Namespace, tmp: Path, index: int) -> list[dict[str, Any]]:
    out = tmp / f"{setting}-{model_mb}-{index}"
    out.mkdir()
    command = [sys.executable, "-m", "hopnet.cli.main", "launch", "--nproc", str(args.nproc), "--no-progress",
               "--run-dir", str(out / "run"), *SETTINGS[setting], str(WORKER),
               "--model-mb", str(model_mb), "--iterations", str(args.iterations), "--warmup", "1",
               "--compute-ms", str(args.compute_ms), "--quiet"]
    env = dict(os.environ, HOPNET_MEMORY_OUT=str(out))
    proc = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        kept = Path(tempfile.mkdtemp(prefix=f"hopnet-memory-failed-{setting}-{model_mb:g}-"))
        shutil.copytree(out / "run", kept / "run")
        raise RunFailed(f"exit code {proc.returncode}, run dir kept in {kept}", f"{proc.stdout}\n{proc.stderr}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.nproc)]
    for rank, records in load_run(out / "run").items():
        for record in records:
            if record.get("event") == "rate":
                ranks[rank]["rate"] = record["rate"]
            elif record.get("event") == "stop" and "updates_held" in record:
                ranks[rank]["held"] = record["updates_held"]
    return ranks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 100, 400], help="model sizes in MB")
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=1, help="runs per setting and size (peaks vary run to run)")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--json", type=Path, help="also write the raw numbers here")
    args = parser.parse_args()
    sizes = sorted(set(args.sizes) | {1.0})
    raw: dict[str, dict[str, list[list[dict[str, Any]]]]] = {}
    print("| setting | model MB | runs | peak MB | beyond 1 MB run | x model | x model (own) | it/s | held |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory(prefix="hopnet-memory-") as tmp:
        for setting in args.settings:
            raw[setting] = {}
            floor: float | None = None
            for mb in sizes:
                runs = []
                for i in range(args.repeat):
                    try:
                        runs.append(one_run(setting, mb, args, Path(tmp), i))
                    except RunFailed as failed:
                        print(f"| {setting} | {mb:g} | failed: {failed.args[0]} | | | | |", flush=True)
                        print(failed.args[1], file=sys.stderr)
                raw[setting][str(mb)] = runs
                if not runs:
                    continue
                # the largest worker's peak in each run
                peaks = sorted(max(r["peak_kb"] for r in ranks) * KIB / MB for ranks in runs)
                owns = sorted(max(r["peak_kb"] - r["baseline_kb"] for r in ranks) * KIB / MB for ranks in runs)
                rates = sorted(r["rate"] for ranks in runs for r in ranks if "rate" in r)
                rate = span(rates, 1, ".2f") if rates else "-"
                helds = [sum(r["held"] for r in ranks) for ranks in runs if all("held" in r for r in ranks)]
                held = "/".join(map(str, helds)) or "-"
                if mb == 1.0:
                    floor = peaks[-1]
                    print(f"| {setting} | {mb:g} | {len(runs)} | {span(peaks, 1, '.0f')} | | | | {rate} | {held} |",
                          flush=True)
                    continue
                if floor is None:
                    continue
                beyond = [p - floor for p in peaks]
                print(f"| {setting} | {mb:g} | {len(runs)} | {span(peaks, 1, '.0f')} | {span(beyond, 1, '.0f')} | "
                      f"{span(beyond, mb, '.2f')} | {span(owns, mb, '.2f')} | {rate} | {held} |", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

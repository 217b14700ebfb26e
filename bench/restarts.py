"""How long a dead worker is away: `hopnet launch --max-restarts 1`, one worker SIGKILLed mid-run.

Per trial: ``hopnet launch --nproc 4 --protocol P --max-restarts 1 examples/train_digits.py``
(ring:4), and once the victim's own event log shows iteration ``--kill-at``, SIGKILL to it.
The victim is rank 2, under ad-psgd rank 1 (a passive, signalled once the actives 0 and 2
train too: passives wait for nobody and run far ahead). Hop runs standard (strict: its
neighbours wait for the replacement). Measured from the signal, on the monotonic clock that the
processes of one machine share (the bench's own ``time.monotonic()`` at the kill; ``mono`` in
the records):

* ``spawn_s``: to the launcher's start of the replacement (``launch.json`` ``restarts[].mono``);
* ``rejoin_s``: to the replacement's ``rejoined`` record (it holds its donor's model);
* ``iter_s``: to the replacement's first ``iteration`` record (its first step done);
* ``stall_s``: the longest pause of a surviving rank's ``iteration`` records across the kill (how
  long the others waited: the strict protocols wait for the replacement);
* ``exit`` and the consensus accuracy of the run (rank 0's ``eval`` record with ``consensus``).

    python bench/restarts.py                                  # 3 trials x 7 protocols, ~5 min on 2 cores
    python bench/restarts.py --trials 5 --protocols prague --iterations 2000 --json restarts.json
    python bench/restarts.py --start-method exec       # each worker a new interpreter: it imports torch
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from faults import LaunchRun  # noqa: E402

DIGITS = str(ROOT / "examples" / "train_digits.py")
PROTOCOLS = ("partial-reduce", "prague", "ad-psgd", "hop", "hop-backup", "notify-ack", "allreduce", "pipe-sgd",
             "eager-sgd")
VICTIM = {"partial-reduce": 2, "prague": 2, "ad-psgd": 1, "hop": 2, "hop-backup": 2, "notify-ack": 2, "allreduce": 2,
          "pipe-sgd": 2, "eager-sgd": 2}
FLAGS = {"hop-backup": ("--protocol", "hop", "--backup-workers", "1")}
"""Cases that are a protocol with flags (the default case is the protocol of its name)."""
TRAINING_FIRST = {"ad-psgd": (0, 2)}
HANG_AFTER_S = 180.0

Record = dict[str, Any]


class Follow:
    """One rank's event log, read as it grows."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""

    def new(self) -> list[Record]:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]


def _until_iteration(run: LaunchRun, rank: int, at: int, deadline: float) -> bool:
    log = Follow(run.run_dir / f"rank{rank}.jsonl")
    while time.monotonic() < deadline and run.proc.poll() is None:
        if any(r.get("event") == "iteration" and r.get("iter", -1) >= at for r in log.new()):
            return True
        time.sleep(0.01)
    return False


def _replacement(run_dir: Path, rank: int) -> list[Record]:
    """The records of ``rank``'s log from its second ``start`` on (the replacement's)."""
    recs = [json.loads(line) for line in (run_dir / f"rank{rank}.jsonl").read_text().splitlines() if line.strip()]
    starts = [i for i, r in enumerate(recs) if r.get("event") == "start"]
    return recs[starts[1]:] if len(starts) > 1 else []


def _first(recs: list[Record], event: str) -> Record | None:
    return next((r for r in recs if r.get("event") == event), None)


def trial(protocol: str, iterations: int, kill_at: int, run_dir: Path, start_method: str | None) -> dict[str, Any]:
    victim = VICTIM[protocol]
    result: dict[str, Any] = {"protocol": protocol, "victim": victim, "spawn_s": None, "rejoin_s": None,
                              "iter_s": None, "stall_s": None, "exit": None, "accuracy": None, "donor": None,
                              "from_iter": None, "note": ""}
    method = ["--start-method", start_method] if start_method else []
    flags = FLAGS.get(protocol, ("--protocol", protocol))
    run = LaunchRun.start(["--nproc", "4", *flags, "--max-restarts", "1", *method, DIGITS,
                           "--iterations", str(iterations)], run_dir)
    pids: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 120
        pids = run.worker_pids(4, deadline)
        ready = len(pids) == 4 and all(_until_iteration(run, r, 1, deadline) for r in TRAINING_FIRST.get(protocol, ()))
        if not ready or not _until_iteration(run, victim, kill_at, deadline):
            last = run.launcher_lines()[-1:]
            result["note"] = (f"never reached the kill (launcher exit {run.proc.poll()}"
                              f"{': ' + last[0].text if last else ''})")
            return result
        killed = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        result["exit"] = run.wait(HANG_AFTER_S)
        if result["exit"] is None:
            result["note"] = f"HANG: still running {HANG_AFTER_S:.0f} s after the kill"
    finally:
        if run.proc.poll() is None:
            run.end(pids)
    launch = json.loads((run_dir / "launch.json").read_text())
    if launch.get("restarts"):
        result["spawn_s"] = launch["restarts"][0]["mono"] - killed
    recs = _replacement(run_dir, victim)
    rejoined, first_iter = _first(recs, "rejoined"), _first(recs, "iteration")
    if rejoined is not None:
        result.update(rejoin_s=rejoined["mono"] - killed, donor=rejoined["peer"], from_iter=rejoined["iter"])
    if first_iter is not None:
        result["iter_s"] = first_iter["mono"] - killed
    result["stall_s"] = _longest_stall(run_dir, victim, killed)
    for line in (run_dir / "rank0.jsonl").read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if rec.get("event") == "eval" and rec.get("consensus"):
            result["accuracy"] = rec["accuracy"]
    return result


def _longest_stall(run_dir: Path, victim: int, killed: float, window_s: float = 5.0) -> float | None:
    """The longest pause between two ``iteration`` records of a surviving rank that ends after the
    kill and begins within ``window_s`` of it: how long the others waited for the victim. A rank's
    last iteration is left out (an ad-psgd passive's lasts until the actives are done)."""
    gaps = []
    for path in run_dir.glob("rank*.jsonl"):
        if path.stem == f"rank{victim}":
            continue
        monos = [rec["mono"] for line in path.read_text().splitlines() if line.strip()
                 for rec in [json.loads(line)] if rec.get("event") == "iteration"][:-1]
        gaps += [b - a for a, b in zip(monos, monos[1:]) if b >= killed and a <= killed + window_s]
    return max(gaps, default=None)


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _summary(rows: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in rows if r[key] is not None]
    if not values:
        return "-"
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3, help="trials per protocol (default: 3)")
    parser.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=list(PROTOCOLS))
    parser.add_argument("--iterations", type=int, default=1500, help="training iterations per run (default: 1500)")
    parser.add_argument("--kill-at", type=int, default=200, help="SIGKILL once the victim logged this iteration")
    parser.add_argument("--start-method", choices=("forkserver", "exec"),
                        help="how the launcher starts workers, the replacement too (default: the launcher's)")
    parser.add_argument("--keep", help="run in this directory and keep the runs (default: a temporary one)")
    parser.add_argument("--json", type=Path, help="write every trial's numbers here")
    args = parser.parse_args()

    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hopnet-restarts-") as temporary:
        tmp = args.keep or temporary
        os.makedirs(tmp, exist_ok=True)
        for protocol in args.protocols:
            for i in range(args.trials):
                row = trial(protocol, args.iterations, args.kill_at, Path(tmp) / f"{protocol}-{i}", args.start_method)
                rows.append(row)
                print(f"{protocol:15s} trial {i}: spawn {_fmt(row['spawn_s'])} s, rejoin {_fmt(row['rejoin_s'])} s, "
                      f"first iteration {_fmt(row['iter_s'])} s, others' longest stall {_fmt(row['stall_s'])} s, "
                      f"exit {row['exit']}, "
                      f"accuracy {_fmt(row['accuracy'], 4)} {row['note']}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print()
    print("| protocol | victim | trials | exit 0 | spawn s | rejoin s | first iteration s | others' longest stall s "
          "| consensus accuracy |")
    print("| --- | ---: | ---: | ---: | --- | --- | --- | --- | --- |")
    for protocol in args.protocols:
        mine = [r for r in rows if r["protocol"] == protocol]
        accuracies = [r["accuracy"] for r in mine if r["accuracy"] is not None]
        print(f"| {protocol} | {VICTIM[protocol]} | {len(mine)} | {sum(r['exit'] == 0 for r in mine)} "
              f"| {_summary(mine, 'spawn_s')} | {_summary(mine, 'rejoin_s')} | {_summary(mine, 'iter_s')} "
              f"| {_summary(mine, 'stall_s')} "
              f"| {min(accuracies, default=0.0):.4f} min |")
    print("\nmedian (min-max), seconds from the SIGKILL")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

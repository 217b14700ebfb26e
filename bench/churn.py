"""Churn trials for bench/chaos.py: an elastic run that workers join and leave at random times.

Each trial starts ``hopnet launch --nproc 4 --max-nproc 6 --min-nproc 2 --protocol P`` (the
battery's ``--peer-timeout`` and ``--timeout``, its workload), waits until the ranks log
iterations, then fires ``--churn-events`` events, each after a seeded random 0.5-3 s pause: a
``hopnet join RUN_DIR --nproc 1``, or a SIGTERM (a preemption: a leave) to a random live worker
that has trained (a first worker or a joiner). A join is drawn only while the run is below
``--max-nproc``, a leave only while it stays above ``--min-nproc``. Then it waits for the
launcher and every ``hopnet join`` to exit; if no rank logs anything for ``--hang-after``
seconds meanwhile, the trial is a HANG and everything is killed.

Per trial: the launcher's and each ``hopnet join``'s exit status; each leaver's exit status
(a first worker's from ``launch.json``, a joiner's from its ``hopnet join``'s
``rank R exited ...`` line); ``orphans``: workers, joiners or members of the launcher's or a
join's process group still alive 2 s after the end; ``ok``: no hang, no orphans, the launcher,
every join and every leaver exited 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from faults import ROOT, LaunchRun, alive, clean_env, group_members, live_processes, workload

JOIN = (sys.executable, "-m", "hopnet.cli.main", "join")
NPROC, MAX_NPROC, MIN_NPROC = 4, 6, 2
CHURN_PROTOCOLS = ("hop", "allreduce", "eager-sgd", "pipe-sgd")
"""The battery's protocols that can change membership (docs/guides/elastic.md)."""
EXITED = re.compile(r"^hopnet join: rank (\d+) (exited (\d+)|killed by signal (\d+))", re.M)


@dataclass
class Joiner:
    proc: subprocess.Popen[str]
    out: Path
    ranks: dict[int, int] = field(default_factory=dict)
    """rank -> pid of the worker it started (read from /proc while it runs)."""

    def codes(self) -> dict[int, int]:
        """What its ``rank R exited ...`` lines say, by rank (a signal as -N)."""
        text = self.out.read_text() if self.out.exists() else ""
        return {int(m[1]): int(m[3]) if m[3] is not None else -int(m[4]) for m in EXITED.finditer(text)}


@dataclass
class ChurnTrial:
    protocol: str
    events: list[str] = field(default_factory=list)
    """In order: ``join``, ``leave R``."""
    exit: int | None = None
    join_exits: list[int | None] = field(default_factory=list)
    leave_exits: dict[int, int | None] = field(default_factory=dict)
    entered: int = 0
    """Joiners that entered a view (the others were told the run ended first, and exit 0)."""
    orphans: int = 0
    hang: bool = False
    ok: bool = False
    note: str = ""

    @property
    def joins(self) -> int:
        return sum(e == "join" for e in self.events)

    @property
    def leaves(self) -> int:
        return len(self.events) - self.joins


def children(parent: int) -> list[int]:
    """Live (not zombie) processes whose parent is ``parent``."""
    return live_processes(1, parent)


def _rank_of(pid: int) -> int | None:
    try:
        env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"HOPNET_RANK="):
            return int(item.split(b"=", 1)[1])
    return None


def _logged(run_dir: Path, rank: int, event: str) -> bool:
    try:
        return f'"event":"{event}"' in (run_dir / f"rank{rank}.jsonl").read_text().replace(" ", "")
    except OSError:
        return False


def _trained(run_dir: Path, rank: int) -> bool:
    return _logged(run_dir, rank, "iteration")


def _start_join(run_dir: Path, out: Path) -> Joiner:
    with out.open("w") as sink:
        proc = subprocess.Popen([*JOIN, str(run_dir), "--nproc", "1"], cwd=ROOT, env=clean_env(),
                                stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    return Joiner(proc, out)


def run_churn_trial(protocol: str, rng: random.Random, run_dir: Path, args: argparse.Namespace) -> ChurnTrial:
    trial = ChurnTrial(protocol)
    run = LaunchRun.start(["--nproc", str(NPROC), "--max-nproc", str(MAX_NPROC), "--min-nproc", str(MIN_NPROC),
                           "--protocol", protocol, "--peer-timeout", str(args.peer_timeout),
                           "--timeout", str(args.timeout), "--seed", str(rng.randrange(1 << 16)),
                           *workload(protocol, args.churn_iterations, args.compute_ms)], run_dir)
    pids: dict[int, int] = {}
    joiners: list[Joiner] = []
    left: set[int] = set()

    def watch_joiners() -> None:
        for joiner in joiners:
            for pid in children(joiner.proc.pid):
                rank = _rank_of(pid)
                if rank is not None:
                    joiner.ranks.setdefault(rank, pid)

    try:
        setup_deadline = time.monotonic() + args.start_timeout
        pids = run.worker_pids(NPROC, setup_deadline)
        if len(pids) < NPROC or not run.wait_training(setup_deadline):
            trial.note = "never started training: " + " / ".join(ln.text for ln in run.lines()[-3:])
            return trial
        members = NPROC  # members and admitted-to-be, as the battery counts them
        for n in range(args.churn_events):
            time.sleep(rng.uniform(0.5, 3.0))
            watch_joiners()
            if run.proc.poll() is not None:
                trial.note = f"finished after {n} of {args.churn_events} events (more --churn-iterations)"
                break
            live = {**pids, **{r: p for j in joiners for r, p in j.ranks.items()}}
            trained = sorted(r for r in alive(live) if r not in left and _trained(run_dir, r))
            can_join, can_leave = members < MAX_NPROC, members > MIN_NPROC + 1 and bool(trained)
            if can_join and (not can_leave or rng.random() < 0.5):
                joiners.append(_start_join(run_dir, run_dir.parent / f"{run_dir.name}-join{len(joiners)}.out"))
                trial.events.append("join")
                members += 1
            elif can_leave:
                victim = rng.choice(trained)
                os.kill(live[victim], signal.SIGTERM)
                left.add(victim)
                trial.events.append(f"leave {victim}")
                members -= 1
        ended = _wait_while_training(run, joiners, watch_joiners, args.hang_after)
        trial.exit = run.proc.poll()
        trial.join_exits = [joiner.proc.poll() for joiner in joiners]
        trial.hang = not ended
        everyone = {**pids, **{r: p for j in joiners for r, p in j.ranks.items()}}
        if trial.hang:
            _end_all(run, pids, joiners)
        else:
            time.sleep(2.0)
        stray = set(alive(everyone).values()) | set(group_members(run.proc.pid))
        for joiner in joiners:
            stray |= set(group_members(joiner.proc.pid)) | set(alive(joiner.ranks).values())
        trial.orphans = len(stray)
        codes = _launcher_codes(run_dir)
        for joiner in joiners:
            codes.update(joiner.codes())
        trial.leave_exits = {rank: codes.get(rank) for rank in sorted(left)}
        joined = {rank for joiner in joiners for rank in (*joiner.ranks, *joiner.codes())}
        trial.entered = sum(_logged(run_dir, rank, "joined") for rank in joined)
        trial.ok = (not trial.hang and trial.orphans == 0 and trial.exit == 0
                    and all(code == 0 for code in trial.join_exits)
                    and all(code == 0 for code in trial.leave_exits.values()))
        return trial
    finally:
        _end_all(run, pids, joiners)


def _wait_while_training(run: LaunchRun, joiners: list[Joiner], watch: Callable[[], None], hang_after: float) -> bool:
    """Until the launcher and every `hopnet join` exit (True), or no rank logged anything for
    ``hang_after`` seconds while they run (False: a hang; a slow run on busy cores is not one)."""
    logged, since = -1, time.monotonic()
    while run.proc.poll() is None or any(joiner.proc.poll() is None for joiner in joiners):
        watch()
        size = sum(_size(path) for path in run.run_dir.glob("rank*.jsonl"))
        if size != logged:
            logged, since = size, time.monotonic()
        elif time.monotonic() - since > hang_after:
            return False
        time.sleep(0.5)
    run.wait(10)  # its output readers
    return True


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _end_all(run: LaunchRun, pids: dict[int, int], joiners: list[Joiner]) -> None:
    for joiner in joiners:
        for pid in joiner.ranks.values():
            _kill(pid)
        try:
            os.killpg(joiner.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        joiner.proc.wait(timeout=10)
    run.end(pids)


def _launcher_codes(run_dir: Path) -> dict[int, int]:
    try:
        result = json.loads((run_dir / "launch.json").read_text()).get("result") or {}
    except (OSError, ValueError):
        return {}
    return {int(r): int(c) for r, c in (result.get("worker_returncodes") or {}).items() if c is not None}


def _kill(pid: int) -> None:
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def churn_summary(trials: list[ChurnTrial]) -> str:
    ran = [t for t in trials if not t.note.startswith("never")]
    leaves = [code for t in ran for code in t.leave_exits.values()]
    joins = [code for t in ran for code in t.join_exits]
    return (f"churn: {len(ran)} of {len(trials)} trials ran; {sum(t.joins for t in ran)} joins "
            f"({sum(t.entered for t in ran)} entered a view), "
            f"{sum(t.leaves for t in ran)} leaves; {sum(t.hang for t in ran)} hangs; "
            f"{sum(t.orphans for t in ran)} orphans; leaves exited 0 {sum(c == 0 for c in leaves)} of {len(leaves)}; "
            f"joins exited 0 {sum(c == 0 for c in joins)} of {len(joins)}; launcher exited 0 "
            f"{sum(t.exit == 0 for t in ran)} of {len(ran)}; trials ok {sum(t.ok for t in ran)} of {len(ran)}")


__all__ = ["CHURN_PROTOCOLS", "ChurnTrial", "churn_summary", "run_churn_trial"]

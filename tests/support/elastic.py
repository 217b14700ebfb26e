"""An elastic run as a user drives it from outside: `hopnet join RUN_DIR` while it trains, or a
SIGTERM to one worker (a preemption), for tests of scripts that train through an adapter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from support.env import clean_env
from support.launch import JOIN, kill, recorded_worker_pids, rendezvous_up, start_launch
from support.paths import ROOT
from support.records import records
from support.wait import wait_until



@dataclass
class Ended:
    """What a process printed and how it ended."""

    returncode: int
    stdout: str
    stderr: str = ""


def launch_and_join(args: Sequence[str], run_dir: Path, *, env: dict[str, str] | None = None,
                    timeout: float = 240) -> tuple[Ended, Ended]:
    """`hopnet launch ARGS` (its run directory ``run_dir``), and one `hopnet join` started as soon as
    the run's rendezvous is up (a joiner asks at its setup, so the run cannot end before it asks):
    the launcher's and the joiner's ends."""
    env = clean_env() if env is None else env
    out_path, err_path = run_dir.parent / "joiner.out", run_dir.parent / "joiner.err"
    launcher = start_launch(args, env=env, new_session=True)
    joiner: subprocess.Popen[str] | None = None
    try:
        wait_until(lambda: rendezvous_up(run_dir), 120, what="the run's rendezvous", while_running=launcher)
        # (into files: a pipe nobody reads until the launcher ends would stop a joiner that writes much)
        with open(out_path, "w") as out_file, open(err_path, "w") as err_file:
            joiner = subprocess.Popen([*JOIN, str(run_dir), "--nproc", "1"], cwd=ROOT, env=env, stdout=out_file,
                                      stderr=err_file, text=True)
        out, err = launcher.communicate(timeout=timeout)
        joiner.wait(timeout=60)
    finally:
        kill(launcher)
        if joiner is not None and joiner.poll() is None:
            joiner.kill()
            joiner.wait()
    joined = Ended(joiner.returncode, out_path.read_text(), err_path.read_text())
    return Ended(launcher.returncode, out, err), joined


def launch_and_preempt(args: Sequence[str], run_dir: Path, rank: int, after_iteration: int, *,
                       env: dict[str, str] | None = None, timeout: float = 240) -> Ended:
    """`hopnet launch ARGS`, and a SIGTERM to ``rank`` alone once it finished ``after_iteration``."""
    launcher = start_launch(args, env=clean_env() if env is None else env, new_session=True)
    try:
        wait_until(lambda: any(r["iter"] >= after_iteration for r in records(run_dir, rank, "iteration")), 180,
                   interval=0.05, what=f"rank {rank}'s iteration {after_iteration}", while_running=launcher)
        os.kill(recorded_worker_pids(run_dir)[rank], signal.SIGTERM)
        out, err = launcher.communicate(timeout=timeout)
    finally:
        kill(launcher)
    return Ended(launcher.returncode, out, err)


def worker_returncode(run_dir: Path, rank: int) -> int | None:
    """``rank``'s exit status, as the launcher recorded it."""
    record = json.loads((run_dir / "launch.json").read_text())
    code = record["result"]["worker_returncodes"].get(str(rank))
    return None if code is None else int(code)


def assert_joined_late(ended: Ended, joined: Ended, run_dir: Path, joiner: int, *, last: int) -> None:
    """The run and ``hopnet join`` exited 0; ``joiner`` joined once, while the run trained (past its first
    iteration: a joiner forked from `hopnet join`'s fork server may get in before the first workers'
    gate), from a member that was there before it, computed from its join on, and ended at ``last``."""
    assert ended.returncode == 0, ended.stderr[-3000:]
    assert joined.returncode == 0, joined.stderr[-3000:]
    entries = records(run_dir, joiner, "joined")
    assert len(entries) == 1, joined.stderr[-3000:]  # (a joiner the run ended before says so, and exits 0)
    entry = entries[0]
    assert entry["iter"] > 0 and entry["donor"] < joiner, entry
    computed = records(run_dir, joiner, "iteration")
    assert computed[0]["iter"] == entry["iter"] and computed[-1]["iter"] == last

"""`hopnet launch` as a user runs it (a fresh interpreter, a clean environment), to its end or
left running; and through its entry point in this process, for arguments it refuses."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

from hopnet.cli.main import main as cli_main

from support.env import clean_env
from support.paths import ROOT
from support.wait import wait_until

LAUNCH = (sys.executable, "-m", "hopnet.cli.main", "launch")


def run_launch(args: Sequence[str], *, cwd: Path = ROOT, timeout: float = 240,
               env: dict[str, str] | None = None, fresh_interpreter: bool = False) -> subprocess.CompletedProcess[str]:
    """`hopnet launch ARGS` to its end, capturing output; the launcher ends its workers itself.

    The launcher runs through the command's entry point in this process, in ``env`` and ``cwd``
    (restored afterwards): its fork server, coordinator and workers are real processes as ever,
    and the interpreter start and torch import of a launcher process are saved, the larger part
    of a short launch's CPU. ``fresh_interpreter`` runs it as a user does, in a process of its own
    (``timeout`` applies there). Tests that signal the launcher use :func:`start_launch`."""
    env = clean_env() if env is None else env
    if fresh_interpreter:
        return subprocess.run([*LAUNCH, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    with _environment(env, cwd):
        return launch_in_process(args)


@contextmanager
def _environment(env: dict[str, str], cwd: Path) -> Iterator[None]:
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)


def launch_in_process(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """`hopnet launch ARGS` through the command's entry point in this process, for arguments it
    refuses before it starts anything: the same exit status and output as :func:`run_launch`
    without an interpreter start (one real-process refusal stays in test_launcher.py)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = cli_main(["launch", *args])
        except SystemExit as exc:  # argparse's own refusals
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(["hopnet", "launch", *args], code, out.getvalue(), err.getvalue())


def start_launch(args: Sequence[str], *, cwd: Path = ROOT, env: dict[str, str] | None = None,
                 merge_stderr: bool = False, new_session: bool = False) -> subprocess.Popen[str]:
    """`hopnet launch ARGS` left running, for tests that signal or kill it (end it with :func:`kill`).

    ``merge_stderr`` sends stderr into stdout; ``new_session`` puts the launcher and its
    workers in a process group of their own, which :func:`kill` then ends as a whole."""
    return subprocess.Popen([*LAUNCH, *args], cwd=cwd, env=clean_env() if env is None else env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                            text=True, start_new_session=new_session)


def recorded_worker_pids(run_dir: Path) -> dict[int, int]:
    """Each rank's pid as the launcher recorded it in ``launch.json`` (empty before the workers
    of its machine all started)."""
    try:
        pids = json.loads((run_dir / "launch.json").read_text()).get("worker_pids", {})
    except (OSError, ValueError):
        pids = {}
    return {int(rank): int(pid) for rank, pid in pids.items()}


def worker_pids(run_dir: Path, count: int, *, timeout_s: float = 120.0) -> dict[int, int]:
    """:func:`recorded_worker_pids`, waiting until ``count`` workers are listed."""
    def listed() -> dict[int, int]:
        pids = recorded_worker_pids(run_dir)
        return pids if len(pids) >= count else {}
    return wait_until(listed, timeout_s, what=lambda: f"launch.json in {run_dir} to list {count} worker pids "
                                                     f"(it lists {recorded_worker_pids(run_dir)})")


def kill(proc: subprocess.Popen[str]) -> None:
    """End a process :func:`start_launch` started (its whole group if it has one of its own)."""
    if proc.poll() is not None:
        return
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except ProcessLookupError:
        pass
    proc.communicate()  # reaps it and closes its pipes


JOIN = (sys.executable, "-m", "hopnet.cli.main", "join")


def rendezvous_up(run_dir: Path) -> bool:
    """Whether the run in ``run_dir`` has said where its rendezvous is (`hopnet join` can ask it)."""
    try:
        return bool(json.loads((run_dir / "launch.json").read_text()).get("rendezvous"))
    except (OSError, ValueError):
        return False


@contextmanager
def joining(run_dir: Path, nproc: int) -> Iterator[subprocess.Popen[str]]:
    """`hopnet join RUN_DIR --nproc N`, started once the run's rendezvous is up (its output in the
    process's stdout); killed at the end if it still runs."""
    wait_until(lambda: rendezvous_up(run_dir), 120, what="the run's rendezvous")
    joiner = subprocess.Popen([*JOIN, str(run_dir), "--nproc", str(nproc)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        yield joiner
    finally:
        if joiner.poll() is None:
            joiner.kill()
            joiner.communicate()

"""`hopnet launch` run as a user runs it: a fresh interpreter, a clean environment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from support.env import clean_env
from support.paths import ROOT

LAUNCH = (sys.executable, "-m", "hopnet.cli.main", "launch")


def run_launch(args: Sequence[str], *, cwd: Path = ROOT, timeout: float = 240,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`hopnet launch ARGS` to its end, capturing output; the launcher ends its workers itself."""
    return subprocess.run([*LAUNCH, *args], cwd=cwd, env=clean_env() if env is None else env,
                          capture_output=True, text=True, timeout=timeout)


def start_launch(args: Sequence[str], *, cwd: Path = ROOT, env: dict[str, str] | None = None,
                 merge_stderr: bool = False, new_session: bool = False) -> subprocess.Popen[str]:
    """`hopnet launch ARGS` left running, for tests that signal or kill it (end it with :func:`kill`).

    ``merge_stderr`` sends stderr into stdout; ``new_session`` puts the launcher and its
    workers in a process group of their own, which :func:`kill` then ends as a whole."""
    return subprocess.Popen([*LAUNCH, *args], cwd=cwd, env=clean_env() if env is None else env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                            text=True, start_new_session=new_session)


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

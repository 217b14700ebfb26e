"""One warm fork-server template per test session (:mod:`hopnet.bootstrap.forkserver_template`),
shared by its test processes: every launch a test starts, in a test process or in a launcher
process of its own, gets its fork server forked from it instead of importing torch again, the
larger part of a short launch's CPU. A launch whose template is gone starts its fork server
itself, as without one."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hopnet.bootstrap.forkserver_template import TEMPLATE_VAR

from support.paths import ROOT


@contextmanager
def forkserver_template(env: dict[str, str], *, wait: bool = True) -> Iterator[str]:
    """A template started in ``env`` from the checkout's root; its socket's path (once it listens,
    with ``wait``; else at once: see :func:`wait_for_template`)."""
    directory = tempfile.mkdtemp(prefix="hopnet-template-")
    path = str(Path(directory) / "socket")
    proc = subprocess.Popen([sys.executable, "-m", "hopnet.bootstrap.forkserver_template", path],
                            cwd=ROOT, env={k: v for k, v in env.items() if k != TEMPLATE_VAR},
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        if wait:
            wait_for_template(path, proc)
        yield path
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(directory, ignore_errors=True)


def wait_for_template(socket_path: str, proc: subprocess.Popen[bytes] | None = None,
                      timeout_s: float = 60.0) -> None:
    """Until the template listens (it binds its socket once its imports are done): a launch asking
    earlier would start a fork server of its own and import everything again. A template that dies
    or takes longer only costs that (the launches go on without it)."""
    deadline = time.monotonic() + timeout_s
    while (not Path(socket_path).exists() and (proc is None or proc.poll() is None)
           and time.monotonic() < deadline):
        time.sleep(0.05)


def use_template(path: str) -> None:
    """Launches this process starts from now on ask the template at ``path`` (see support.env)."""
    os.environ[TEMPLATE_VAR] = path

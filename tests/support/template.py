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
from typing import Any

from hopnet.bootstrap.forkserver_template import TEMPLATE_VAR

from support.env import clean_env
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


FRAMEWORKS = "lightning,transformers,accelerate"
"""What a session's template imports besides torch and hopnet (one that is not installed is
skipped): a launch of a script that imports Lightning then costs 0.9 CPU-s instead of 3.1 (2
workers, 5 steps), because its fork server no longer imports Lightning itself. The launcher's own
preload of what a script imports is tested without a template (test_preload.py)."""


def session_template_env(config: Any) -> dict[str, str]:
    """The environment a session's template starts in: with :data:`FRAMEWORKS` unless the slow
    tests, which launch the adapters' scripts, are left out (the quick tier would only wait for
    their imports)."""
    frameworks = "none" if "not slow" in (config.getoption("markexpr", "") or "") else FRAMEWORKS
    return clean_env(HOPNET_PRELOAD=frameworks)


def use_template(path: str) -> None:
    """Launches this process starts from now on ask the template at ``path`` (see support.env)."""
    os.environ[TEMPLATE_VAR] = path

"""One warm fork-server template per test process (:mod:`hopnet.bootstrap.forkserver_template`):
every launch a test starts, in this process or in a launcher process of its own, gets its fork
server forked from it instead of importing torch again, the larger part of a short launch's CPU.
A launch whose template is gone starts its fork server itself, as without one."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hopnet.bootstrap.forkserver_template import TEMPLATE_VAR

from support.paths import ROOT


@contextmanager
def forkserver_template(env: dict[str, str]) -> Iterator[str]:
    """A template started in ``env`` from the checkout's root; its socket's path."""
    directory = tempfile.mkdtemp(prefix="hopnet-template-")
    path = str(Path(directory) / "socket")
    proc = subprocess.Popen([sys.executable, "-m", "hopnet.bootstrap.forkserver_template", path],
                            cwd=ROOT, env={k: v for k, v in env.items() if k != TEMPLATE_VAR},
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        yield path
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(directory, ignore_errors=True)


def use_template(path: str) -> None:
    """Launches this process starts from now on ask the template at ``path`` (see support.env)."""
    os.environ[TEMPLATE_VAR] = path

"""Workers end when their launcher does, even when it is killed with SIGKILL.

Two mechanisms, both armed first thing in a worker (before the script imports torch):

* the **parent-death signal** (Linux ``prctl(PR_SET_PDEATHSIG, SIGTERM)``): the kernel
  sends SIGTERM when the launcher dies. Armed in the worker itself, not in a
  ``preexec_fn`` of the launcher (unsafe with threads), so there is a window between
  the fork and the arming: :func:`arm_parent_death_signal` then compares ``getppid()``
  with the launcher's pid and reports the launcher gone if it already is;
* a **pipe** (portable): the launcher keeps the write end and every worker inherits
  the read end; when the launcher dies the kernel closes the write end and the read
  returns end-of-file, however early or late. A thread waits on it, sends SIGTERM to its
  own process and, if the process is still there :data:`BACKSTOP_S` seconds later
  (a handler that never returns, a hung close), ends it with ``os._exit``.

SIGTERM makes a worker started by `hopnet launch` leave promptly and quietly
(:mod:`hopnet.bootstrap.worker_main`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping

PARENT_FD = "HOPNET_PARENT_FD"
"""File descriptor of the read end of the launcher's pipe, inherited by the worker."""

LAUNCHER_PID = "HOPNET_LAUNCHER_PID"
"""Process id of the launcher (the worker's parent)."""

BACKSTOP_S = 2.0
"""After the launcher is gone, how long a worker gets to close before it is ended hard."""

_PR_SET_PDEATHSIG = 1


def arm_parent_death_signal(signum: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent dies (Linux only).

    Returns False where ``prctl`` is not available.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _end_self(backstop_s: float, exit_code: int) -> None:
    try:
        os.kill(os.getpid(), signal.SIGTERM)
    except OSError:
        pass
    time.sleep(backstop_s)
    os._exit(exit_code)


def _watch_pipe(fd: int, backstop_s: float) -> None:
    try:
        while True:
            try:
                data = os.read(fd, 4096)
            except InterruptedError:
                continue
            if not data:
                break
    except OSError:
        pass  # a closed or bad descriptor: treat like the launcher gone
    _end_self(backstop_s, 128 + signal.SIGTERM)


def start(environ: Mapping[str, str] | None = None, backstop_s: float = BACKSTOP_S) -> bool:
    """Arm both mechanisms from the launcher's variables; False when not started by a launcher."""
    environ = os.environ if environ is None else environ
    fd_text, pid_text = environ.get(PARENT_FD), environ.get(LAUNCHER_PID)
    if not fd_text or not pid_text:
        return False
    try:
        fd, launcher_pid = int(fd_text), int(pid_text)
    except ValueError:
        return False
    armed = arm_parent_death_signal(signal.SIGTERM)
    threading.Thread(target=_watch_pipe, args=(fd, backstop_s), name="hopnet-parent-watch", daemon=True).start()
    if armed and os.getppid() != launcher_pid:
        # The launcher died before the signal was armed: nobody will send it now.
        threading.Thread(target=_end_self, args=(backstop_s, 128 + signal.SIGTERM), daemon=True).start()
    return True

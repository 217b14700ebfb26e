"""Ending a process without the interpreter's teardown.

With torch loaded, tearing the modules down takes seconds on a busy machine, after everything
was said and while a launcher (or a user) waits. A worker, the fork server's children and the
`hopnet launch` process itself end this way: the script's non-daemon threads are waited for
(when asked), the atexit handlers run, stdout and stderr are flushed, then ``os._exit``.
What the program left open other than through those is not flushed, as with ``os._exit``.

Standard library only: the command line imports it before deciding whether torch is needed.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def join_non_daemon_threads() -> None:
    """Wait for the non-daemon threads as the interpreter's exit does: first the callbacks
    registered with ``threading._register_atexit`` (``concurrent.futures`` uses one to tell its
    idle pool threads to end: torch.compile leaves such a pool behind), then the joins. Joining
    without those callbacks waits forever on an idle pool."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()
        return
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()


def exit_now(code: int, *, join_threads: bool = True) -> NoReturn:
    """End the process with ``code`` as the interpreter would, minus the teardown of its modules.
    ``join_threads``: first wait for the non-daemon threads, as a normal exit does (off when the
    process was asked to stop and must not wait on a script's threads)."""
    if join_threads:
        join_non_daemon_threads()
    atexit._run_exitfuncs()
    flush_stdio()
    os._exit(code)


__all__ = ["exit_now", "flush_stdio"]

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
import weakref
from typing import NoReturn

IN_PROCESS_FINALIZERS = ("torch.library",)
"""Modules whose ``weakref.finalize`` callbacks only undo in-process state: torch.library's
unregister each operator library from this process's dispatcher, about 170 of them once
``torch._dynamo`` is imported. In a process forked from a fork server that touches pages shared
with it, and took about a third of the CPU a one-step launch spends in its workers."""


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


def skip_in_process_finalizers() -> None:
    """Keep the finalizers of :data:`IN_PROCESS_FINALIZERS` from running at exit; the others
    (a temporary directory's, a script's own) still run."""
    registry = getattr(weakref.finalize, "_registry", {})
    for finalizer in list(registry):
        details = finalizer.peek()
        if details is not None and getattr(details[1], "__module__", None) in IN_PROCESS_FINALIZERS:
            finalizer.atexit = False


def exit_now(code: int, *, join_threads: bool = True) -> NoReturn:
    """End the process with ``code`` as the interpreter would, minus the teardown of its modules
    and the finalizers that only undo in-process state. ``join_threads``: first wait for the
    non-daemon threads, as a normal exit does (off when the process was asked to stop and must not
    wait on a script's threads)."""
    if join_threads:
        join_non_daemon_threads()
    skip_in_process_finalizers()
    atexit._run_exitfuncs()
    flush_stdio()
    os._exit(code)


__all__ = ["exit_now", "flush_stdio"]

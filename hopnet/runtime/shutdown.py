"""Closing workers however the process ends: return, ``sys.exit``, an exception, a signal.

A worker that is still open when the interpreter exits is closed by an ``atexit``
hook, before Python finalizes: its event-loop thread would otherwise keep running
callbacks (uvloop's poll handle on the ZeroMQ socket) into an interpreter that is
being torn down, which segfaults or aborts. Closing runs in order: the node leaves
(``bye`` to the neighbours) and flushes, the sockets close, the ZeroMQ context
terminates, then the loop thread stops and is joined.

How the process ends decides how a worker closes:

* exit status 0: like :meth:`~hopnet.api.Worker.close` (finish sends, flush);
* anything else (an uncaught exception, ``sys.exit(N)`` with N != 0, SIGTERM): the
  worker writes an ``error`` record to its event log and leaves promptly, waiting only
  briefly for its last sends, never for its neighbours.

The entry point `hopnet launch` runs scripts through (:mod:`hopnet.bootstrap.worker_main`)
knows the exit status and calls :func:`finish`; without it an exception is caught by the
``sys.excepthook`` that :func:`track` installs, and ``sys.exit(N)`` is closed like a
normal exit (Python tells ``atexit`` hooks nothing about the status).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from hopnet.errors import PEER_STATES

_PROCESS_START = time.monotonic()


class Terminated(BaseException):
    """Raised in the main thread when the process is asked to stop (SIGTERM, parent gone).

    A ``BaseException`` so ``except Exception`` in a training script does not swallow it.
    """

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class Closable(Protocol):
    rank: int

    def close(self) -> None: ...

    def abort(self, error: BaseException | None, exit_code: int) -> None: ...


_lock = threading.Lock()
_open: list[Closable] = []
"""Strong references: a worker the script dropped without closing is still open (its loop
thread runs) and must be closed all the same."""
_installed = False
_failure: tuple[BaseException | None, int] | None = None


def exit_code_of(exc: BaseException | None) -> int:
    """The status the process exits with when ``exc`` ends it (``None``: a normal return)."""
    if exc is None:
        return 0
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, bool) or not isinstance(code, int):
            return 1  # sys.exit("message") prints the message and exits 1
        return code & 0xFF
    if isinstance(exc, Terminated):
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        return 128 + signal.SIGINT
    return 1


def error_fields(exc: BaseException | None, exit_code: int) -> dict[str, Any]:
    """The failure part of an ``error`` event record: class, one-line message, blamed peer."""
    if exc is None:
        name, message = "Exit", f"exit code {exit_code}"
    elif isinstance(exc, SystemExit):
        name, message = "SystemExit", f"sys.exit({exc.code!r})"
    else:
        name = type(exc).__name__
        message = " ".join(str(exc).split()) or name
    peer = getattr(exc, "peer", None)
    state = getattr(exc, "peer_state", None)
    return {
        "error": name,
        "message": message,
        "peer": peer if isinstance(peer, int) and not isinstance(peer, bool) else None,
        "peer_state": state if state in PEER_STATES else None,
        "exit_code": exit_code,
    }


def iteration_of(exc: BaseException | None) -> int | None:
    iteration = getattr(exc, "iteration", None)
    return iteration if isinstance(iteration, int) and not isinstance(iteration, bool) else None


def write_error_record(run_dir: str | os.PathLike[str], rank: int, exc: BaseException | None, exit_code: int,
                       iteration: int | None = None, log_name: str | None = None) -> None:
    """Append an ``error`` record to ``run_dir/rank{R}.jsonl`` (or ``log_name`` in it: a replica's lane)
    when no worker is open to write it (the failure came before ``hopnet.init`` finished). ``t``
    counts from the process start."""
    record = {"event": "error", "rank": rank, "t": round(time.monotonic() - _PROCESS_START, 6),
              "mono": time.monotonic(), "iter": iteration if iteration is not None else iteration_of(exc),
              **error_fields(exc, exit_code)}
    try:
        path = Path(run_dir) / (log_name or f"rank{rank}.jsonl")
        path.parent.mkdir(exist_ok=True)
        with path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, separators=(",", ":")) + "\n")
    except OSError:
        pass


def open_workers() -> list[Closable]:
    with _lock:
        return list(_open)


def track(worker: Closable) -> None:
    """Close ``worker`` at interpreter exit if nobody else does; install the hooks once."""
    global _installed
    with _lock:
        _open.append(worker)
        first = not _installed
        _installed = True
    if first:
        atexit.register(_at_exit)
        _install_excepthook()


def untrack(worker: Closable) -> None:
    with _lock:
        _open[:] = [w for w in _open if w is not worker]


def finish(exc: BaseException | None, code: int | None = None) -> int:
    """Close every open worker as the process ends with ``exc`` (``None``: normal return)
    and exit status ``code`` (default: :func:`exit_code_of` ``exc``).

    Returns the exit status. Failures (a non-zero status) write an ``error`` record and
    leave promptly; a zero status closes normally.
    """
    code = exit_code_of(exc) if code is None else code
    for worker in reversed(open_workers()):
        try:
            if code == 0:
                worker.close()
            else:
                worker.abort(exc, code)
        except BaseException:  # noqa: BLE001 - closing the others matters more than this one
            pass
    return code


def _at_exit() -> None:
    exc, code = _failure if _failure is not None else (None, 0)
    finish(exc, code)


def _install_excepthook() -> None:
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        global _failure
        _failure = (exc, exit_code_of(exc))
        previous(kind, exc, tb)

    sys.excepthook = hook

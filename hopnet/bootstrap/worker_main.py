"""The entry point `hopnet launch` runs every worker through.

    python -m hopnet.bootstrap.worker_main SCRIPT [ARGS...]
    python -m hopnet.bootstrap.worker_main -m MODULE [ARGS...]

It runs the script as ``python SCRIPT ARGS`` would (``__name__ == "__main__"``,
``sys.argv``, ``sys.path[0]`` the script's directory) and owns the process's whole life:

* before the script imports anything it arms the launcher watch
  (:mod:`hopnet.bootstrap.parent_watch`) and a SIGTERM handler that raises
  :class:`~hopnet.runtime.shutdown.Terminated` in the main thread;
* however the script ends it closes the open workers in order
  (:func:`hopnet.runtime.shutdown.finish`): normally on success, promptly with an
  ``error`` record otherwise;
* it exits with the script's own status: 0, ``N`` for ``sys.exit(N)``, 1 for an
  uncaught exception (traceback printed as Python would, without this module's frames;
  one line for a failure a peer caused, a :class:`~hopnet.errors.PeerFailure` or a
  :class:`~hopnet.errors.WaitTimeout` naming the peer),
  2 for a hopnet :class:`~hopnet.errors.ConfigError` (one line; a rendezvous refusal,
  such as ranks that disagree on options, is one line too; under `hopnet launch`, which
  prints a configuration error once for all ranks from their error records, nothing), 143 for SIGTERM (nothing
  printed: the launcher says why it stopped the run).
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time
from types import FrameType, TracebackType
from typing import NoReturn

from hopnet.bootstrap import parent_watch
from hopnet.bootstrap.quick_exit import exit_now, flush_stdio
from hopnet.bootstrap.title import title_launched_worker
from hopnet.runtime import shutdown

USAGE = "usage: python -m hopnet.bootstrap.worker_main [-m MODULE | SCRIPT] [ARGS...]"


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Once: a second SIGTERM must not interrupt the prompt close the first one started.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise shutdown.Terminated(signum)


def _script_traceback(tb: TracebackType | None) -> TracebackType | None:
    """Drop the frames of this module and runpy from the top of ``tb``."""
    def ours(filename: str) -> bool:
        return (filename.startswith("<frozen runpy") or os.path.basename(filename) == "runpy.py"
                or os.path.abspath(filename) == os.path.abspath(__file__))

    while tb is not None and ours(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def _report(exc: BaseException) -> None:
    """Print what ended the script, the way the interpreter would (or quieter)."""
    from hopnet.errors import ConfigError, MembershipStopped
    from hopnet.rendezvous.wire import RendezvousError

    if isinstance(exc, (shutdown.Terminated, KeyboardInterrupt)):
        return
    if isinstance(exc, SystemExit):
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
        return
    if isinstance(exc, ConfigError) and os.environ.get(parent_watch.LAUNCHER_PID):
        return  # `hopnet launch` prints it once for every rank, from this rank's error record
    if isinstance(exc, (ConfigError, RendezvousError)):
        print(f"hopnet: error: {exc}", file=sys.stderr)
        return
    if isinstance(exc, MembershipStopped):
        print(f"hopnet: {exc}", file=sys.stderr)  # the membership's one line (an elastic run)
        return
    if _caused_by_a_peer(exc):
        # A consequence of another rank's failure: that rank prints its own traceback and the
        # launcher names it; the hopnet internals of how this one noticed would only bury it.
        print(f"hopnet: {type(exc).__name__}: {exc}", file=sys.stderr)
        return
    tb = _script_traceback(exc.__traceback__)
    exc.with_traceback(tb)  # the interpreter's hook prints the exception's own traceback
    sys.excepthook(type(exc), exc, tb)


def _caused_by_a_peer(exc: BaseException) -> bool:
    """A :class:`~hopnet.errors.PeerFailure`, or a wait that names the peer it waited on."""
    from hopnet.errors import PeerFailure, WaitTimeout

    return isinstance(exc, PeerFailure) or (isinstance(exc, WaitTimeout) and exc.peer is not None)


def run(argv: list[str]) -> BaseException | None:
    """Run the script; return what ended it (``None``: it returned)."""
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        print(USAGE, file=sys.stderr)
        return SystemExit(2)
    try:
        if argv[0] == "-m":
            module = argv[1]
            sys.argv = [module, *argv[2:]]  # runpy puts the module's path in argv[0]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            script = argv[0]
            sys.argv = list(argv)
            if os.path.isfile(script):
                sys.path[0] = os.path.dirname(os.path.abspath(script))
            runpy.run_path(script, run_name="__main__")
    except BaseException as exc:  # noqa: BLE001 - every way out is reported and mapped to a status
        return exc
    return None


def _exit_code(exc: BaseException | None) -> int:
    from hopnet.errors import ConfigError

    return 2 if isinstance(exc, ConfigError) else shutdown.exit_code_of(exc)


def _record_without_worker(exc: BaseException | None, code: int) -> None:
    """The failure came before hopnet.init finished (or after close): log it all the same."""
    from hopnet.bootstrap.env import RANK, RUN_DIR, WORLD_SIZE
    from hopnet.replica.layout import ReplicaLayout

    run_dir, rank = os.environ.get(RUN_DIR), os.environ.get(RANK)
    if run_dir and rank and rank.strip().isdigit() and os.path.isdir(run_dir):
        try:
            layout = ReplicaLayout.from_environ(os.environ, int(os.environ.get(WORLD_SIZE, "0") or 0) or int(rank) + 1)
        except Exception:  # noqa: BLE001 - a bad variable: the record goes where a rank's would
            layout = ReplicaLayout()
        log_name = layout.log_name(int(rank)) if layout.grouped else None
        shutdown.write_error_record(run_dir, int(rank), exc, code, log_name=log_name)


SIGNAL_GRACE_S = 0.5


def _stop_underneath(exc: BaseException | None) -> BaseException | None:
    """A SIGTERM that an error raised while closing then hid (the ``Terminated`` is in the
    error's context): the worker was stopped, and that is what it reports."""
    seen: set[int] = set()
    cause = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, shutdown.Terminated):
            return cause
        seen.add(id(cause))
        cause = cause.__context__
    return exc


def _wait_for_a_stop_signal(exc: BaseException | None) -> BaseException | None:
    """A neighbour that left mid-run was most often stopped by the launcher's SIGTERM,
    which reaches every worker at about the same time: its goodbye can beat the signal
    here. Give the signal a moment, so a stopped run ends as stopped (143), not as this
    worker failing (1)."""
    from hopnet.errors import PeerFailure

    if not isinstance(exc, PeerFailure) or exc.peer_state != "departed":
        return exc
    try:
        time.sleep(SIGNAL_GRACE_S)
    except shutdown.Terminated as stopped:
        return stopped
    return exc


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _on_sigterm)
    parent_watch.start()
    args = list(sys.argv[1:] if argv is None else argv)
    title_launched_worker(args, os.environ)
    exc: BaseException | None = None
    try:
        exc = _wait_for_a_stop_signal(_stop_underneath(run(args)))
        if exc is not None:
            _report(exc)
        had_workers = bool(shutdown.open_workers())
        code = shutdown.finish(exc, _exit_code(exc))
        if code != 0 and not had_workers:
            _record_without_worker(exc, code)
    except shutdown.Terminated as late:  # SIGTERM while reporting or closing
        code, exc = late.exit_code, late
    if isinstance(exc, shutdown.Terminated):
        _exit_now(code)
    flush_stdio()
    return code


def _exit_now(code: int) -> NoReturn:
    """Asked to stop: run the atexit handlers, then skip the interpreter's teardown.

    The workers are closed and their logs flushed by now; tearing down torch's modules
    can take seconds on a busy machine, and a worker whose launcher died must be gone
    within a few (the default action of SIGTERM would not even run the atexit handlers).
    """
    exit_now(code, join_threads=False)


def leave(code: int) -> NoReturn:
    """End the process as the interpreter would, without tearing its modules down
    (:mod:`hopnet.bootstrap.quick_exit`; a forked worker ends the same way, see
    :mod:`hopnet.bootstrap.forkserver`). The script's module-level objects are released when it
    returns (so a file it left open there is flushed then); what it left open elsewhere is not
    flushed, as with ``os._exit``: close what you write."""
    exit_now(code)


if __name__ == "__main__":
    leave(main())

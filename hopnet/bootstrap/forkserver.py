"""The fork server: a process that has imported torch once and forks the launch's workers.

Starting a worker with ``exec`` costs every process the same imports: torch (about 1.2 CPU-s)
and, at its first optimizer, ``torch._dynamo`` (about 1.3 CPU-s more). On a machine with
fewer cores than workers, a launch spends most of its start-up there. With the
``forkserver`` start method (the default where Linux's ``pidfd_open`` exists) the launcher
starts one *fork server* first::

    python -m hopnet.bootstrap.forkserver FD

which imports torch, ``torch._dynamo`` and hopnet once, then forks one worker per request
that arrives on the Unix socket ``FD``; the protocol's coordinator (:data:`COORDINATOR`) and
the run's c10d store (:data:`STORE`) are forked from it too. The forked worker is what an exec'd one would be:

* its own session and process group (the launcher signals the group);
* the environment of the request (``os.environ``; torch's thread count is set from
  ``OMP_NUM_THREADS``, which torch read when the fork server imported it);
* stdin from ``/dev/null``, stdout and stderr on the pipes the request carries
  (``SCM_RIGHTS``), or the fork server's own;
* :mod:`hopnet.bootstrap.worker_main` runs the script (:mod:`hopnet.bootstrap.coordinator_main`
  the coordinator), and the process exits the normal way (atexit handlers, threads
  joined) with the script's status.

The fork server reports each worker's pid, and later its exit status, on the same socket
(:class:`hopnet.launch.forkserver.ForkServer` is the launcher's side). It keeps no thread of
its own, so a fork never copies a lock held by another thread. When the launcher goes away
(the socket reaches end-of-file, even when the launcher was killed with SIGKILL) the fork
server ends its workers' process groups: SIGTERM and SIGCONT (a stopped worker could not act
on SIGTERM alone, nor on the parent-death signal), then SIGKILL after
:data:`~hopnet.bootstrap.parent_watch.BACKSTOP_S`.

This module is the fork server process's own code, and the part of every worker's life
before its script starts (the forked child leaves :func:`serve` as the worker), so it lives
in the bootstrap; the launcher's handle on it is :mod:`hopnet.launch.forkserver`.

``/proc/PID/environ`` of a forked worker shows the fork server's: the launcher records each
worker's pid in ``launch.json`` (``worker_pids``).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import pkgutil
import select
import selectors
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from typing import NoReturn

import msgpack

from hopnet.bootstrap import parent_watch
from hopnet.bootstrap.env import RUN_DIR
from hopnet.bootstrap.preload import preload_named
from hopnet.bootstrap.quick_exit import exit_now
from hopnet.bootstrap.title import fork_server_title, set_title

MAX_MESSAGE = 1 << 20
"""The largest request (an environment and an argv) the fork server accepts."""
WORKER = "worker"
COORDINATOR = "coordinator"
STORE = "store"
ENTRIES = {WORKER: "hopnet.bootstrap.worker_main", COORDINATOR: "hopnet.bootstrap.coordinator_main",
           STORE: "hopnet.bootstrap.store_main"}
"""What a forked process runs: the ``main(argv)`` of the module its request's ``entry`` names."""
PRELOAD = ("torch", "torch._dynamo", "setproctitle", "hopnet", "hopnet.api", *ENTRIES.values())
SERVER_ENV = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
"""The fork server must never initialise CUDA (a forked child could not use it): should an
import ask ``torch.cuda.is_available()``, torch answers through NVML instead. The workers
get their own environment, without it."""


class ForkServerGone(Exception):
    """The fork server did not answer: start workers with exec instead."""


class _Forked(Exception):
    """Raised in a freshly forked worker to leave the server's loop: carries what to run."""

    def __init__(self, entry: str, argv: list[str]) -> None:
        super().__init__("forked")
        self.entry = entry
        self.argv = argv


def _preload() -> None:
    for name in PRELOAD:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - a missing extra only makes that worker import it itself
            pass
    _preload_protocols()
    # What the workers inherit is never collected: the collector of a worker then does not
    # walk (and so copy) the fork server's pages.
    gc.freeze()


def _preload_protocols() -> None:
    """Every built-in protocol's modules, what the registry reads plugins' entry points with, and
    uvloop: a worker would import them in ``hopnet.init``. (Plugins are still found, and fail to
    import, in the worker.)"""
    import hopnet.protocols

    for module in pkgutil.walk_packages(hopnet.protocols.__path__, hopnet.protocols.__name__ + "."):
        with contextlib.suppress(Exception):
            importlib.import_module(module.name)
    for name in ("importlib.metadata", "uvloop"):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def _exit_worker(code: int) -> NoReturn:
    """End a forked worker as the interpreter would, without tearing its modules down: that
    would write to every inherited object and copy the fork server's whole heap."""
    exit_now(code)


def _become_worker(request: Mapping[str, object], fds: list[int], parent_pid: int) -> list[str]:
    """In the forked child: take the request's session, streams and environment."""
    os.setsid()
    # What a fresh interpreter has (SIGPIPE stays ignored, as Python sets it at start-up).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if request.get("piped"):
        out, err = fds
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in fds:
            os.close(fd)
    env = {str(k): str(v) for k, v in dict(request["env"]).items()}  # type: ignore[call-overload]
    env[parent_watch.LAUNCHER_PID] = str(parent_pid)  # the parent that the death signal watches
    os.environ.clear()
    os.environ.update(env)
    os.chdir(str(request["cwd"]))
    set_torch_threads(env)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # the fork server's global numpy state is not the worker's
    return [str(a) for a in request["argv"]]  # type: ignore[attr-defined]


def set_torch_threads(env: Mapping[str, str]) -> None:
    """torch's intra-op thread count from ``env``'s ``OMP_NUM_THREADS``: torch read the variable only
    when it was imported, in the fork server or in the template it was forked from."""
    threads = env.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _end_children(children: dict[int, int], backstop_s: float = parent_watch.BACKSTOP_S) -> None:
    """The launcher is gone (or done): so are its workers, stopped ones too. SIGTERM starts a
    worker's orderly close, SIGCONT lets a stopped one act on it, SIGKILL ends what is left
    after ``backstop_s``."""
    for pid in children.values():
        for sig in (signal.SIGTERM, signal.SIGCONT):
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + backstop_s
    while children and time.monotonic() < deadline:
        ready, _, _ = select.select(list(children), [], [], max(0.0, deadline - time.monotonic()))
        for pidfd in ready:
            os.waitpid(children.pop(pidfd), 0)
            os.close(pidfd)
    for pidfd, pid in children.items():
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        os.waitpid(pid, 0)
        os.close(pidfd)
    children.clear()


def serve(sock: socket.socket) -> None:
    """Fork a worker per request until the launcher closes ``sock``. Raises :class:`_Forked` in
    each child."""
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    children: dict[int, int] = {}  # pidfd -> pid
    packer = msgpack.Packer()
    while True:
        for key, _ in selector.select():
            if key.fileobj is sock:
                try:
                    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 2)
                except OSError:
                    data, fds = b"", []
                if not data:
                    _end_children(children)  # the launcher is gone or done
                    return
                request = msgpack.unpackb(data)
                try:
                    pid = os.fork()
                except OSError as exc:
                    for fd in fds:
                        os.close(fd)
                    sock.send(packer.pack({"op": "error", "rank": request["rank"], "message": str(exc)}))
                    continue
                if pid == 0:
                    for fd in children:
                        os.close(fd)
                    selector.close()
                    parent = os.getppid()
                    sock.close()
                    argv = _become_worker(request, fds, parent)
                    raise _Forked(str(request.get("entry", WORKER)), argv)
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                children[pidfd] = pid
                selector.register(pidfd, selectors.EVENT_READ)
                sock.send(packer.pack({"op": "started", "rank": request["rank"], "pid": pid}))
            else:
                pidfd = int(key.fd)
                pid = children.pop(pidfd)
                selector.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                try:
                    sock.send(packer.pack({"op": "exit", "pid": pid, "code": os.waitstatus_to_exitcode(status)}))
                except OSError:
                    _end_children(children)
                    return


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -m hopnet.bootstrap.forkserver FD", file=sys.stderr)
        return 2
    # No parent-death signal: when the launcher dies its socket reaches end-of-file at once,
    # and the fork server outlives it just long enough to end its workers (_end_children).
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides; it signals workers itself
    sock = socket.socket(fileno=int(args[0]))
    _preload()
    return run_server(sock)


def run_server(sock: socket.socket) -> NoReturn:
    """Serve the launcher on ``sock``; in each forked child, run its entry and exit; exit once the
    launcher closes ``sock``."""
    set_title(fork_server_title(os.environ.get(RUN_DIR, "").strip() or None))
    preload_named(os.environ)  # the script's frameworks (what a template did not import already)
    forked: _Forked | None = None
    try:
        serve(sock)
    except _Forked as child:
        forked = child
    if forked is None:
        # The launcher waits for this exit: skip tearing torch's modules down (most of a second
        # on a busy machine); the children are ended and there is nothing to flush but stdio.
        _exit_worker(0)
    # Outside the except block, so an exception the worker raises is not chained to _Forked
    # (its traceback would open with the fork server's frames).
    code = 1
    try:
        code = importlib.import_module(ENTRIES[forked.entry]).main(forked.argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        _exit_worker(code)


if __name__ == "__main__":
    sys.exit(main())

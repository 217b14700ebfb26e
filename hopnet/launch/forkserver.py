"""Workers forked from a process that has already imported torch.

Starting a worker with ``exec`` costs every process the same imports: torch (about 1.2 CPU-s)
and, at its first optimizer, ``torch._dynamo`` (about 1.3 CPU-s more). On a machine with
fewer cores than workers, a launch spends most of its start-up there. With the
``forkserver`` start method (the default where Linux's ``pidfd_open`` exists) the launcher
starts one *fork server* first::

    python -m hopnet.launch.forkserver FD

which imports torch, ``torch._dynamo`` and hopnet once, then forks one worker per request
that arrives on the Unix socket ``FD``; the protocol's coordinator is forked from it too
(:data:`COORDINATOR`). The forked worker is what an exec'd one would be:

* its own session and process group (the launcher signals the group);
* the environment of the request (``os.environ``; torch's thread count is set from
  ``OMP_NUM_THREADS``, which torch read when the fork server imported it);
* stdin from ``/dev/null``, stdout and stderr on the pipes the request carries
  (``SCM_RIGHTS``), or the fork server's own;
* :mod:`hopnet.launch.worker_main` runs the script (:mod:`hopnet.launch.coordinator_main`
  the coordinator), and the process exits the normal way (atexit handlers, threads
  joined) with the script's status.

The fork server reports each worker's pid, and later its exit status, on the same socket
(:class:`ForkServer` is the launcher's side). It keeps no thread of its own, so a fork
never copies a lock held by another thread. When the launcher goes away (the socket
reaches end-of-file, even when the launcher was killed with SIGKILL) the fork server
ends its workers' process groups: SIGTERM and SIGCONT (a stopped worker could not act on
SIGTERM alone, nor on the parent-death signal), then SIGKILL after
:data:`~hopnet.launch.parent_watch.BACKSTOP_S`.

``/proc/PID/environ`` and ``/proc/PID/cmdline`` of a forked worker show the fork server's:
the launcher records each worker's pid in ``launch.json`` (``worker_pids``).
"""

from __future__ import annotations

import gc
import importlib
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, NoReturn

import msgpack

from hopnet.launch import parent_watch
from hopnet.launch.pythonpath import worker_pythonpath
from hopnet.launch.quick_exit import exit_now

MAX_MESSAGE = 1 << 20
"""The largest request (an environment and an argv) the fork server accepts."""
READY_TIMEOUT_S = 120.0
"""How long the launcher waits for the fork server to answer a request before starting
that worker, and the rest, with ``exec``."""
WORKER = "worker"
COORDINATOR = "coordinator"
ENTRIES = {WORKER: "hopnet.launch.worker_main", COORDINATOR: "hopnet.launch.coordinator_main"}
"""What a forked process runs: the ``main(argv)`` of the module its request's ``entry`` names."""
PRELOAD = ("torch", "torch._dynamo", "hopnet", "hopnet.api", *ENTRIES.values())
TEMPLATE_VAR = "HOPNET_FORKSERVER_TEMPLATE"
"""The socket of a warm template (:mod:`hopnet.launch.forkserver_template`): a launcher with it
in its environment asks the template for its fork server, and starts one itself only if that fails."""
TEMPLATE_TIMEOUT_S = 10.0
"""How long a launcher waits for the template's answer."""
SERVER_ENV = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
"""The fork server must never initialise CUDA (a forked child could not use it): should an
import ask ``torch.cuda.is_available()``, torch answers through NVML instead. The workers
get their own environment, without it."""


def available() -> bool:
    """Whether this platform can run a fork server (Linux: fork, pidfd_open, SCM_RIGHTS)."""
    return sys.platform.startswith("linux") and hasattr(os, "pidfd_open") and hasattr(socket, "send_fds")


# --------------------------------------------------------------------------- the server
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
    # What the workers inherit is never collected: the collector of a worker then does not
    # walk (and so copy) the fork server's pages.
    gc.freeze()


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
        print("usage: python -m hopnet.launch.forkserver FD", file=sys.stderr)
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


# --------------------------------------------------------------------------- the launcher's side
class ForkedWorker:
    """A worker the fork server started: what the launcher uses of a :class:`subprocess.Popen`."""

    def __init__(self, pid: int, stdout: IO[bytes] | None, stderr: IO[bytes] | None) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


class ForkServerGone(Exception):
    """The fork server did not answer: start workers with exec instead."""


class ForkServer:
    """The launcher's handle on its fork server (one per launch)."""

    def __init__(self, env: Mapping[str, str], pass_fds: Sequence[int] = ()) -> None:
        server_env = {**env, **SERVER_ENV}
        template = env.get(TEMPLATE_VAR)
        started = _from_template(template, pass_fds, server_env) if template else None
        if started is not None:
            self.proc: subprocess.Popen[bytes] | TemplateForked = started[0]
            ours = started[1]
        else:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "hopnet.launch.forkserver", str(theirs.fileno())],
                    env=server_env, pass_fds=(theirs.fileno(), *pass_fds), stdin=subprocess.DEVNULL,
                    start_new_session=True)
            finally:
                theirs.close()
        self.sock = ours
        self._lock = threading.Condition()
        self._started: dict[int, dict[str, object]] = {}
        self._workers: dict[int, ForkedWorker] = {}
        self._early_exits: dict[int, int] = {}
        self._gone = False
        self._reader = threading.Thread(target=self._read, name="hopnet-forkserver", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        unpacker_error = (ValueError, msgpack.UnpackException)
        while True:
            try:
                data = self.sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            try:
                message = msgpack.unpackb(data)
            except unpacker_error:
                continue
            with self._lock:
                if message.get("op") == "exit":
                    worker = self._workers.get(message["pid"])
                    if worker is None:
                        self._early_exits[message["pid"]] = message["code"]
                    else:
                        worker._exited(message["code"])
                else:
                    self._started[message["rank"]] = message
                    self._lock.notify_all()
        with self._lock:
            self._gone = True
            orphans = [w for w in self._workers.values() if w.returncode is None]
            self._lock.notify_all()
        for worker in orphans:  # the fork server died under them: make sure they are gone too
            try:
                os.killpg(worker.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            worker._exited(-signal.SIGKILL)

    def spawn(self, rank: int, argv: Sequence[str], env: Mapping[str, str], piped: bool,
              entry: str = WORKER) -> ForkedWorker:
        """Fork the worker for ``rank`` (``argv``: what follows ``worker_main`` on its command line),
        or with ``entry`` :data:`COORDINATOR` the coordinator (``argv``: ``coordinator_main``'s;
        ``rank``: any number no worker of this fork server uses, such as -1).

        Raises :class:`ForkServerGone` when the fork server cannot (dead, or silent for
        :data:`READY_TIMEOUT_S`) and ``OSError`` when the fork itself failed."""
        read_ends: list[int] = []
        write_ends: list[int] = []
        if piped:
            for _ in range(2):
                r, w = os.pipe()
                read_ends.append(r)
                write_ends.append(w)
        if entry not in ENTRIES:
            raise ValueError(f"the fork server runs {sorted(ENTRIES)}, not {entry!r}")
        request = {"rank": rank, "entry": entry, "argv": list(argv), "env": dict(env), "cwd": os.getcwd(),
                   "piped": piped}
        try:
            with self._lock:
                if self._gone:
                    raise ForkServerGone("the fork server exited")
                try:
                    socket.send_fds(self.sock, [msgpack.packb(request)], write_ends)
                except OSError as exc:
                    raise ForkServerGone(f"the fork server is unreachable ({exc})") from exc
                answered = self._lock.wait_for(lambda: rank in self._started or self._gone, READY_TIMEOUT_S)
                if not answered or rank not in self._started:
                    raise ForkServerGone("the fork server did not answer")
                reply = self._started.pop(rank)
        except BaseException:
            for fd in read_ends:
                os.close(fd)
            raise
        finally:
            for fd in write_ends:
                os.close(fd)
        if reply.get("op") == "error":
            for fd in read_ends:
                os.close(fd)
            raise OSError(str(reply.get("message")))
        pid = int(reply["pid"])  # type: ignore[call-overload]
        streams = [open(fd, "rb") for fd in read_ends]
        worker = ForkedWorker(pid, *(streams if piped else (None, None)))
        with self._lock:
            self._workers[pid] = worker
            if pid in self._early_exits:
                worker._exited(self._early_exits.pop(pid))
        return worker

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the socket (the fork server exits on it) and wait for the fork server to end."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout_s)


# --------------------------------------------------------------------------- from a template
_NAMESPACES = ("net", "mnt", "pid", "user", "uts", "ipc", "cgroup")


def identity(env: Mapping[str, str]) -> dict[str, object]:
    """What a template and a launcher must share for a forked fork server to be the one the
    launcher would start: the interpreter, the ``PYTHONPATH`` that picks hopnet and torch, the
    user, and the namespaces (a launcher under `ip netns exec` must not get workers outside)."""
    namespaces = {}
    for name in _NAMESPACES:
        try:
            namespaces[name] = os.stat(f"/proc/self/ns/{name}").st_ino
        except OSError:
            namespaces[name] = 0
    return {"executable": sys.executable, "pythonpath": worker_pythonpath(env), "uid": os.getuid(),
            "gid": os.getgid(), "namespaces": namespaces}


class TemplateForked:
    """A fork server the template forked: what the launcher uses of a :class:`subprocess.Popen`.
    It is the template's child, not the launcher's, so its end is watched through a pidfd."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._pidfd = os.pidfd_open(pid)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._pidfd], [], [], 0)[0]:
            self._ended()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._pidfd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"fork server {self.pid}", timeout or 0.0)
            self._ended()
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _ended(self) -> None:
        self.returncode = 0  # its status goes to the template, which reaps it
        os.close(self._pidfd)


def _from_template(path: str, pass_fds: Sequence[int],
                   env: Mapping[str, str]) -> tuple[TemplateForked, socket.socket] | None:
    """Ask the template at ``path`` for a fork server: its handle and the launcher's end of its
    socket, or ``None`` when it gives none (gone, silent, another interpreter): the launcher then
    starts its own, on a new socket (a late answer finds this one closed and ends)."""
    request = {"identity": identity(env), "env": dict(env), "cwd": os.getcwd(), "pass_fds": list(pass_fds)}
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.settimeout(TEMPLATE_TIMEOUT_S)
            conn.connect(path)
            socket.send_fds(conn, [msgpack.packb(request)], [theirs.fileno(), null, 1, 2, *pass_fds])
            reply = msgpack.unpackb(conn.recv(MAX_MESSAGE))
        return TemplateForked(int(reply["pid"])), ours
    except (OSError, ValueError, KeyError, TypeError, msgpack.UnpackException):
        ours.close()
        return None
    finally:
        theirs.close()
        os.close(null)


if __name__ == "__main__":
    sys.exit(main())

"""The launcher's handle on its fork server (:mod:`hopnet.bootstrap.forkserver`).

:class:`ForkServer` starts the launch's fork server (or asks a warm template for one,
:mod:`hopnet.bootstrap.forkserver_template`), sends it one request per worker and reads back
each worker's pid and exit status; :class:`ForkedWorker` is what the launcher uses of a
:class:`subprocess.Popen` for a forked worker. This side runs in the launcher process; the
server's side (what the fork server and its freshly forked children run) is in the bootstrap.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO, TYPE_CHECKING

import msgpack

from hopnet.bootstrap.forkserver import COORDINATOR, ENTRIES, MAX_MESSAGE, SERVER_ENV, WORKER, ForkServerGone
from hopnet.bootstrap.forkserver_template import TEMPLATE_VAR, identity
from hopnet.bootstrap.preload import PRELOAD_VAR, frameworks_imported

if TYPE_CHECKING:
    from hopnet.launch.settings import LaunchSpec

__all__ = ["COORDINATOR", "WORKER", "ForkServer", "ForkServerGone", "ForkedWorker", "TEMPLATE_VAR", "TemplateForked",
           "available", "preload_env"]

READY_TIMEOUT_S = 120.0
"""How long the launcher waits for the fork server to answer a request before starting
that worker, and the rest, with ``exec``."""
TEMPLATE_TIMEOUT_S = 10.0
"""How long a launcher waits for the template's answer."""


def available() -> bool:
    """Whether this platform can run a fork server (Linux: fork, pidfd_open, SCM_RIGHTS)."""
    return sys.platform.startswith("linux") and hasattr(os, "pidfd_open") and hasattr(socket, "send_fds")


def preload_env(spec: LaunchSpec, env: Mapping[str, str]) -> dict[str, str]:
    """What the fork server imports for the workers besides torch and hopnet: ``env``'s
    :data:`~hopnet.bootstrap.preload.PRELOAD_VAR` where set, else the training frameworks the
    script imports (:func:`~hopnet.bootstrap.preload.frameworks_imported`)."""
    if PRELOAD_VAR in env or spec.module:
        return {}
    found = frameworks_imported(spec.script)
    return {PRELOAD_VAR: ",".join(found)} if found else {}


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
                    [sys.executable, "-m", "hopnet.bootstrap.forkserver", str(theirs.fileno())],
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
                try:  # forked but not yet in a session of its own: no group of that number yet
                    os.kill(worker.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            worker._exited(-signal.SIGKILL)

    def spawn(self, rank: int, argv: Sequence[str], env: Mapping[str, str], piped: bool,
              entry: str = WORKER, cwd: str | None = None) -> ForkedWorker:
        """Fork the worker for ``rank`` (``argv``: what follows ``worker_main`` on its command line),
        or with ``entry`` :data:`COORDINATOR` the coordinator (``argv``: ``coordinator_main``'s;
        ``rank``: any number no worker of this fork server uses, such as -1); ``cwd``: where it runs (by
        default this process's working directory).

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
        request = {"rank": rank, "entry": entry, "argv": list(argv), "env": dict(env), "cwd": cwd or os.getcwd(),
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

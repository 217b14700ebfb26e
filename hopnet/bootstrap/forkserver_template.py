"""A warm template that fork servers are forked from, for many launches on one machine.

Each launch's fork server (:mod:`hopnet.bootstrap.forkserver`) starts as a fresh interpreter and
imports torch, ``torch._dynamo`` and hopnet: about 2.5 CPU-s before its first worker. Where
one machine runs many short launches (a test suite, a sweep of small runs), that start-up is
most of a launch's CPU. A *template* is a process that did those imports once::

    python -m hopnet.bootstrap.forkserver_template PATH

It listens on the Unix socket ``PATH``. A launcher whose environment has
:data:`TEMPLATE_VAR` set to ``PATH`` asks it for its fork server instead of starting one:
the template forks a child that takes the launcher's socket, streams, inherited descriptors
(at the same numbers), environment and directory, and from then on is that launch's fork
server, as if started by the launcher (its own session; it ends with the launcher's socket).
The template serves only a launcher of the same interpreter and the same ``PYTHONPATH``
(what decides which hopnet and which torch the workers import), user, namespaces (a
launcher under ``ip netns exec`` needs workers in its network namespace) and control groups (a
launcher inside a job's cgroup needs its workers inside it); for any other,
and when the template does not answer, the launcher starts its fork server with ``exec``.

The template keeps no thread, like a fork server, so that a fork never copies a held lock.
It ends on SIGTERM or when the process that started it dies.

Like the fork server, the template runs in a process of its own whose children end up as
workers, so it lives in the bootstrap; the launcher's request for a fork server is
:class:`hopnet.launch.forkserver.ForkServer`'s.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import socket
import sys
from collections.abc import Mapping, Sequence

import msgpack

from hopnet.bootstrap import forkserver, parent_watch
from hopnet.bootstrap.preload import preload_named
from hopnet.bootstrap.pythonpath import worker_pythonpath
from hopnet.bootstrap.title import TEMPLATE_TITLE, set_title

_MAX_FDS = 16
TEMPLATE_VAR = "HOPNET_FORKSERVER_TEMPLATE"
"""The socket of a warm template: a launcher with it in its environment asks the template for
its fork server, and starts one itself only if that fails."""


# --------------------------------------------------------------------------- who may be served
_NAMESPACES = ("net", "mnt", "pid", "user", "uts", "ipc", "cgroup")


def identity(env: Mapping[str, str]) -> dict[str, object]:
    """What a template and a launcher must share for a forked fork server to be the one the
    launcher would start: the interpreter, the ``PYTHONPATH`` that picks hopnet and torch, the
    user, the namespaces (a launcher under `ip netns exec` must not get workers outside) and the
    control groups (a launcher in a job's cgroup must not get workers outside its limits and its
    accounting)."""
    namespaces = {}
    for name in _NAMESPACES:
        try:
            namespaces[name] = os.stat(f"/proc/self/ns/{name}").st_ino
        except OSError:
            namespaces[name] = 0
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as groups:
            cgroups = groups.read()
    except OSError:
        cgroups = ""
    return {"executable": sys.executable, "pythonpath": worker_pythonpath(env), "uid": os.getuid(),
            "gid": os.getgid(), "namespaces": namespaces, "cgroups": cgroups}


# --------------------------------------------------------------------------- the template
def _place_fds(fds: Sequence[int], numbers: Sequence[int]) -> list[int]:
    """Put ``fds[i]`` at ``numbers[i]`` (inheritable), whatever the overlap between them; the
    fds beyond ``numbers`` are moved out of their way. Returns where each fd ended up."""
    above = max([*fds, *numbers]) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, above) for fd in fds]
    for fd in fds:
        os.close(fd)
    for fd, number in zip(moved, numbers):
        os.dup2(fd, number, inheritable=True)
        os.close(fd)
    return [*numbers, *moved[len(numbers):]]


def _become_fork_server(request: Mapping[str, object], fds: list[int],
                        conn: socket.socket) -> tuple[socket.socket, socket.socket]:
    """In the forked child: the launcher's session, streams, descriptors, environment and
    directory. Returns the fork server's socket and ``conn``, both moved out of the way."""
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as forkserver.main: the launcher decides
    sock_fd, *streams_and_inherited = fds
    inherited = [int(n) for n in request["pass_fds"]]  # type: ignore[attr-defined]
    placed = _place_fds([*streams_and_inherited, sock_fd, conn.detach()], [0, 1, 2, *inherited])
    env = {str(k): str(v) for k, v in dict(request["env"]).items()}  # type: ignore[call-overload]
    os.environ.clear()
    os.environ.update(env)
    forkserver.set_torch_threads(env)  # the launcher's, not the template's (torch read it at import)
    cwd = str(request["cwd"])
    os.chdir(cwd)
    if sys.path and sys.path[0] == _TEMPLATE_CWD:  # `python -m` puts its directory first
        sys.path[0] = cwd
    return socket.socket(fileno=placed[-2]), socket.socket(fileno=placed[-1])


_TEMPLATE_CWD = os.getcwd()


def _answer(conn: socket.socket, listener: socket.socket, children: set[int]) -> socket.socket | None:
    """Serve one launcher's request; in the forked child, the launcher's fork-server socket."""
    try:
        data, fds, _flags, _addr = socket.recv_fds(conn, forkserver.MAX_MESSAGE, _MAX_FDS)
        request = msgpack.unpackb(data)
    except (OSError, ValueError, msgpack.UnpackException):
        return None
    try:
        if isinstance(request, dict) and request.get("identity") == identity(os.environ):
            pid = os.fork()
            if pid == 0:
                return _child(request, fds, conn, listener)  # it took the descriptors
            children.add(pid)
        else:
            conn.send(msgpack.packb({"error": "another interpreter, PYTHONPATH, user, namespace or cgroup"}))
    except OSError:
        pass
    for fd in fds:
        os.close(fd)
    return None


def _child(request: dict[str, object], fds: list[int], conn: socket.socket, listener: socket.socket) -> socket.socket:
    """The forked child becomes the launcher's fork server, or exits: never a second template."""
    try:
        listener.close()  # before any descriptor is placed where it was
        server_sock, moved_conn = _become_fork_server(request, fds, conn)
        with moved_conn:  # answered once it is what the launcher's own would be
            moved_conn.send(msgpack.packb({"pid": os.getpid()}))
        return server_sock
    except BaseException:  # noqa: BLE001 - the launcher sees end-of-file and starts its own
        os._exit(1)


def _reap(children: set[int]) -> None:
    for pid in list(children):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)


def serve_template(path: str) -> socket.socket:
    """Answer launchers on ``path`` until SIGTERM; in each forked child, return its socket."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    children: set[int] = set()
    template = os.getpid()
    try:
        while True:
            ready, _, _ = select.select([listener], [], [], 1.0)
            _reap(children)
            if not ready:
                continue
            conn, _ = listener.accept()
            server_sock = _answer(conn, listener, children)
            if server_sock is not None:  # the child: leave the template's loop
                return server_sock
            conn.close()
    finally:
        if os.getpid() == template:
            listener.close()
            try:
                os.unlink(path)
            except OSError:
                pass


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m hopnet.bootstrap.forkserver_template PATH", file=sys.stderr)
        return 2
    parent_watch.arm_parent_death_signal(signal.SIGTERM)
    set_title(TEMPLATE_TITLE)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    forkserver._preload()
    preload_named(os.environ)
    sock = serve_template(args[0])
    return forkserver.run_server(sock)  # a fork server from here on


if __name__ == "__main__":
    sys.exit(main())

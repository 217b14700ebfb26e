"""A helper process that a launch starts beside its workers: the protocol's coordinator
(:mod:`hopnet.bootstrap.coordinator_proc`) or the run's c10d store (:mod:`hopnet.launch.run_store`).

Given the launch's fork server (:mod:`hopnet.launch.forkserver`), it is forked from there
(without importing torch again, about 1.3 CPU-s); otherwise it is exec'd. Either way it runs in
a session of its own (a Ctrl-C on the terminal reaches the launcher only), holds the launcher
watch's pipe so that it never outlives the launcher, and prints ``PREFIX VALUE`` (an address)
as its first line, which :meth:`ServiceProcess.launch` waits for. Its stderr, and its stdout
after that line, are relayed with a ``[what] `` prefix. A fork server that does not answer
leaves it exec'd (:attr:`ServiceProcess.forkserver_failure` says why)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Protocol

from hopnet.bootstrap.forkserver import ForkServerGone
from hopnet.errors import HopnetError

START_TIMEOUT_S = 60.0
"""Longest a service may take to print its address (imports on a loaded machine)."""


class ProcessHandle(Protocol):
    """What is used of a service's process: a :class:`subprocess.Popen`, or a forked one."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    @property
    def stdout(self) -> IO[bytes] | None: ...

    @property
    def stderr(self) -> IO[bytes] | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class Forker(Protocol):
    """What forks a service: the launch's fork server (:class:`hopnet.launch.forkserver.ForkServer`).
    ``spawn`` raises :class:`~hopnet.bootstrap.forkserver.ForkServerGone` when it cannot."""

    def spawn(self, rank: int, argv: Sequence[str], env: Mapping[str, str], piped: bool,
              entry: str = ...) -> ProcessHandle: ...


class ServiceStartError(HopnetError):
    """A service process did not come up."""


class ServiceProcess:
    """A running service process and the value of its first line."""

    def __init__(self, proc: ProcessHandle, value: str, forkserver_failure: str | None = None,
                 forked: bool = False) -> None:
        self.proc = proc
        self.value = value
        self.forked = forked
        """Whether the fork server forked it (else it was exec'd)."""
        self.forkserver_failure = forkserver_failure
        """Why it was exec'd although a fork server was given (``None``: it was not, or forked)."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    def launch(cls, what: str, *, tag: str, entry: str, module: str, fork_key: int, args: Sequence[str],
               prefix: str, env: Mapping[str, str], pass_fds: Sequence[int], relay: Callable[[bytes], None] | None,
               timeout_s: float = START_TIMEOUT_S, forkserver: Forker | None = None) -> ServiceProcess:
        """Start ``module`` (``entry`` at the fork server, under request number ``fork_key``) with
        ``args`` and wait for its line ``prefix VALUE``. ``what`` names it in errors (``the
        coordinator (...)``), ``tag`` in relayed lines. ``forkserver``: fork it from there (it
        must have been started with ``pass_fds`` too, which a forked process inherits at the same
        numbers)."""
        proc: ProcessHandle | None = None
        forkserver_failure: str | None = None
        if forkserver is not None:
            try:
                proc = forkserver.spawn(fork_key, args, env, piped=True, entry=entry)
            except ForkServerGone as exc:
                forkserver_failure = str(exc)
        if proc is None:
            proc = subprocess.Popen([sys.executable, "-m", module, *args], env=dict(env), pass_fds=tuple(pass_fds),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
        assert proc.stdout is not None and proc.stderr is not None
        label = f"[{tag}] ".encode()
        lines: queue.Queue[bytes] = queue.Queue()
        errors: list[bytes] = []
        _thread(tag, _pump_lines, proc.stdout, lines.put)

        def on_stderr(line: bytes) -> None:
            errors.append(line)
            if relay is not None:
                relay(label + line)
        _thread(tag, _pump_lines, proc.stderr, on_stderr)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = lines.get(timeout=0.1)
            except queue.Empty:
                if proc.poll() is not None or time.monotonic() >= deadline:
                    why = (f"exited with code {proc.returncode}" if proc.poll() is not None
                           else f"printed no address within {timeout_s:g}s")
                    _kill(proc)
                    detail = b"".join(errors).decode("utf-8", "replace").strip().splitlines()
                    raise ServiceStartError(f"{what} did not start: {why}" + (f": {detail[-1]}" if detail else ""))
                continue
            text = line.decode("utf-8", "replace").strip()
            if text.startswith(prefix):
                value = text[len(prefix):]
                break
        if relay is not None:
            _thread(tag, _drain_queue, lines, proc, lambda line: relay(label + line))
        return cls(proc, value, forkserver_failure, forked=forkserver is not None and forkserver_failure is None)

    def exited(self) -> int | None:
        return self.proc.poll()

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM (it ends cleanly), then SIGKILL after ``grace_s``; its exit status."""
        if self.proc.poll() is None:
            _signal(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        _kill(self.proc)
        return self.proc.returncode


def _thread(tag: str, target: Callable[..., None], *args: object) -> None:
    threading.Thread(target=target, args=args, name=f"hopnet-{tag}-io", daemon=True).start()


def _pump_lines(pipe: IO[bytes], sink: Callable[[bytes], None]) -> None:
    try:
        for line in iter(pipe.readline, b""):
            sink(line if line.endswith(b"\n") else line + b"\n")
    except (OSError, ValueError):
        pass


def _drain_queue(lines: queue.Queue[bytes], proc: ProcessHandle, relay: Callable[[bytes], None]) -> None:
    while True:
        try:
            relay(lines.get(timeout=0.5))
        except queue.Empty:
            if proc.poll() is not None and lines.empty():
                return


def _signal(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _kill(proc: ProcessHandle) -> None:
    _signal(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=10.0)
    except subprocess.TimeoutExpired:
        pass

"""The coordinator process of a launch (group protocols): start it, watch it, stop it.

`hopnet launch` starts ``python -m hopnet.bootstrap.coordinator_main`` before the workers when
:func:`hopnet.coordinator.make_coordinator` says the protocol needs one, reads the address
it prints first, and hands it to the workers in ``HOPNET_COORDINATOR`` (with its name in
``HOPNET_COORDINATOR_NAME``, for their error messages). The process runs in a session of
its own (a Ctrl-C on the terminal reaches the launcher only) and holds the launcher
watch's pipe, so it never outlives the launcher. Its stderr is relayed as
``[coordinator] ...`` lines. If it exits while workers still run, the launch fails with a
line naming it; at the end of the run it gets SIGTERM and writes its summary.

Given the launch's fork server (:mod:`hopnet.launch.forkserver`), the coordinator is forked
from it instead of exec'd: same argv, environment, working directory, inherited launcher
watch and pipes, without importing torch again (about 1.3 CPU-s). Its parent is then the
fork server, which ends it with the workers when the launcher dies. A fork server that
does not answer leaves it exec'd (:attr:`CoordinatorProcess.forkserver_failure` says why).

Under torchrun or srun there is no launcher of hopnet's own: rank 0's worker starts the
coordinator (:mod:`hopnet.bootstrap.init`), so this module runs in a worker as well as in the
launcher, and lives in the bootstrap; the fork server is named here only by what is used of
it (:class:`Forker`).
"""

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

from hopnet.coordinator.client import COORDINATOR_ENV, COORDINATOR_NAME_ENV
from hopnet.coordinator.server import ADDRESS_PREFIX
from hopnet.errors import HopnetError
from hopnet.bootstrap.forkserver import COORDINATOR, ForkServerGone

START_TIMEOUT_S = 60.0
"""Longest the coordinator may take to print its address (imports on a loaded machine)."""
ENTRY = ("-m", "hopnet.bootstrap.coordinator_main")
FORK_KEY = -1
"""The coordinator's request number at the fork server (workers use their ranks)."""



class ProcessHandle(Protocol):
    """What is used of the coordinator's process: a :class:`subprocess.Popen`, or a forked one."""

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
    """What forks the coordinator: the launch's fork server (:class:`hopnet.launch.forkserver.ForkServer`).
    ``spawn`` raises :class:`~hopnet.bootstrap.forkserver.ForkServerGone` when it cannot."""

    def spawn(self, rank: int, argv: Sequence[str], env: Mapping[str, str], piped: bool,
              entry: str = ...) -> ProcessHandle: ...


class CoordinatorStartError(HopnetError):
    """The coordinator process did not come up."""


class CoordinatorProcess:
    """A running ``python -m hopnet.bootstrap.coordinator_main``."""

    def __init__(self, proc: ProcessHandle, name: str, address: str, forkserver_failure: str | None = None,
                 forked: bool = False) -> None:
        self.proc = proc
        self.name = name
        self.address = address
        self.forked = forked
        """Whether the fork server forked it (else it was exec'd)."""
        self.forkserver_failure = forkserver_failure
        """Why it was exec'd although a fork server was given (``None``: it was not, or forked)."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def label(self) -> str:
        return f"the coordinator ({self.name}) at {self.address}"

    @classmethod
    def start(cls, name: str, *, graph_path: str, config_json: str, run_dir: str, bind_host: str,
              env: Mapping[str, str], pass_fds: Sequence[int], relay: Callable[[bytes], None] | None,
              timeout_s: float = START_TIMEOUT_S, forkserver: Forker | None = None) -> CoordinatorProcess:
        """Start it and wait for its address. ``forkserver``: fork it from there (it must have been
        started with ``pass_fds`` too, which a forked process inherits at the same numbers)."""
        args = ["--graph", graph_path, "--config", config_json, "--run-dir", run_dir, "--bind", bind_host]
        proc: ProcessHandle | None = None
        forkserver_failure: str | None = None
        if forkserver is not None:
            try:
                proc = forkserver.spawn(FORK_KEY, args, env, piped=True, entry=COORDINATOR)
            except ForkServerGone as exc:
                forkserver_failure = str(exc)
        if proc is None:
            proc = subprocess.Popen([sys.executable, *ENTRY, *args], env=dict(env), pass_fds=tuple(pass_fds),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
        assert proc.stdout is not None and proc.stderr is not None
        lines: queue.Queue[bytes] = queue.Queue()
        errors: list[bytes] = []
        _thread(_pump_lines, proc.stdout, lines.put)

        def on_stderr(line: bytes) -> None:
            errors.append(line)
            if relay is not None:
                relay(b"[coordinator] " + line)
        _thread(_pump_lines, proc.stderr, on_stderr)
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
                    raise CoordinatorStartError(f"the coordinator ({name}) did not start: {why}"
                                                + (f": {detail[-1]}" if detail else ""))
                continue
            text = line.decode("utf-8", "replace").strip()
            if text.startswith(ADDRESS_PREFIX):
                address = text[len(ADDRESS_PREFIX):]
                break
        if relay is not None:
            _thread(_drain_queue, lines, proc, relay)
        return cls(proc, name, address, forkserver_failure, forked=forkserver is not None and forkserver_failure is None)

    def worker_env(self) -> dict[str, str]:
        return {COORDINATOR_ENV: self.address, COORDINATOR_NAME_ENV: self.name}

    def exited(self) -> int | None:
        return self.proc.poll()

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM (it writes its summary), then SIGKILL after ``grace_s``; its exit status."""
        if self.proc.poll() is None:
            _signal(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        _kill(self.proc)
        return self.proc.returncode


def _thread(target: Callable[..., None], *args: object) -> None:
    threading.Thread(target=target, args=args, name="hopnet-coordinator-io", daemon=True).start()


def _pump_lines(pipe: IO[bytes], sink: Callable[[bytes], None]) -> None:
    try:
        for line in iter(pipe.readline, b""):
            sink(line if line.endswith(b"\n") else line + b"\n")
    except (OSError, ValueError):
        pass


def _drain_queue(lines: queue.Queue[bytes], proc: ProcessHandle, relay: Callable[[bytes], None]) -> None:
    while True:
        try:
            relay(b"[coordinator] " + lines.get(timeout=0.5))
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

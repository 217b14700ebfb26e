"""The launcher's worker processes: spawning, relaying their output, signalling, reaping.

Each worker runs in a session of its own (its own process group), so a Ctrl-C on the
terminal reaches the launcher only; :class:`SignalTrap` turns the launcher's SIGINT,
SIGTERM and SIGHUP into a list the monitor reads, and the launcher forwards what it
decides to each worker's process group.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Sequence
from types import FrameType
from typing import IO, Any, Protocol, TypeAlias

from hopnet.launch.forkserver import ForkedWorker, ForkServer, ForkServerGone

POLL_S = 0.05
"""How long one wait for a worker's exit lasts, so the monitor also sees signals and aborts."""


class TextSink(Protocol):
    """Where the launcher writes text: a stream, or the live view's console stream."""

    def write(self, text: str, /) -> int: ...

    def flush(self) -> None: ...


class LineWriter:
    """Writes whole lines to a stream under a lock, flushing each one; bytes pass through
    the stream's ``buffer`` when it has one."""

    def __init__(self, stream: TextSink) -> None:
        self.stream = stream
        self.lock = threading.Lock()
        self.muted = False

    def write(self, data: bytes) -> None:
        with self.lock:
            if self.muted:
                return
            try:
                buffer: IO[bytes] | None = getattr(self.stream, "buffer", None)
                if buffer is not None:
                    self.stream.flush()
                    buffer.write(data)
                    buffer.flush()
                else:
                    self.stream.write(data.decode("utf-8", errors="replace"))
                    self.stream.flush()
            except (BrokenPipeError, ValueError, OSError):
                pass  # our own output is gone (closed pipe): keep draining the worker


def pump_lines(pipe: IO[bytes], prefix: bytes, out: LineWriter) -> None:
    """Copy ``pipe`` to ``out`` line by line with ``prefix`` until EOF."""
    try:
        for line in iter(pipe.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            out.write(prefix + line)
    except (OSError, ValueError):
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def kill_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


WorkerHandle: TypeAlias = "subprocess.Popen[bytes] | ForkedWorker"


class WorkerProcesses:
    """The worker processes of one launch, their output pumps and their waiters.

    Exits arrive on :attr:`exits` as ``(rank, returncode)`` from one waiter thread per worker.
    With a :class:`~hopnet.launch.forkserver.ForkServer`, workers whose command starts with
    ``fork_entry`` are forked from it; the others, and every worker once the fork server
    fails to answer, are started with exec.
    """

    def __init__(self, out: LineWriter | None, err: LineWriter | None, forkserver: ForkServer | None = None,
                 fork_entry: Sequence[str] = ()) -> None:
        self.procs: dict[int, WorkerHandle] = {}
        self.exits: queue.Queue[tuple[int, int]] = queue.Queue()
        self.out = out
        self.err = err
        self.threads: list[threading.Thread] = []
        self.forkserver = forkserver
        self.forking = forkserver is not None
        self.fork_entry = list(fork_entry)
        self.forkserver_failure: str | None = None
        """Why the fork server stopped being used, if it did."""
        self.exit_times: dict[int, float] = {}
        """When each rank's (latest) process was seen to exit (``time.monotonic()``)."""

    def spawn(self, rank: int, argv: list[str], env: dict[str, str], pass_fds: Sequence[int] = (),
              cwd: str | None = None) -> None:
        """Start ``argv`` for ``rank`` (in ``cwd``, by default this process's). ``pass_fds`` are inherited
        at the same numbers (the fork server was started with them)."""
        piped = self.out is not None and self.err is not None
        proc: WorkerHandle | None = None
        entry = len(self.fork_entry)
        if self.forking and self.forkserver is not None and entry and argv[:entry] == self.fork_entry:
            try:
                proc = self.forkserver.spawn(rank, argv[entry:], env, piped, cwd=cwd)
            except ForkServerGone as exc:
                self.stop_forking(str(exc))
        if proc is None:
            proc = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                pass_fds=tuple(pass_fds),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if piped else None,
                stderr=subprocess.PIPE if piped else None,
                start_new_session=True,  # own session and process group: we forward signals ourselves
            )
        self.procs[rank] = proc
        if self.out is not None and self.err is not None:
            prefix = f"[rank {rank}] ".encode()
            assert proc.stdout is not None and proc.stderr is not None
            for pipe, target in ((proc.stdout, self.out), (proc.stderr, self.err)):
                self._thread(pump_lines, (pipe, prefix, target), f"hopnet-pump-{rank}", keep=True)
        self._thread(self._wait, (rank, proc), f"hopnet-wait-{rank}", keep=False)

    def stop_forking(self, why: str) -> None:
        """Start every later worker with exec: the fork server failed to answer (``why``)."""
        self.forkserver_failure = why
        self.forking = False

    def _thread(self, target: Callable[..., None], args: tuple[Any, ...], name: str, *, keep: bool) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        if keep:
            self.threads.append(thread)

    def _wait(self, rank: int, proc: WorkerHandle) -> None:
        code = proc.wait()
        self.exit_times[rank] = time.monotonic()
        self.exits.put((rank, code))

    def next_exit(self, timeout_s: float = POLL_S) -> tuple[int, int] | None:
        """The next ``(rank, returncode)`` to arrive within ``timeout_s``, else ``None``."""
        try:
            return self.exits.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def mute(self) -> None:
        """Stop relaying the workers' output (it is still drained)."""
        for out in (self.out, self.err):
            if out is not None:
                out.muted = True

    def running(self) -> list[int]:
        return [r for r, p in self.procs.items() if p.returncode is None]

    def signal_all(self, signum: int, *, sparing: Collection[int] = ()) -> None:
        """Send ``signum`` to the process group of every worker still running, but those ``sparing``."""
        for rank, proc in self.procs.items():
            if proc.returncode is None and rank not in sparing:
                kill_group(proc.pid, signum)

    def reap(self, timeout_s: float = 10.0) -> dict[int, int | None]:
        """SIGKILL every worker still running, wait for each, and SIGKILL whatever is left in
        their process groups (orphaned children); every worker's exit status (``None``: unknown)."""
        for proc in self.procs.values():
            if proc.returncode is None:
                kill_group(proc.pid, signal.SIGKILL)
        codes: dict[int, int | None] = {}
        for rank, proc in self.procs.items():
            try:
                codes[rank] = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                codes[rank] = None
        for proc in self.procs.values():
            kill_group(proc.pid, signal.SIGKILL)
        return codes

    def close_forkserver(self) -> None:
        """Close the fork server, which ends what it forked and still runs: call it after
        :meth:`reap`, and after stopping anything else it forked (the coordinator)."""
        if self.forkserver is not None:
            self.forkserver.close()

    def drain(self, timeout_s: float) -> None:
        """Wait for the output pumps to reach EOF (bounded: a stray process may hold a pipe)."""
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))


class SignalTrap:
    """Turns SIGINT/SIGTERM/SIGHUP into a list while workers run (main thread only)."""

    SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)

    def __init__(self) -> None:
        self.received: list[int] = []
        self._old: dict[int, Any] = {}

    def __enter__(self) -> SignalTrap:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                try:
                    self._old[s] = signal.signal(s, self._handle)
                except (OSError, ValueError):
                    pass
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)  # list.append is atomic; no locks in a signal handler

    def __exit__(self, *exc: object) -> None:
        for s, old in self._old.items():
            try:
                signal.signal(s, old)
            except (OSError, ValueError):
                pass
        self._old.clear()

    @property
    def first(self) -> int | None:
        return self.received[0] if self.received else None


__all__ = ["LineWriter", "SignalTrap", "TextSink", "WorkerProcesses", "kill_group", "pump_lines", "signal_name"]

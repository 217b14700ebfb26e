"""Shared by bench/chaos.py and bench/dead_peers.py: one `hopnet launch` run with a fault
injected into one worker, observed from outside as a user would.

The launcher runs in a session of its own (so a hung run can be ended as a whole); its
stdout and stderr are read line by line on threads, each line stamped with the monotonic
clock on arrival. Worker pids come from ``RUN_DIR/launch.json`` (``worker_pids``), the
training progress from the ranks' event logs (``rank*.jsonl``, written in batches, so the
iterations they show lag the workers a little).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hopnet.launch.death_watch import process_state

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = (sys.executable, "-m", "hopnet.cli.main", "launch")
LAUNCHER_PREFIX = "hopnet launch: "

FAULTS = ("SIGKILL", "SIGSTOP", "SIGSTOP+CONT")
"""SIGKILL; SIGSTOP never continued; SIGSTOP then SIGCONT after ``CONT_AFTER_S``."""
CONT_AFTER_S = 3.0


def clean_env() -> dict[str, str]:
    """This environment without any launcher's or scheduler's variables, this checkout first
    on PYTHONPATH (so the workers import the hopnet under test)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HOPNET_", "SLURM_", "TORCHELASTIC_"))
           and k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"}}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env


@dataclass
class Line:
    t: float  # time.monotonic() when read
    stream: str  # "out" or "err"
    text: str


@dataclass
class LaunchRun:
    """A running ``hopnet launch``; :meth:`lines` is filled while it runs."""

    proc: subprocess.Popen[str]
    run_dir: Path
    started: float
    _lines: list[Line] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _readers: list[threading.Thread] = field(default_factory=list)

    @classmethod
    def start(cls, args: list[str], run_dir: Path, prefix: Sequence[str] = ()) -> LaunchRun:
        """``prefix``: what runs the launcher (``ip netns exec NS`` for an emulated host)."""
        proc = subprocess.Popen([*prefix, *LAUNCH, "--run-dir", str(run_dir), "--no-progress", *args], cwd=ROOT,
                                env=clean_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        run = cls(proc, run_dir, time.monotonic())
        for name, stream in (("out", proc.stdout), ("err", proc.stderr)):
            thread = threading.Thread(target=run._read, args=(name, stream), daemon=True)
            thread.start()
            run._readers.append(thread)
        return run

    def _read(self, name: str, stream: object) -> None:
        for text in stream:  # type: ignore[attr-defined]
            with self._lock:
                self._lines.append(Line(time.monotonic(), name, text.rstrip("\n")))

    def lines(self) -> list[Line]:
        with self._lock:
            return list(self._lines)

    def launcher_lines(self) -> list[Line]:
        """The launcher's own lines (``hopnet launch: ...``, on stderr)."""
        return [ln for ln in self.lines() if ln.stream == "err" and ln.text.startswith(LAUNCHER_PREFIX)]

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None if it is still running after ``timeout`` seconds."""
        try:
            code = self.proc.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return None
        for thread in self._readers:
            thread.join(timeout=5)
        return code

    def worker_pids(self, count: int, deadline: float) -> dict[int, int]:
        """The recorded pids, once ``count`` are listed; {} if the launcher exits or the deadline passes."""
        while time.monotonic() < deadline and self.proc.poll() is None:
            pids = recorded_pids(self.run_dir)
            if len(pids) >= count:
                return pids
            time.sleep(0.05)
        return recorded_pids(self.run_dir)

    def wait_training(self, deadline: float) -> bool:
        """Until some rank logged an iteration (False if the launcher exits or the deadline passes)."""
        while time.monotonic() < deadline and self.proc.poll() is None:
            if max_iteration(self.run_dir) >= 0:
                return True
            time.sleep(0.05)
        return False

    def end(self, pids: dict[int, int]) -> None:
        """End everything this run started: SIGCONT then SIGKILL to the workers, SIGKILL to the group."""
        for pid in pids.values():
            for sig in (signal.SIGCONT, signal.SIGKILL):
                _signal(pid, sig)
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        self.wait(10)


def recorded_pids(run_dir: Path) -> dict[int, int]:
    try:
        pids = json.loads((run_dir / "launch.json").read_text()).get("worker_pids", {})
    except (OSError, ValueError):
        return {}
    return {int(rank): int(pid) for rank, pid in pids.items()}


def max_iteration(run_dir: Path) -> int:
    """The highest iteration any rank's event log shows so far (-1 before the first)."""
    best = -1
    for path in run_dir.glob("rank*.jsonl"):
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if '"event":"iteration"' in line.replace(" ", ""):
                try:
                    best = max(best, int(json.loads(line).get("iter", -1)))
                except ValueError:
                    pass  # a line half written
    return best


def live_processes(field: int, value: int) -> list[int]:
    """Live (not zombie) processes whose ``/proc/PID/stat`` field ``field`` (counted after the
    command: 1 the parent, 2 the process group) is ``value``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[field]) == value and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes in process group ``pgid``."""
    return live_processes(2, pgid)


def alive(pids: dict[int, int]) -> dict[int, int]:
    """The ranks whose recorded process still lives (zombies count as gone)."""
    return {rank: pid for rank, pid in pids.items() if process_state(pid) not in (None, "Z")}


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def inject(fault: str, pid: int) -> threading.Timer | None:
    """Send ``fault`` to ``pid`` now; for SIGSTOP+CONT the SIGCONT follows on a timer (returned)."""
    if fault == "SIGKILL":
        _signal(pid, signal.SIGKILL)
        return None
    _signal(pid, signal.SIGSTOP)
    if fault == "SIGSTOP+CONT":
        timer = threading.Timer(CONT_AFTER_S, _signal, args=(pid, signal.SIGCONT))
        timer.daemon = True
        timer.start()
        return timer
    return None


def names_rank(text: str, rank: int) -> bool:
    """Whether a launcher line names ``rank`` as a rank or worker of its own ("rank 3",
    "worker 3", "lost rank 3", not "ranks 1, 3 could not go on")."""
    return re.search(rf"\b(?:rank|worker) {rank}\b", text) is not None


def first_naming(lines: list[Line], rank: int, after: float) -> Line | None:
    """The first launcher line at or after ``after`` that names ``rank``."""
    for line in lines:
        if line.t >= after and names_rank(line.text[len(LAUNCHER_PREFIX):], rank):
            return line
    return None


NEEDS_A_MODEL = frozenset({"allreduce", "eager-sgd", "pipe-sgd"})
"""Protocols that average gradients: they need a model and an optimizer (hopnet.init(model)
with a DistributedOptimizer), which examples/synthetic.py's bare vector is not."""


def workload(protocol: str, iterations: int, compute_ms: float) -> list[str]:
    """The script and its arguments: examples/synthetic.py (sleep-emulated compute, a 0.01 MB
    vector), or examples/train_digits.py (a small MLP, CPU-bound, about 4x the iterations
    in the same time) for the protocols in :data:`NEEDS_A_MODEL`."""
    if protocol in NEEDS_A_MODEL:
        n = str(4 * iterations)
        return [str(ROOT / "examples" / "train_digits.py"), "--iterations", n, "--eval-every", n]
    return [str(ROOT / "examples" / "synthetic.py"), "--compute-ms", str(compute_ms), "--model-mb", "0.01",
            "--iterations", str(iterations), "--warmup", "0", "--quiet"]

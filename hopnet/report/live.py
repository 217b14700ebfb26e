"""What `hopnet launch` shows while a run goes, and the summary when it ends.

:class:`ProgressState` folds the ranks' event records into the status line (slowest and
fastest worker's iteration, iterations per second, latest loss, skips where the protocol skips, time left);
it does no I/O. :class:`LaunchProgress` is what the launcher holds: on a terminal it
tails the rank logs every half second in a thread and keeps a rich live status line
at the bottom, with the workers' output printed above it through the same console; on a
pipe (or with ``--no-progress``) its streams pass everything straight through. When
the run ends it prints the per-rank summary table (:mod:`hopnet.report.summary`).
"""

from __future__ import annotations

import math
import os
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from hopnet.errors import HopnetError
from hopnet.output_spec import SKIPS
from hopnet.registry import lookup
from hopnet.report.rundir import LogTail, Record, load_run_dir, rank_logs
from hopnet.report.stats import run_stats
from hopnet.report.summary import print_summary

REFRESH_S = 0.5
RATE_WINDOW_S = 10.0
STATUS_LABEL = "training"


@dataclass
class RankProgress:
    finished: int = -1
    """The last finished iteration (-1: none yet)."""
    total: int | None = None
    skips: int = 0
    stopped: bool = False
    failed: bool = False
    window: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=256))

    def rate(self) -> float | None:
        """Iterations per second over the last :data:`RATE_WINDOW_S` seconds of records."""
        if len(self.window) < 2:
            return None
        last_mono, last_iter = self.window[-1]
        first_mono, first_iter = self.window[0]
        for mono, iteration in self.window:
            if last_mono - mono <= RATE_WINDOW_S:
                first_mono, first_iter = mono, iteration
                break
        if last_mono <= first_mono or last_iter <= first_iter:
            return None
        return (last_iter - first_iter) / (last_mono - first_mono)


class ProgressState:
    """The live view of a run, built from the ranks' records as they arrive."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.ranks: dict[int, RankProgress] = {}
        self.loss: float | None = None
        self._loss_mono = -math.inf
        self.view = 0
        self.members: list[int] | None = None
        """An elastic run's members in its latest committed view (``None``: no view change yet)."""
        self.shows_skips = True
        """Whether the protocol skips iterations at all (its ``output`` counts skips), as the
        workers' ``start`` records name it; until one is read (or for an unknown one), yes."""

    def add(self, rank: int, records: list[Record]) -> None:
        state = self.ranks.setdefault(rank, RankProgress())
        for rec in records:
            event = rec.get("event")
            if event == "iteration":
                iteration = rec.get("iter")
                if not isinstance(iteration, int):
                    continue
                state.finished = max(state.finished, iteration)
                mono = rec.get("mono")
                if isinstance(mono, (int, float)):
                    state.window.append((float(mono), iteration))
                    loss = rec.get("loss")
                    if isinstance(loss, (int, float)) and not isinstance(loss, bool) and mono >= self._loss_mono:
                        self.loss, self._loss_mono = float(loss), float(mono)
            elif event == "plan" and isinstance(rec.get("total"), int):
                state.total = rec["total"]
            elif event == "skip":
                state.skips += 1
            elif event == "view_committed":
                self._view_from(rec)
            elif event == "stop":
                state.stopped = True
            elif event == "error":
                state.failed = True
            elif event == "start":
                if rec.get("restart"):
                    state.stopped = state.failed = False  # a replacement (--max-restarts) runs on
                self._protocol_from(rec.get("config"))

    def _view_from(self, rec: Record) -> None:
        number, members = rec.get("view"), rec.get("members")
        if isinstance(number, int) and number > self.view and isinstance(members, list):
            self.view, self.members = number, [r for r in members if isinstance(r, int)]

    def _protocol_from(self, config: Any) -> None:
        protocol = config.get("protocol") if isinstance(config, dict) else None
        if not isinstance(protocol, str):
            return
        try:
            output = lookup(protocol).output
        except HopnetError:
            return
        self.shows_skips = any(count.field == SKIPS for count in output.counts)

    @property
    def total(self) -> int | None:
        totals = [s.total for s in self.ranks.values() if s.total is not None]
        return max(totals) if totals else None

    def status_text(self) -> str:
        """One line: ``training  iter 12–15 of 100  8.30 it/s  loss 0.412  skips 3  ~11 s left``; in an
        elastic run, after its first view change, over the members of the latest view (``view 2, 5 workers``)."""
        active = [s for s in self.ranks.values() if s.finished >= 0 or s.window]
        if not active:
            return f"{STATUS_LABEL}  starting {self.world_size} workers…"
        if self.members is not None:
            counted = [self.ranks[r] for r in self.members if r in self.ranks]
            done = [s.finished + 1 for s in counted] + [0] * sum(1 for r in self.members if r not in self.ranks)
        else:
            counted = list(self.ranks.values())
            done = [s.finished + 1 for s in counted]
            done += [0] * (self.world_size - len(done))
        slowest, fastest = min(done, default=0), max(done, default=0)
        total = self.total
        parts = [f"{STATUS_LABEL}  iter {slowest}–{fastest}" + (f" of {total}" if total is not None else "")]
        if self.members is not None:
            parts.append(f"view {self.view}, {len(self.members)} workers")
        rates = [r for r in (s.rate() for s in counted) if r is not None]
        rate = sum(rates) / len(rates) if rates else None
        parts.append(f"{rate:.2f} it/s" if rate is not None else "- it/s")
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4g}")
        if self.shows_skips:
            parts.append(f"skips {sum(s.skips for s in self.ranks.values())}")
        if total is not None and rates:
            slowest_rate = min(rates)
            left = max(0, total - slowest) / slowest_rate if slowest_rate > 0 else math.inf
            parts.append(f"~{_duration(left)} left" if math.isfinite(left) else "time left unknown")
        failed = sum(1 for s in self.ranks.values() if s.failed)
        if failed:
            parts.append(f"{failed} failed")
        return "  ".join(parts)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM", "") != "dumb"
    except (AttributeError, ValueError, OSError):
        return False


class ConsoleStream:
    """A text stream for the launcher's output writers: while the live line is up, whole
    lines go through its rich console (printed above the line); otherwise straight to ``target``."""

    def __init__(self, target: IO[str], progress: LaunchProgress | None) -> None:
        self.target = target
        self._progress = progress
        self._partial = ""

    def write(self, text: str) -> int:
        progress = self._progress
        if progress is None or not progress.active:
            if self._partial:
                text, self._partial = self._partial + text, ""
            self.target.write(text)
            return len(text)
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            progress.print_line(line)
        return len(text)

    @property
    def buffer(self) -> IO[bytes] | None:
        """The target's byte stream while nothing is routed, so bytes pass through untouched."""
        progress = self._progress
        if progress is not None and progress.active:
            return None
        return getattr(self.target, "buffer", None)

    def flush(self) -> None:
        progress = self._progress
        if progress is None or not progress.active:
            self.target.flush()

    def isatty(self) -> bool:
        return is_terminal(self.target)


class LaunchProgress:
    """The launcher's live status line (on a terminal) and end-of-run summary table."""

    def __init__(self, run_dir: Path, ranks: list[int], stdout: IO[str], stderr: IO[str], *, live: bool) -> None:
        self.run_dir = Path(run_dir)
        self.ranks = ranks
        self._stdout, self._stderr = stdout, stderr
        self.state = ProgressState(len(ranks))
        self.active = False
        self._console: Any = None
        self._live: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tails = {rank: LogTail(self.run_dir / f"rank{rank}.jsonl") for rank in ranks}
        screen = stderr if is_terminal(stderr) else stdout if is_terminal(stdout) else None
        routed = live and screen is not None
        self.stdout = ConsoleStream(stdout, self if routed and is_terminal(stdout) else None)
        self.stderr = ConsoleStream(stderr, self if routed and is_terminal(stderr) else None)
        if routed and screen is not None:
            self._start(screen)

    def _start(self, screen: IO[str]) -> None:
        from rich.console import Console
        from rich.live import Live

        self._console = Console(file=screen, highlight=False)
        self._live = Live(self._render(), console=self._console, auto_refresh=False, transient=True,
                          redirect_stdout=False, redirect_stderr=False)
        self._live.start(refresh=True)
        self.active = True
        self._thread = threading.Thread(target=self._follow, name="hopnet-progress", daemon=True)
        self._thread.start()

    def _render(self) -> Any:
        from rich.text import Text

        return Text(self.state.status_text(), style="bold", no_wrap=True, overflow="ellipsis")

    def poll(self) -> None:
        """Read whatever the ranks logged since the last poll (after an elastic run's first view change,
        the joiners' logs too)."""
        if self.state.view > 0:
            for rank, path in rank_logs(self.run_dir).items():
                self._tails.setdefault(rank, LogTail(path))
        for rank, tail in self._tails.items():
            records = tail.read()
            if records:
                self.state.add(rank, records)

    def _follow(self) -> None:
        shown = ""
        while not self._stop.wait(REFRESH_S):
            try:
                self.poll()
                text = self.state.status_text()
                if text != shown:
                    shown = text
                    self._live.update(self._render(), refresh=True)
            except Exception:  # noqa: BLE001 - the status line must never take the launcher down
                continue

    def print_line(self, line: str) -> None:
        from rich.text import Text

        self._console.print(Text.from_ansi(line), soft_wrap=True)

    def close(self) -> None:
        """Take the status line down (idempotent); later output goes straight to the streams."""
        if not self.active:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self.active = False
        try:
            self._live.stop()
        except Exception:  # noqa: BLE001
            pass

    def print_summary(self) -> None:
        """The per-rank summary table, from the finished run's logs (a rich table on a terminal)."""
        self.close()
        if not rank_logs(self.run_dir):
            return  # the workers never got as far as hopnet.init(): nothing to sum up
        try:
            stats = run_stats(load_run_dir(self.run_dir))
        except Exception as exc:  # noqa: BLE001 - a summary must not turn a finished run into a failure
            try:
                self._stderr.write(f"hopnet launch: no summary ({exc})\n")
            except (OSError, ValueError):
                pass
            return
        try:
            print_summary(stats, self._stderr, rich=is_terminal(self._stderr))
        except (OSError, ValueError):
            pass

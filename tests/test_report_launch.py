"""Progress and report on real `hopnet launch` runs: a deterministic straggler's neighbours
wait for its updates, the gaps stay within Table 1, the live line shows only on a terminal,
and the end-of-run summary table matches the logs."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import termios
import time
from pathlib import Path

import pytest

from hopnet.report.build import write_report
from hopnet.report.gaps import edge_gaps
from hopnet.report.rundir import load_run_dir
from hopnet.report.stats import run_stats
from hopnet.report.trace import chrome_trace

from support.paths import ROOT, WORKERS
from support.launch import LAUNCH, run_launch
from support.records import records

HOP_WORKER = str(WORKERS / "hop_worker.py")
pytestmark = pytest.mark.slow


def _launch_cmd(run_dir: Path, *extra: str, iterations: int = 30, compute_ms: int = 20) -> list[str]:
    return [*LAUNCH, "--graph", "ring:4", "--run-dir", str(run_dir),
            *extra, HOP_WORKER, "--iterations", str(iterations), "--compute-ms", str(compute_ms), "--dim", "100",
            "--report-loss"]


def _logged(run_dir: Path) -> dict[int, list[dict]]:
    return {r: records(run_dir, r) for r in range(4)}


def _share(records: list[dict], part: str) -> float:
    steps = [r for r in records if r["event"] == "iteration"]
    parts = ("compute_s", "wait_updates_s", "wait_tokens_s", "mix_s")
    return sum(r[part] for r in steps) / sum(r[p] for r in steps for p in parts)


def test_straggler_neighbours_wait_for_its_updates_and_the_summary_matches_the_logs(tmp_path: Path) -> None:
    """Rank 1 computes 4x longer (80 ms vs 20 ms). Its neighbours 0 and 2 spend most of each
    step waiting for its updates; it hardly waits at all. On a pipe there is no status line."""
    run_dir = tmp_path / "run"
    proc = run_launch(_launch_cmd(run_dir, "--slowdown", "rank=1:4")[len(LAUNCH):], timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "training  " not in proc.stdout + proc.stderr  # a pipe: no live status line

    logs = _logged(run_dir)
    stats = run_stats(load_run_dir(run_dir))
    straggler = stats.ranks[1].share("wait_updates_s")
    for neighbour in (0, 2):
        share = stats.ranks[neighbour].share("wait_updates_s")
        assert share > 0.3 and share > 3 * straggler, (neighbour, share, straggler)
    assert stats.ranks[1].share("compute_s") > 0.8  # 80 ms compute, next to nothing else
    for rank, logged in logs.items():  # the report's numbers are the logs' numbers
        assert stats.ranks[rank].share("wait_updates_s") == pytest.approx(_share(logged, "wait_updates_s"))
        assert stats.ranks[rank].iterations == 30 and stats.ranks[rank].total == 30

    gaps = edge_gaps(load_run_dir(run_dir))
    assert len(gaps) == 8 and all(g.within for g in gaps), gaps
    assert max(g.observed for g in gaps) >= 1  # the straggler really held its neighbours back

    # the summary table the launcher printed, row by row, against the raw logs
    lines = proc.stderr.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["rank", "iterations", "it/s"])
    for rank in range(4):
        cells = lines[header + 1 + rank].split()
        logged = logs[rank]
        last = max(r["iter"] for r in logged if r["event"] == "iteration")
        assert cells[0] == str(rank) and cells[1] == str(last + 1)
        assert cells[3] == f"{100 * _share(logged, 'wait_updates_s'):.1f}%"
        assert cells[4] == f"{100 * _share(logged, 'wait_tokens_s'):.1f}%"
        assert cells[5] == str(sum(r["event"] == "skip" for r in logged))
        stop = next(r for r in logged if r["event"] == "stop")
        assert cells[6] == str(sum(stop["dropped"].values())) and cells[7] == "finished"
    assert str(run_dir) in lines[-1]

    # report and trace of the same run
    page, trace_path = write_report(run_dir, trace=tmp_path / "trace.json")
    html = page.read_text()
    assert html.count("data:image/png;base64,") == 6 and "All 8 ordered pairs of neighbours stayed within" in html
    trace = json.loads(trace_path.read_text())
    assert trace == chrome_trace(load_run_dir(run_dir)) | {"otherData": {"run_dir": str(run_dir)}}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for rank in range(4):
        mine = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if e["pid"] == rank)
        assert len(mine) >= 30 and all(a[1] <= b[0] for a, b in zip(mine, mine[1:]))
    waits = {rank: sum(e["dur"] for e in spans if e["pid"] == rank and e["name"].startswith("wait for updates"))
             for rank in range(4)}
    assert waits[0] > 3 * waits[1] and waits[2] > 3 * waits[1]


def _run_on_pty(cmd: list[str], timeout_s: float = 240) -> tuple[int, str]:
    """Run ``cmd`` with a terminal (160 columns) as stdin, stdout and stderr; return its exit code and
    output without terminal control sequences."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    env = dict(os.environ, TERM="xterm-256color")
    for inherited in ("NO_COLOR", "COLUMNS", "LINES"):  # the terminal's own size decides the width
        env.pop(inherited, None)
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, env=env, start_new_session=True)
    os.close(slave)
    output = bytearray()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every holder of the terminal closed it
                    break
                if not chunk:
                    break
                output += chunk
            elif proc.poll() is not None:
                break
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.close(master)
    return code, re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", output.decode("utf-8", errors="replace"))  # no ANSI codes


def test_live_status_line_on_a_terminal_only_without_no_progress(tmp_path: Path) -> None:
    code, out = _run_on_pty(_launch_cmd(tmp_path / "run", iterations=50, compute_ms=30))
    assert code == 0, out
    statuses = re.findall(r"training  iter (\d+)–(\d+) of 50  ([\d.]+) it/s  loss [\d.e+-]+  skips 0", out)
    assert statuses, out
    assert any(0 < int(slowest) < 50 for slowest, _, _ in statuses), statuses  # seen while it ran
    assert "[rank 0] done at iteration 49" in out  # worker output still there, prefixed
    assert "┃ rank ┃ iterations ┃" in out  # the summary is a rich table on a terminal

    code, out = _run_on_pty(_launch_cmd(tmp_path / "quiet", "--no-progress", iterations=20, compute_ms=2))
    assert code == 0, out
    assert "training  " not in out and "[rank 1] done at iteration 19" in out

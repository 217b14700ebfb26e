"""The end of a run never hangs: once a worker finished, the others get --exit-timeout to exit;
one that finished its loop but blocks its exit is killed and named, and the run still counts
as finished; one still training then fails the run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hopnet.launch.exit_bound import finished_its_loop, overdue_lines
from support.launch import run_launch
from support.paths import ROOT

SLOW_EXIT = str(ROOT / "tests" / "scripts" / "slow_exit.py")


def test_a_worker_finished_its_loop_when_its_log_ends_with_stop(tmp_path: Path) -> None:
    (tmp_path / "rank0.jsonl").write_text('{"event":"iteration","iter":9}\n{"event":"stop","iter":9}\n')
    (tmp_path / "rank1.jsonl").write_text('{"event":"iteration","iter":9}\n')
    assert finished_its_loop(tmp_path, 0) and not finished_its_loop(tmp_path, 1)
    assert not finished_its_loop(tmp_path, 2)  # no log at all
    lines, unfinished = overdue_lines(tmp_path, [0, 1], 30.0)
    assert lines == ["rank 0 finished its loop but did not exit within 30s; killed"] and unfinished == [1]


def test_a_worker_exit_ends_an_idle_thread_pool_as_the_interpreter_does() -> None:
    """torch.compile leaves an idle ThreadPoolExecutor behind; a worker's exit joined its non-daemon
    threads without first telling the pool to end, and waited until the exit bound killed it."""
    script = ("import concurrent.futures\n"
              "from hopnet.bootstrap.quick_exit import exit_now\n"
              "pool = concurrent.futures.ThreadPoolExecutor(2)\n"
              "assert pool.submit(sum, [1, 2]).result() == 3\n"
              "exit_now(7)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, timeout=60, capture_output=True, text=True)
    assert done.returncode == 7, done.stderr


def test_a_worker_exit_runs_a_scripts_finalizers_and_skips_torchs_operator_libraries(tmp_path: Path) -> None:
    """A temporary directory's finalizer (the script's) still cleans up at a worker's exit; torch.library's,
    which only unregister operators in the process that ends, are skipped."""
    script = ("import tempfile, weakref, torch.library\n"
              "from hopnet.bootstrap.quick_exit import exit_now\n"
              "kept = tempfile.TemporaryDirectory(dir=%r)\n"
              "library = torch.library.Library('hopnet_exit_test', 'DEF')\n"
              "def ran(): print('torch.library finalizer ran', flush=True)\n"
              "ran.__module__ = 'torch.library'\n"
              "weakref.finalize(library, ran)\n"
              "exit_now(0)\n") % str(tmp_path)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, timeout=60, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "finalizer ran" not in done.stdout
    assert list(tmp_path.iterdir()) == []  # the temporary directory was removed


@pytest.mark.slow
@pytest.mark.parametrize("how", ["thread", "atexit"])
def test_a_worker_that_blocks_its_exit_is_killed_and_the_run_still_finished(tmp_path: Path, how: str) -> None:
    done = run_launch(["--nproc", "2", "--exit-timeout", "2", "--grace", "2", "--run-dir", str(tmp_path / "run"),
                       SLOW_EXIT, how], timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 1 finished its loop but did not exit within 2s; killed" in done.stderr


@pytest.mark.slow
def test_a_worker_still_training_long_after_the_others_finished_fails_the_run(tmp_path: Path) -> None:
    done = run_launch(["--nproc", "2", "--exit-timeout", "2", "--grace", "2", "--run-dir", str(tmp_path / "run"),
                       SLOW_EXIT, "training"], timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert ("rank 1 did not finish within 2s of the first worker that did (--exit-timeout); stopped"
            in done.stderr)

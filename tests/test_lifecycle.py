"""How workers end, for real: `hopnet launch` with tests/workers/hop_worker.py.

Every ending a script can have (return without close(), sys.exit(N), an exception,
SIGTERM, the launcher killed) must give the right exit status, flushed logs, an
``error`` record naming the cause, and no process left behind. Races make these flaky
by nature, so the scenarios that used to fail some of the time run several times.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


from hopnet.launch.run_dir import previous_run_files

from support.env import clean_env
from support.launch import recorded_worker_pids, run_launch, start_launch, worker_pids
from support.paths import EXAMPLES, ROOT, WORKERS
from support.records import records
from support.processes import wait_gone
from support.wait import wait_until

HOP_WORKER = str(WORKERS / "hop_worker.py")
FAST = ["--dim", "100", "--compute-ms", "1"]

pytestmark = pytest.mark.slow


def launch(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return run_launch(args, timeout=timeout)


def launcher_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("hopnet launch: ")]


def summary_line(stderr: str) -> str:
    """The launcher's line naming what went wrong (before its per-rank table and closing line)."""
    closing = ("hopnet launch: per-rank summary", "hopnet launch: failed in ", "hopnet launch: finished in ")
    return [line for line in launcher_lines(stderr) if not line.startswith(closing)][-1]


def result_of(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "launch.json").read_text())["result"]


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)  # each worker leads its own process group
        except (ProcessLookupError, PermissionError):
            pass


def _entered(run_dir: Path, ranks: list[int], iteration: int) -> bool:
    return all(any(r.get("iter", -1) >= iteration for r in records(run_dir, rank, "enter")) for rank in ranks)


def _stuck(run_dir: Path, rank: int) -> Callable[[], bool]:
    """A condition that holds once ``rank`` entered no new iteration since it was last asked."""
    entered = -1

    def no_new_iteration() -> bool:
        nonlocal entered
        latest = max(r["iter"] for r in records(run_dir, rank, "enter"))
        stuck, entered = latest == entered, latest
        return stuck
    return no_new_iteration


def _start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[str], Path]:
    run_dir = tmp_path / "run"
    proc = start_launch(["--run-dir", str(run_dir), *args], new_session=True)
    return proc, run_dir


# ------------------------------------------------------------------------------ exits
# Each exit test exits 4 workers, so a race at interpreter exit has four chances per run to show.
def test_a_worker_never_closed_is_closed_at_exit(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = launch("--nproc", "4", "--run-dir", str(run_dir), HOP_WORKER, *FAST, "--iterations", "20", "--no-close")
    assert proc.returncode == 0, proc.stderr
    assert "SIG" not in proc.stderr and "terminate called" not in proc.stderr
    for rank in range(4):
        log = records(run_dir, rank)
        assert max(r["iter"] for r in log if r["event"] == "iteration") == 19
        assert log[-1]["event"] == "stop" and log[-1]["iter"] == 19  # closed and flushed
        assert not any(r["event"] == "error" for r in log)


def test_sys_exit_is_reported_with_its_own_code(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = launch("--nproc", "4", "--run-dir", str(run_dir), HOP_WORKER, *FAST, "--iterations", "40",
                  "--exit-rank", "1", "--exit-code", "3", "--fail-at", "5")
    assert proc.returncode == 1
    assert "terminate called" not in proc.stderr and "SIGABRT" not in proc.stderr and "SIGSEGV" not in proc.stderr
    assert "hopnet launch: worker 1 failed (exit code 3)" in summary_line(proc.stderr), proc.stderr
    result = result_of(run_dir)
    assert result["failed_rank"] == 1 and result["worker_returncodes"]["1"] == 3
    (err,) = [r for r in records(run_dir, 1) if r["event"] == "error"]
    assert (err["error"], err["exit_code"], err["iter"]) == ("SystemExit", 3, 5)
    assert records(run_dir, 1)[-1]["event"] == "stop"


def test_an_exception_leaves_promptly_and_is_blamed(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = launch("--nproc", "4", "--run-dir", str(run_dir), HOP_WORKER, *FAST, "--iterations", "40",
                  "--raise-rank", "1", "--fail-at", "5")
    assert proc.returncode == 1
    summary = summary_line(proc.stderr)
    assert summary.startswith("hopnet launch: worker 1 failed in iteration 5 (exit code 1): "
                              "RuntimeError: rank 1 broke in iteration 5"), proc.stderr
    assert "[rank 1] RuntimeError: rank 1 broke in iteration 5" in proc.stderr  # its traceback, as Python prints it
    assert "worker_main" not in proc.stderr and "runpy" not in proc.stderr and "forkserver" not in proc.stderr
    # one traceback, rank 1's; a rank that failed because of it says so in one line
    assert proc.stderr.count("Traceback") == 1 and "[rank 1] Traceback" in proc.stderr, proc.stderr
    for rank in (0, 2, 3):
        said = [line for line in proc.stderr.splitlines() if line.startswith(f"[rank {rank}] ")]
        assert len(said) <= 1 and all(re.match(r"\[rank \d\] hopnet: (PeerFailure|WaitTimeout): ", line)
                                      for line in said), proc.stderr
    assert result_of(run_dir)["worker_returncodes"]["1"] == 1
    (err,) = [r for r in records(run_dir, 1) if r["event"] == "error"]
    assert (err["error"], err["exit_code"], err["iter"]) == ("RuntimeError", 1, 5)
    # it said bye instead of letting its neighbours wait out the timeout (120 s)
    for neighbour in (0, 2):
        left = [r for r in records(run_dir, neighbour) if r["event"] == "peer_left"]
        assert left and left[0]["peer"] == 1


# ------------------------------------------------------------------------------ blame
def test_a_stalled_rank_is_named(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = launch("--nproc", "4", "--timeout", "5", "--run-dir", str(run_dir), HOP_WORKER, *FAST,
                  "--iterations", "40", "--stall-rank", "2", "--fail-at", "10")
    assert proc.returncode == 1
    summary = summary_line(proc.stderr)
    assert summary.startswith("hopnet launch: rank 2 stalled in iteration 10: "), proc.stderr
    assert "timed out waiting for its updates" in summary
    assert "ranks 1, 3" in summary or "rank 1" in summary or "rank 3" in summary
    assert result_of(run_dir)["failed_rank"] == 2


def test_a_rank_that_stops_early_is_named(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = launch("--nproc", "4", "--run-dir", str(run_dir), HOP_WORKER, *FAST,
                  "--iterations", "50", "--stop-rank", "0", "--stop-at", "20")
    assert proc.returncode == 1
    summary = summary_line(proc.stderr)
    assert summary.startswith("hopnet launch: rank 0 left after iteration 19 while its neighbours ran on to "
                              "iteration "), proc.stderr
    assert "could not go on without it" in summary
    assert result_of(run_dir)["failed_rank"] == 0


# ------------------------------------------------------------------------ signals
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_print_one_line(tmp_path: Path, signum: int) -> None:
    proc, run_dir = _start(tmp_path, "--nproc", "4", HOP_WORKER, *FAST, "--iterations", "100000")
    try:
        wait_until(lambda: _entered(run_dir, [0, 1, 2, 3], 3), 120, interval=0.1,
                   what="ranks 0, 1, 2, 3 to enter iteration 3", while_running=proc)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        _kill_all(list(recorded_worker_pids(run_dir).values()))
        proc.kill()
    assert proc.returncode == 128 + signum
    assert out == ""
    lines = err.splitlines()
    assert lines[0].startswith("hopnet launch: 4 workers")
    before = ("hopnet launch: running ", "hopnet launch: OMP_NUM_THREADS", "hopnet launch: starting 4 workers",
              "hopnet launch: waiting for the workers to reach hopnet.init", "hopnet launch: 4/4 ready after ")
    # (lines printed before the signal)
    rest = [line for line in lines[1:] if not line.startswith(before)]
    assert rest == [f"hopnet launch: received {signal.Signals(signum).name}, stopping 4 workers; run dir {run_dir}"]
    codes = result_of(run_dir)["worker_returncodes"]
    assert codes == {str(r): 143 for r in range(4)}, {  # all left on SIGTERM; else why one did not
        rank: records(run_dir, int(rank))[-3:] for rank, code in codes.items() if code != 143}
    for rank in range(4):
        log = records(run_dir, rank)
        errors = [r for r in log if r["event"] == "error"]
        assert log[-1]["event"] == "stop" and [e["error"] for e in errors] == ["Terminated"], log[-4:]


def test_a_worker_killed_in_a_gloo_all_reduce_is_named_not_the_members_that_saw_it(tmp_path: Path) -> None:
    """Over gloo, every member of the all-reduce a killed worker was in fails with "Connection closed
    by peer", which names no rank, and writes its error record after the death; the killed one writes
    none. The launcher names the killed one."""
    proc, run_dir = _start(tmp_path, "--nproc", "4", "--protocol", "allreduce", "--bulk", "torch",
                           str(EXAMPLES / "train_digits.py"), "--iterations", "100000", "--eval-every", "100000")
    try:
        wait_until(lambda: _entered(run_dir, [0, 1, 2, 3], 5), 120, interval=0.1,
                   what="ranks 0, 1, 2, 3 to enter iteration 5", while_running=proc)
        os.kill(worker_pids(run_dir, 4)[2], signal.SIGKILL)
        _, err = proc.communicate(timeout=90)
    finally:
        _kill_all(list(recorded_worker_pids(run_dir).values()))
        proc.kill()
    assert proc.returncode == 1, err
    assert summary_line(err).startswith("hopnet launch: rank 2 died (killed by SIGKILL)"), err
    assert result_of(run_dir)["failed_rank"] == 2


def test_sigterm_reaches_a_trainer_waiting_inside_gloo_for_its_gradient(tmp_path: Path) -> None:
    """Over gloo, allreduce's backward pass issues its buckets and waits for them in the trainer's own
    thread, inside gloo, where Python runs no signal handler. With rank 1 stopped (a frozen host,
    which nobody can signal), rank 0 waits there; a SIGTERM (Ctrl-C on its own host's launcher, a
    cluster manager) still ends it, by its own handling: 143 and a ``Terminated`` record. (--peer-timeout
    and --timeout are far off: only the signal can end the wait.)"""
    proc, run_dir = _start(tmp_path, "--nproc", "2", "--protocol", "allreduce", "--bulk", "torch",
                           "--peer-timeout", "120", "--timeout", "300", str(EXAMPLES / "train_digits.py"),
                           "--iterations", "100000", "--eval-every", "100000")
    try:
        wait_until(lambda: _entered(run_dir, [0, 1], 5), 120, interval=0.1,
                   what="ranks 0, 1 to enter iteration 5", while_running=proc)
        os.kill(worker_pids(run_dir, 2)[1], signal.SIGSTOP)
        wait_until(_stuck(run_dir, 0), 120, interval=1.0, what="rank 0 to be stuck: no new iteration for a second")
        os.kill(worker_pids(run_dir, 2)[0], signal.SIGTERM)
        proc.communicate(timeout=90)  # (the launcher then ends the run, rank 1 with it)
    finally:
        _kill_all(list(recorded_worker_pids(run_dir).values()))
        proc.kill()
    assert result_of(run_dir)["worker_returncodes"]["0"] == 143, records(run_dir, 0)[-3:]
    log = records(run_dir, 0)
    assert [r["error"] for r in log if r["event"] == "error"] == ["Terminated"], log[-3:]
    assert log[-1]["event"] == "stop" and log[-1]["issued_in_backward"] > 0, log[-1]  # the trainer's own wait


@pytest.mark.parametrize("phase", ["training", "starting", "one stopped"])
def test_workers_end_within_5s_when_the_launcher_is_killed(tmp_path: Path, phase: str) -> None:
    extra = ["--sleep-before-init", "600"] if phase == "starting" else []
    proc, run_dir = _start(tmp_path, "--nproc", "3", HOP_WORKER, *FAST, "--iterations", "100000", *extra)
    workers: list[int] = []
    try:
        if phase != "starting":
            wait_until(lambda: _entered(run_dir, [0, 1, 2], 3), 120, interval=0.1,
                       what="ranks 0, 1, 2 to enter iteration 3", while_running=proc)
        workers = list(worker_pids(run_dir, 3).values())
        if phase == "starting":
            time.sleep(1.0)  # inside the script, before hopnet.init
        if phase == "one stopped":
            os.kill(workers[1], signal.SIGSTOP)  # it cannot act on SIGTERM or watch a pipe
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        wait_gone(workers, 5.0)
    finally:
        _kill_all(workers)
        proc.kill()
        proc.communicate()


# ----------------------------------------------------------------------------- options
def test_code_cannot_change_an_explicit_flag(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = launch("--nproc", "3", "--max-ig", "3", "--run-dir", str(run_dir), HOP_WORKER, *FAST,
                  "--iterations", "5", "--init-option", "max_ig=4")
    # every rank refuses it; the launcher says it once, exits 2 and keeps no run directory
    assert proc.returncode == 2, proc.stderr
    message = "--max-ig 3 on the command line, max_ig=4 in hopnet.init()"
    assert proc.stderr.count(message) == 1, proc.stderr
    assert summary_line(proc.stderr).startswith(f"hopnet launch: error: {message}")
    assert "Traceback" not in proc.stderr and "per-rank summary" not in proc.stderr
    # hopnet's files are gone; the directory stays for the files the script wrote before its init
    assert sorted(p.name for p in run_dir.iterdir()) == [f"initial_rank{r}.pt" for r in range(3)]


def test_options_set_in_code_are_what_runs_and_what_is_recorded(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = launch("--nproc", "3", "--backup-workers", "0", "--run-dir", str(run_dir), HOP_WORKER, *FAST,
                  "--iterations", "5", "--init-option", "max_ig=4")
    assert proc.returncode == 0, proc.stderr
    assert "hopnet launch: running hop --max-ig 4 (max_ig set in code)" in launcher_lines(proc.stderr)
    info = json.loads((run_dir / "launch.json").read_text())
    assert info["config"]["max_ig"] == 4 and info["config_flags"]["max_ig"] == 2
    assert info["explicit_options"] == ["backup_workers"]
    for rank in range(3):
        start = next(r for r in records(run_dir, rank) if r["event"] == "start")
        assert start["config"] == info["config"]


def test_ranks_that_disagree_on_options_all_fail_at_the_rendezvous(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = launch("--nproc", "3", "--run-dir", str(run_dir), HOP_WORKER, *FAST,
                  "--iterations", "5", "--init-option", "1:max_ig=4")
    assert proc.returncode == 2, proc.stderr  # a configuration error, which every rank meets
    # the first rank to register sets the options; which one that is depends on timing
    found = re.search(r"hopnet launch: error: ranks (\d) and (\d) run different protocol options: "
                      r"max_ig=(\d) on rank \1, max_ig=(\d) on rank \2", proc.stderr)
    assert found, proc.stderr
    first, second, first_ig, second_ig = map(int, found.groups())
    assert 1 in (first, second) and {first_ig, second_ig} == {2, 4} and (first_ig == 4) == (first == 1)
    # every rank fails at once; the launcher says it once, without a traceback or a table
    assert proc.stderr.count("run different protocol options") == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "[rank" not in proc.stderr and "per-rank summary" not in proc.stderr
    assert previous_run_files(run_dir) == []


# ------------------------------------------------------------------------ max failures
def test_max_failures_lets_the_others_finish(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = launch("--graph", "ring_based:6", "--backup-workers", "1", "--max-failures", "1",
                  "--run-dir", str(run_dir), HOP_WORKER, *FAST, "--iterations", "40",
                  "--exit-rank", "2", "--exit-code", "3", "--fail-at", "10")
    assert proc.returncode == 0, proc.stderr
    lines = launcher_lines(proc.stderr)
    assert "hopnet launch: lost rank 2 (2: exit code 3); the other 5 workers finished" in lines
    for rank in (0, 1, 3, 4, 5):
        assert max(r["iter"] for r in records(run_dir, rank) if r["event"] == "iteration") == 39
    assert result_of(run_dir)["lost_ranks"] == [2]


def test_more_failures_than_allowed_fail_the_run(tmp_path: Path) -> None:
    proc = launch("--nproc", "3", "--max-failures", "1", "--run-dir", str(tmp_path / "run"), HOP_WORKER, *FAST,
                  "--iterations", "40", "--raise-rank", "1", "--fail-at", "5")
    assert proc.returncode == 1  # without backup workers rank 1's neighbours cannot go on
    # the first to exit is lost and tolerated (it may be a neighbour that exits before rank 1 has)
    assert any(line.endswith("the others go on (1 of --max-failures 1)") for line in launcher_lines(proc.stderr))
    assert summary_line(proc.stderr).startswith("hopnet launch: worker 1 failed in iteration 5")


def test_sigkill_one_of_8_workers_and_the_others_finish(tmp_path: Path) -> None:
    """Needs the workers to notice a dead neighbour by themselves (heartbeats, the `peers` branch). Rank 0,
    whose launcher-side roles (the first log, the consensus's lowest rank) make it the harder one to lose;
    a killed middle rank: test_dead_peers.py."""
    victim = 0
    proc, run_dir = _start(tmp_path, "--graph", "ring_based:8", "--backup-workers", "1", "--max-failures", "1",
                           HOP_WORKER, *FAST, "--iterations", "60", "--compute-ms", "5")
    workers: list[int] = []
    try:
        wait_until(lambda: _entered(run_dir, [victim], 5), 120, interval=0.1,
                   what=f"rank {victim} to enter iteration 5", while_running=proc)
        pids = worker_pids(run_dir, 8)
        workers = list(pids.values())
        os.kill(pids[victim], signal.SIGKILL)
        out, err = proc.communicate(timeout=180)
    finally:
        _kill_all(workers)
        proc.kill()
    assert proc.returncode == 0, err
    assert any(line.startswith(f"hopnet launch: lost rank {victim} ") for line in launcher_lines(err)), err
    for rank in range(8):
        if rank != victim:
            assert max(r["iter"] for r in records(run_dir, rank) if r["event"] == "iteration") == 59


@pytest.mark.parametrize("mode, code, last_error", [("return", 0, None), ("raise", 1, "RuntimeError")])
def test_workers_of_a_script_run_without_the_launcher_are_closed_at_exit(tmp_path: Path, mode: str, code: int,
                                                                         last_error: str | None) -> None:
    """The atexit hook and excepthook that hopnet.Worker installs, without the launcher's entry point."""
    script = str(Path(__file__).resolve().parent / "scripts" / "unclosed_workers.py")
    proc = subprocess.run([sys.executable, script, str(tmp_path), mode], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, proc.stderr
    assert "Segmentation" not in proc.stderr and "terminate called" not in proc.stderr
    for rank in range(2):
        log = records(tmp_path, rank)
        assert log[-1]["event"] == "stop" and log[-1]["iter"] == 4
        errors = [r["error"] for r in log if r["event"] == "error"]
        assert errors == ([last_error] if last_error else [])


STOPPED_THEN_CLOSE_FAILS = """
import os, signal, time
try:
    os.kill(os.getpid(), signal.SIGTERM)  # the launcher stops the run...
    time.sleep(30)
finally:
    raise RuntimeError("a neighbour left while this worker closed")  # ...and closing then fails
"""


def test_a_stopped_worker_whose_close_then_fails_still_leaves_as_stopped(tmp_path: Path) -> None:
    script = tmp_path / "stopped.py"
    script.write_text(STOPPED_THEN_CLOSE_FAILS)
    proc = subprocess.run([sys.executable, "-m", "hopnet.bootstrap.worker_main", str(script)], env=clean_env(),
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 143, proc.stderr  # stopped, not failed: the launcher says why it stopped the run
    assert proc.stderr == ""

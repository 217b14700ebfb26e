"""Every process of a run says what it is in ps, top and py-spy (hopnet.bootstrap.title): each
worker its rank, script and run, the coordinator, the store and the fork server their role and run, a
replacement worker its restart. Real launches, read through /proc while their workers run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hopnet.bootstrap.title import coordinator_title, fork_server_title, script_name, worker_title

from support.env import clean_env
from support.launch import kill, start_launch, worker_pids
from support.ports import free_port
from support.processes import alive

SCRIPTS = Path(__file__).resolve().parent / "scripts"
WORKER = SCRIPTS / "launch_worker.py"
CRASH_ONCE = SCRIPTS / "crash_once.py"
TITLE_WORKER = SCRIPTS / "title_worker.py"

pytestmark = pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc")


def cmdline(pid: int) -> str:
    """The title ``ps`` shows: ``/proc/PID/cmdline``, its NUL separators and padding as spaces."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def comm(pid: int) -> str:
    """What ``top`` shows: ``/proc/PID/comm`` (the title's first 15 bytes)."""
    return Path(f"/proc/{pid}/comm").read_text().strip()


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if parent(int(entry.name)) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass  # gone meanwhile
    return found


def until(read: Callable[[], object], expected: object, timeout_s: float = 60.0) -> None:
    """Wait until ``read()`` returns ``expected`` (a process names itself a moment after it starts)."""
    deadline = time.monotonic() + timeout_s
    while (value := read()) != expected:
        assert time.monotonic() < deadline, f"{value!r} != {expected!r}"
        time.sleep(0.05)


def stop(launcher: subprocess.Popen[str], pids: list[int]) -> None:
    """SIGTERM the launcher (it stops its workers, coordinator and fork server), then make sure
    every process the test saw is gone; SIGKILL what is left, by pid."""
    try:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            try:
                launcher.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 15
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        kill(launcher)
        for pid in pids:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    assert [p for p in pids if alive(p)] == []


@pytest.mark.slow
@pytest.mark.parametrize("start_method", ["forkserver", "exec"])
def test_workers_the_coordinator_and_the_fork_server_are_titled(tmp_path: Path, start_method: str) -> None:
    run_dir = tmp_path / "20261128-prague-ring-3"
    launcher = start_launch(["--protocol", "prague", "--group-generator", "random", "--nproc", "3",
                             "--start-method", start_method, "--run-dir", str(run_dir), "--no-progress",
                             str(WORKER), "--sleep", "120"], new_session=True)
    seen: list[int] = []
    try:
        workers = worker_pids(run_dir, 3)
        seen.extend(workers.values())
        coordinator = json.loads((run_dir / "launch.json").read_text())["coordinator"]["pid"]
        seen.append(coordinator)
        for rank, pid in workers.items():
            title = f"hopnet rank {rank}/3 launch_worker.py (run {run_dir.name})"
            until(lambda: cmdline(pid), title)
            assert comm(pid) == title[:15]
        until(lambda: cmdline(coordinator), f"hopnet coordinator (run {run_dir.name})")
        assert comm(coordinator) == "hopnet coordina"
        store = json.loads((run_dir / "launch.json").read_text())["store_pid"]
        launcher_maps = Path(f"/proc/{launcher.pid}/maps").read_text()
        if start_method == "forkserver":
            server = parent(workers[0])
            seen.extend([server, store])
            assert server != launcher.pid and parent(coordinator) == server == parent(store)
            assert cmdline(server) == f"hopnet fork server (run {run_dir.name})"
            assert cmdline(store) == f"hopnet store (run {run_dir.name})"
            assert "libtorch" not in launcher_maps  # the store, torch's, lives in a process of its own
        else:  # each a child of the launcher, which hosts the store itself
            assert set(children(launcher.pid)) >= {*workers.values(), coordinator}
            assert store == launcher.pid and "libtorch" in launcher_maps
    finally:
        stop(launcher, seen)


@pytest.mark.slow
def test_a_replacement_worker_is_titled_with_its_restart(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = tmp_path / "out"
    out.mkdir()
    launcher = start_launch(["--nproc", "2", "--max-restarts", "1", "--run-dir", str(run_dir), "--no-progress",
                             str(CRASH_ONCE), "1", str(out), "--how", "exit", "--sleep", "120", "--hold", "120"],
                            new_session=True)
    seen: list[int] = []
    try:
        seen.extend(worker_pids(run_dir, 2).values())
        record = out / "rank1.restart1.json"
        deadline = time.monotonic() + 120
        while not record.exists():
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.05)
        replacement = json.loads(record.read_text())["pid"]
        seen.append(replacement)
        until(lambda: cmdline(replacement), "hopnet rank 1/2 crash_once.py (run run, restart 1)")
    finally:
        stop(launcher, seen)


@pytest.mark.slow
def test_a_worker_that_hopnet_init_attaches_is_titled_once_its_rank_is_known(tmp_path: Path) -> None:
    """Two plain processes with the variables srun sets: hopnet.init names each after its rank and
    the run directory rank 0 made."""
    port = free_port()
    procs: list[subprocess.Popen[str]] = []
    try:
        for rank in range(2):
            env = {**clean_env(PYTHONUNBUFFERED="1"), "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2",
                   "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_JOB_ID": "4243",
                   "SLURM_JOB_NODELIST": "localhost", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen([sys.executable, str(TITLE_WORKER)], env=env, cwd=tmp_path,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    (run_dir,) = (tmp_path / "runs").iterdir()
    titles = [line.removeprefix("TITLE ") for o in outputs for line in o.splitlines() if line.startswith("TITLE ")]
    assert titles == [f"hopnet rank {r}/2 title_worker.py (run {run_dir.name})" for r in range(2)], outputs


def test_titles_name_the_rank_the_script_and_the_run() -> None:
    assert worker_title(2, 8, "train.py", "/runs/20261128-hop-ring-8") == \
        "hopnet rank 2/8 train.py (run 20261128-hop-ring-8)"
    assert worker_title(0, 4, "pkg.train") == "hopnet rank 0/4 pkg.train"
    assert worker_title(3, 4, "t.py", "r", restart=2) == "hopnet rank 3/4 t.py (run r, restart 2)"
    assert coordinator_title("runs/x") == "hopnet coordinator (run x)"
    assert fork_server_title(None) == "hopnet fork server"
    assert script_name(["/a/b/train.py", "--lr", "1"]) == "train.py"
    assert script_name(["-m", "pkg.train"]) == "pkg.train"

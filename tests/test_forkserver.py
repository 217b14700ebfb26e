"""The fork server: a forked worker is what an exec'd one would be (environment, session,
streams, exit status), and a fork server that dies takes its workers with it and leaves the
launcher starting workers with exec. The coordinator forks from it too, and goes with a
killed launcher."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from hopnet.config import ProtocolConfig
from hopnet.graph import Graph
from hopnet.bootstrap.coordinator_proc import CoordinatorProcess
from hopnet.bootstrap.forkserver_template import identity
from hopnet.launch.forkserver import TEMPLATE_VAR, ForkedWorker, ForkServer, ForkServerGone, TemplateForked, available
from hopnet.launch.processes import LineWriter, WorkerProcesses
from hopnet.launch.spec import WORKER_ENTRY

from support.env import clean_env
from support.launch import kill, recorded_worker_pids, run_launch, start_launch
from support.paths import ROOT, WORKERS
from support.records import coordinator_records, records
from support.processes import alive, wait_gone
from support.template import forkserver_template
from support.wait import wait_until

pytestmark = pytest.mark.skipif(not available(), reason="the fork server needs Linux (fork, pidfd_open)")

REPORT = """
import json, os, random, sys
import torch
print(json.dumps({"pid": os.getpid(), "sid": os.getsid(0), "ppid": os.getppid(), "argv": sys.argv,
                  "mine": os.environ.get("MINE"), "stdin": sys.stdin.read(), "threads": torch.get_num_threads(),
                  "random": random.random(), "main": __name__}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def server():
    env = clean_env(OMP_NUM_THREADS="1")  # (not the cores of a machine that has 2 or more: the template's count)
    fork_server = ForkServer(env)
    yield fork_server
    fork_server.close()


def _spawn(server: ForkServer, script: Path, rank: int, *args: str, **env: str) -> tuple[ForkedWorker, dict, bytes]:
    worker = server.spawn(rank, [str(script), *args], clean_env(**env), piped=True)
    assert worker.stdout is not None and worker.stderr is not None
    out, err = worker.stdout.read(), worker.stderr.read()
    worker.wait(timeout=60)
    return worker, json.loads(out), err


def test_a_forked_worker_gets_its_own_environment_session_streams_and_exit_status(server: ForkServer,
                                                                                 tmp_path: Path) -> None:
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    first, seen, err = _spawn(server, script, 0, "3", MINE="zero", OMP_NUM_THREADS="2")
    assert first.returncode == 3
    assert seen["pid"] == first.pid and seen["sid"] == first.pid  # a session of its own, like start_new_session
    assert seen["ppid"] == server.pid
    assert seen["argv"] == [str(script), "3"] and seen["main"] == "__main__"
    assert seen["mine"] == "zero" and seen["stdin"] == ""
    assert seen["threads"] == 2  # OMP_NUM_THREADS of the request, not the fork server's 1
    assert err == b"to stderr\n"
    second, seen_again, _ = _spawn(server, script, 1, "0", MINE="one")
    assert second.returncode == 0 and seen_again["mine"] == "one" and seen_again["threads"] == 1  # the server's
    assert seen_again["random"] != seen["random"]  # each worker its own random stream


def test_a_signalled_worker_reports_the_signal_as_popen_does(server: ForkServer, tmp_path: Path) -> None:
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    worker = server.spawn(0, [str(script)], clean_env(), piped=True)
    assert worker.stdout is not None and worker.stdout.readline() == b"up\n"
    os.killpg(worker.pid, signal.SIGKILL)
    assert worker.wait(timeout=30) == -signal.SIGKILL


def test_workers_of_a_dead_fork_server_end_and_the_next_ones_start_with_exec(tmp_path: Path) -> None:
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    done = tmp_path / "done.py"
    done.write_text("print('exec worker')\n")
    out = LineWriter(open(os.devnull, "w"))
    workers = WorkerProcesses(out, out, forkserver=ForkServer(clean_env()), fork_entry=WORKER_ENTRY)
    workers.spawn(0, [*WORKER_ENTRY, str(script)], clean_env())
    forked = workers.procs[0]
    assert isinstance(forked, ForkedWorker)
    assert workers.forkserver is not None
    wait_until(Path(f"/proc/{forked.pid}").exists, 60, what=f"the forked worker's process {forked.pid}")
    os.kill(workers.forkserver.pid, signal.SIGKILL)
    assert forked.wait(timeout=30) == -signal.SIGKILL  # killed by the parent-death signal, or by the launcher
    wait_gone([forked.pid], 10)
    with pytest.raises(ForkServerGone):
        workers.forkserver.spawn(9, [str(done)], clean_env(), piped=False)
    workers.spawn(1, [*WORKER_ENTRY, str(done)], clean_env())
    assert isinstance(workers.procs[1], subprocess.Popen)
    assert workers.procs[1].wait(timeout=60) == 0
    assert workers.forkserver_failure is not None and not workers.forking
    workers.reap(timeout_s=10)
    workers.close_forkserver()


def test_exec_start_method_trains_and_is_recorded(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_launch(["--nproc", "2", "--start-method", "exec", "--run-dir", str(run_dir), "--no-progress",
                       str(WORKERS / "hop_worker.py"), "--iterations", "5", "--dim", "100", "--compute-ms", "1"])
    assert proc.returncode == 0, proc.stderr
    record = json.loads((run_dir / "launch.json").read_text())
    assert record["start_method"] == "exec"
    assert sorted(record["worker_pids"]) == ["0", "1"]
    for pid in record["worker_pids"].values():
        assert not alive(pid)


def test_a_forked_worker_writing_to_a_closed_pipe_gets_an_error_not_a_silent_death(server: ForkServer,
                                                                                  tmp_path: Path) -> None:
    """As in a fresh interpreter, SIGPIPE stays ignored: the write raises BrokenPipeError."""
    script = tmp_path / "pipe.py"
    script.write_text("import os, sys\nr, w = os.pipe()\nos.close(r)\n"
                      "try:\n    os.write(w, b'x')\nexcept BrokenPipeError:\n    sys.exit(7)\n")
    worker = server.spawn(0, [str(script)], clean_env(), piped=True)
    assert worker.wait(timeout=60) == 7


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _start_coordinator(tmp_path: Path, server: ForkServer, relayed: list[bytes]) -> CoordinatorProcess:
    graph = tmp_path / "graph.json"
    Graph.ring(2).to_json(graph)
    config = ProtocolConfig(protocol="prague", group_generator="random").to_json()
    return CoordinatorProcess.start("prague random group generator", graph_path=str(graph), config_json=config,
                                    run_dir=str(tmp_path), bind_host="127.0.0.1", env=clean_env(), pass_fds=(),
                                    relay=relayed.append, forkserver=server)


def test_the_coordinator_forks_from_the_fork_server_and_execs_once_it_is_gone(server: ForkServer,
                                                                             tmp_path: Path) -> None:
    relayed: list[bytes] = []
    forked = _start_coordinator(tmp_path, server, relayed)
    try:
        assert forked.forked and forked.forkserver_failure is None
        assert _ppid(forked.pid) == server.pid and os.getsid(forked.pid) == forked.pid
        assert forked.address.startswith("tcp://127.0.0.1:") and forked.exited() is None
    finally:
        code = forked.stop(grace_s=20)
    assert code == 0  # SIGTERM: it wrote its summary and left the normal way
    logged = coordinator_records(tmp_path)
    assert logged[0]["event"] == "start" and logged[-1]["event"] == "stop"
    os.kill(server.pid, signal.SIGKILL)
    server.proc.wait(timeout=30)
    execd = _start_coordinator(tmp_path, server, relayed)
    try:
        assert not execd.forked and execd.forkserver_failure is not None
        assert _ppid(execd.pid) == os.getpid()
    finally:
        assert execd.stop(grace_s=20) == 0
    assert relayed == []  # nothing on its stderr: nothing relayed


def test_a_forked_coordinator_and_store_end_with_a_killed_launcher(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launcher = start_launch(["--protocol", "prague", "--group-generator", "random", "--nproc", "2",
                             "--run-dir", str(run_dir), "--no-progress", str(WORKERS / "prague_worker.py"),
                             "--iterations", "100000", "--compute-ms", "5"], new_session=True)
    coordinator = store = 0
    try:
        wait_until(lambda: len(coordinator_records(run_dir, "group")) >= 5, 120, interval=0.1,  # training through it
                   what="the workers to form 5 groups", while_running=launcher)
        record = json.loads((run_dir / "launch.json").read_text())
        coordinator, store = record["coordinator"]["pid"], record["store_pid"]
        assert record["start_method"] == "forkserver"
        assert _ppid(coordinator) == _ppid(store) == _ppid(record["worker_pids"]["0"]) != launcher.pid  # forked
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        wait_gone([coordinator, store], 5.0)
        assert coordinator_records(run_dir)[-1]["event"] == "stop"  # it got SIGTERM, not SIGKILL
    finally:
        for pid in (coordinator, store):
            if pid and alive(pid):
                os.killpg(pid, signal.SIGKILL)
        kill(launcher)


def test_a_store_that_dies_while_workers_run_fails_the_launch_in_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launcher = start_launch(["--nproc", "2", "--run-dir", str(run_dir), "--no-progress",
                             str(ROOT / "examples" / "train_digits.py"), "--iterations", "1000000"], new_session=True)
    try:
        wait_until(lambda: len(records(run_dir, 0, "iteration")) >= 5, 120, interval=0.1,
                   what="rank 0 to train", while_running=launcher)
        store = json.loads((run_dir / "launch.json").read_text())["store_pid"]
        os.killpg(store, signal.SIGKILL)
        out, err = launcher.communicate(timeout=120)
    finally:
        kill(launcher)
    assert launcher.returncode == 1
    assert "hopnet launch: the run's c10d store died (killed by SIGKILL); the workers waiting on it fail" in err, err
    assert all(not alive(pid) for pid in recorded_worker_pids(run_dir).values())


# ------------------------------------------------------------------ a warm template (forkserver_template)
INHERITED = """
import os, sys
os.write(int(sys.argv[1]), f"{os.getcwd()} {os.environ['MINE']}".encode())
"""


def test_a_fork_server_from_a_template_is_the_launchers_own(tmp_path: Path) -> None:
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    inherited = tmp_path / "inherited.py"
    inherited.write_text(INHERITED)
    read_end, write_end = os.pipe()
    with forkserver_template(clean_env()) as path:
        wait_until(Path(path).is_socket, 120, what=f"the template's socket at {path}")
        server = ForkServer(clean_env(**{TEMPLATE_VAR: path}, OMP_NUM_THREADS="1"), pass_fds=(write_end,))
        try:
            assert isinstance(server.proc, TemplateForked)
            assert _ppid(server.pid) not in (os.getpid(), 0, 1)  # the template's child, not ours
            assert os.getsid(server.pid) == server.pid  # a session of its own, as one started with exec
            worker, seen, err = _spawn(server, script, 0, "5", MINE="templated")
            assert worker.returncode == 5 and seen["ppid"] == server.pid and seen["mine"] == "templated"
            assert seen["threads"] == 1  # the launcher's OMP_NUM_THREADS, not the template's count (its cores)
            assert err == b"to stderr\n"
            # the launcher's descriptors at the same numbers, its directory and environment
            passed = server.spawn(1, [str(inherited), str(write_end)], clean_env(MINE="mine"), piped=False)
            assert passed.wait(timeout=60) == 0
            os.close(write_end)
            assert os.read(read_end, 4096).decode() == f"{os.getcwd()} mine"
        finally:
            server.close()
            os.close(read_end)
        assert server.proc.poll() is not None  # it ended with the launcher's socket


@contextlib.contextmanager
def _session_template() -> Iterator[str]:
    """The session's template (tests/conftest.py), or one of this test's own without it."""
    path = os.environ.get(TEMPLATE_VAR)
    if path and Path(path).is_socket():
        yield path
        return
    with forkserver_template(clean_env()) as path:
        wait_until(Path(path).is_socket, 120, what=f"the template's socket at {path}")
        yield path


def test_a_template_serves_only_launchers_in_its_own_control_groups() -> None:
    """A launcher inside a job's cgroup must get workers inside it: the cgroups are part of what a
    template and a launcher must share."""
    assert identity(os.environ)["cgroups"] == Path("/proc/self/cgroup").read_text()


@pytest.mark.parametrize("why", ["gone", "another-pythonpath"])
def test_without_a_fitting_template_the_launcher_starts_its_fork_server_itself(tmp_path: Path, why: str) -> None:
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    with _session_template() as path:
        env = clean_env(**{TEMPLATE_VAR: path})
        if why == "gone":
            env[TEMPLATE_VAR] = str(tmp_path / "no-template")
        else:
            env["PYTHONPATH"] += os.pathsep + str(tmp_path)
        server = ForkServer(env)
        try:
            assert isinstance(server.proc, subprocess.Popen)
            assert _ppid(server.pid) == os.getpid()
            worker, seen, _ = _spawn(server, script, 0, "0", MINE="exec")
            assert worker.returncode == 0 and seen["mine"] == "exec"
        finally:
            server.close()

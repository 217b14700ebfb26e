"""`hopnet launch`, the worker environment and the rendezvous, driven for real.

The launcher tests run the real CLI in a subprocess and check what actually happened:
the workers' output, the run directory, the exit status, and that no process is left.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hopnet.config import ProtocolConfig
from hopnet.errors import ConfigError, WaitTimeout
from hopnet.bootstrap.env import ENV_VARS, WorkerEnv
from hopnet.rendezvous.server import RendezvousServer
from hopnet.rendezvous.client import (
    RendezvousError,
    barrier,
    barrier_async,
    exchange_addresses,
    exchange_addresses_async,
    rendezvous_status,
)

from support.launch import run_launch, start_launch
from support.processes import wait_gone
from support.wait import WaitTimedOut, wait_until

REPO = Path(__file__).resolve().parent.parent
WORKER = str(Path(__file__).resolve().parent / "scripts" / "launch_worker.py")


def hopnet_launch(*args: str, cwd: Path, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return run_launch(args, cwd=cwd, timeout=timeout)


def _pids(pid_dir: Path) -> list[int]:
    return [int(p) for f in sorted(pid_dir.glob("rank*.pid")) for p in f.read_text().split()]


def _tagged(stdout: str, tag: str) -> dict[int, str]:
    """``{rank: payload}`` of the lines ``[rank R] TAG payload``."""
    found: dict[int, str] = {}
    for line in stdout.splitlines():
        head, _, rest = line.partition("] ")
        if rest.startswith(tag + " "):
            found[int(head.removeprefix("[rank "))] = rest[len(tag) + 1:]
    return found


# ------------------------------------------------------------------------------ launch
@pytest.mark.slow
def test_three_workers_exchange_addresses(tmp_path: Path) -> None:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = hopnet_launch("--graph", "ring:3", "--protocol", "notify-ack", WORKER, "--barrier",
                         "--pid-dir", str(pid_dir), "--lr", "0.1", "--nproc", "7", "--slow", "3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines and all(line.startswith(("[rank 0] ", "[rank 1] ", "[rank 2] ")) for line in lines), lines

    expected = {"0": "tcp://127.0.0.1:10000", "1": "tcp://127.0.0.1:10001", "2": "tcp://127.0.0.1:10002"}
    tables = _tagged(proc.stdout, "TABLE")
    assert sorted(tables) == [0, 1, 2]
    assert all(json.loads(t) == expected for t in tables.values())
    assert sorted(_tagged(proc.stdout, "BARRIER")) == [0, 1, 2]
    # the script's own flags pass through untouched, even ones the launcher also has, and prefixes
    # of the launcher's (--slow: --slowdown, --slow-filter)
    assert all(json.loads(a) == ["--lr", "0.1", "--nproc", "7", "--slow", "3"]
               for a in _tagged(proc.stdout, "ARGV").values())
    # worker stderr is prefixed too, on the launcher's stderr
    for rank in range(3):
        assert f"[rank {rank}] hello from stderr of {rank}" in proc.stderr.splitlines()

    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.endswith("-notify-ack-ring-3")
    assert (run_dir / "graph.json").is_file()
    info = json.loads((run_dir / "launch.json").read_text())
    assert info["world_size"] == 3
    assert info["config"]["protocol"] == "notify-ack"
    assert info["python"] == sys.executable
    assert info["result"]["returncode"] == 0
    for rank, text in _tagged(proc.stdout, "ENV").items():
        env = json.loads(text)
        assert env == {"rank": rank, "world_size": 3, "local_rank": rank, "graph": str(run_dir / "graph.json"),
                       "run_dir": str(run_dir), "bind": "127.0.0.1", "protocol": "notify-ack",
                       "unbuffered": "1"}
    assert str(run_dir) in proc.stderr.splitlines()[-1]  # the closing summary names the run dir
    wait_gone(_pids(pid_dir), 3.0)


@pytest.mark.slow
def test_failing_worker_stops_the_others(tmp_path: Path) -> None:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    start = time.monotonic()
    proc = hopnet_launch("--nproc", "3", "--run-dir", str(tmp_path / "run"), WORKER, "--pid-dir", str(pid_dir),
                         "--fail-rank", "1", "--fail-code", "3", "--sleep", "60", "--grandchild", cwd=tmp_path)
    assert time.monotonic() - start < 45  # the others (sleeping 60 s) were stopped, not waited out
    assert proc.returncode == 1, proc.stderr
    failure = [line for line in proc.stderr.splitlines() if line.startswith("hopnet launch: worker")]
    assert failure == ["hopnet launch: worker 1 failed (exit code 3)"]
    pids = _pids(pid_dir)
    assert len(pids) == 6  # three workers, each with a `sleep 60` child
    wait_gone(pids, 3.0)
    # the sleeping workers were asked to stop (SIGTERM) before anything harsher
    assert sorted(p.name for p in pid_dir.glob("*.sigterm")) == ["rank0.sigterm", "rank2.sigterm"]
    info = json.loads((tmp_path / "run" / "launch.json").read_text())
    assert info["result"]["failed_rank"] == 1 and info["result"]["reason"] == "exit code 3"


def _start_launcher(tmp_path: Path, *worker_args: str, grace: str = "5") -> tuple[subprocess.Popen[str], Path]:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = start_launch(["--nproc", "3", "--grace", grace, "--run-dir", str(tmp_path / "run"), WORKER,
                         "--pid-dir", str(pid_dir), "--sleep", "60", *worker_args], cwd=tmp_path)
    try:
        wait_until(lambda: len(list(pid_dir.glob("rank*.pid"))) >= 3, 60, what="the 3 workers' pid files",
                   while_running=proc)
    except WaitTimedOut:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"workers did not start:\n{out}\n{err}")
    return proc, pid_dir


@pytest.mark.slow
def test_sigterm_to_launcher_reaches_every_worker(tmp_path: Path) -> None:
    # rank 2 ignores SIGTERM: the launcher must SIGKILL it once the grace period is over
    proc, pid_dir = _start_launcher(tmp_path, "--ignore-sigterm-rank", "2", grace="1")
    time.sleep(0.2)  # let the workers install their handlers past the pid file
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=15)
    assert time.monotonic() - start < 30  # rank 2 (sleeping 60 s, deaf to SIGTERM) was killed, not waited out
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert f"hopnet launch: received SIGTERM, stopping 3 workers; run dir {tmp_path / 'run'}" in err.splitlines()
    assert "hopnet launch: killing workers 2 (still running after 1s)" in err.splitlines()
    assert sorted(p.name for p in pid_dir.glob("*.sigterm")) == [f"rank{r}.sigterm" for r in range(3)]
    wait_gone(_pids(pid_dir), 3.0)
    info = json.loads((tmp_path / "run" / "launch.json").read_text())
    assert info["result"]["reason"] == "interrupted by SIGTERM"
    assert info["result"]["worker_returncodes"] == {"0": 0, "1": 0, "2": -signal.SIGKILL}


BAD_INPUTS = [
    (["missing.py"], "script 'missing.py' not found"),
    (["--graph", "ring:4", "--nproc", "3", WORKER], "--nproc 3 does not match the graph ring:4 (4 nodes)"),
    (["--nproc", "3", "--slowdown", "rank=5:2", WORKER], "rank 5 out of range"),
    (["--graph", "bad.json", WORKER], "bad.json: not valid JSON"),
    (["--graph", "nosuch.json", WORKER], "nosuch.json"),
    (["--graph", "cube:3", WORKER], "unknown graph kind"),
    (["--slowdown", "bogus", WORKER], "bogus"),
]


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """Through a real `hopnet launch` process: exit status 2, one line, no traceback."""
    (tmp_path / "bad.json").write_text('{"nodes": 3, "edges": [[0, 1],')
    for args, needle in (BAD_INPUTS[0], BAD_INPUTS[3]):  # the rest run in-process below
        proc = hopnet_launch(*args, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert proc.stdout == ""
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("hopnet launch: error: "), proc.stderr
        assert needle in lines[0]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args, needle", BAD_INPUTS)
def test_bad_input_in_process(tmp_path: Path, args: list[str], needle: str, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    """The same through ``hopnet.cli.main.main`` in this process (cheaper: no interpreter start)."""
    from hopnet.cli.main import main

    (tmp_path / "bad.json").write_text('{"nodes": 3, "edges": [[0, 1],')
    monkeypatch.chdir(tmp_path)
    assert main(["launch", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hopnet launch: error: ") and needle in lines[0], captured.err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("kwargs, needle", [
    (dict(graph="nosuch.json"), "nosuch.json"),
    (dict(graph="cube:3"), "cube"),
    (dict(graph="ring:3", nproc=4), "--nproc 4 does not match"),
    (dict(config=ProtocolConfig(backup_workers="7:1")), "--backup-workers: rank 7"),
    (dict(bind=" "), "--bind"),
])
def test_launch_api_rejects_bad_input_before_starting(tmp_path: Path, kwargs: dict, needle: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from hopnet.launch import launch

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=needle):
        launch(WORKER, [], **kwargs)
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------- rendezvous
def test_rendezvous_timeout_names_the_rendezvous_and_missing_ranks() -> None:
    with RendezvousServer(3) as server:
        threading.Thread(target=lambda: pytest.raises(WaitTimeout, exchange_addresses, server.endpoint, 2, 3,
                                                      "tcp://b", 1.0), daemon=True).start()
        wait_until(lambda: server.registered_ranks() == [2], 10, interval=0.01, what="rank 2's registration")
        start = time.monotonic()
        with pytest.raises(WaitTimeout) as info:
            exchange_addresses(server.endpoint, 0, 3, "tcp://a", timeout_s=0.3)
        assert time.monotonic() - start < 10  # gave up after its 0.3 s, not the other rank's 1 s wait
    message = str(info.value)
    assert "rendezvous at " + server.endpoint in message
    assert "ranks that never registered: 1" in message
    assert info.value.waited_s is not None and info.value.waited_s >= 0.3


def test_rendezvous_timeout_without_a_server() -> None:
    with RendezvousServer(1) as server:
        endpoint = server.endpoint  # a port that was free a moment ago
    with pytest.raises(WaitTimeout, match="rendezvous .* does not answer"):
        exchange_addresses(endpoint, 0, 2, "tcp://a", timeout_s=0.2)


def test_rendezvous_refuses_bad_requests() -> None:
    with RendezvousServer(2) as server:
        with pytest.raises(RendezvousError, match="out of range"):
            exchange_addresses(server.endpoint, 5, 6, "tcp://a", timeout_s=2)
        with pytest.raises(RendezvousError, match="world size"):
            exchange_addresses(server.endpoint, 0, 3, "tcp://a", timeout_s=2)
        results: list[dict[int, str]] = []
        t = threading.Thread(target=lambda: results.append(
            exchange_addresses(server.endpoint, 0, 2, "tcp://a", timeout_s=5)))
        t.start()
        wait_until(lambda: server.registered_ranks() == [0], 10, interval=0.01, what="rank 0's registration")
        with pytest.raises(RendezvousError, match="rank 0 registered twice"):
            exchange_addresses(server.endpoint, 0, 2, "tcp://other", timeout_s=2)
        assert exchange_addresses(server.endpoint, 1, 2, "tcp://b", timeout_s=2) == {0: "tcp://a", 1: "tcp://b"}
        t.join(5)
        assert results == [{0: "tcp://a", 1: "tcp://b"}]
        assert rendezvous_status(server.endpoint)["complete"] is True
    with pytest.raises(ConfigError):
        exchange_addresses("not-an-endpoint", 0, 1, "tcp://a", timeout_s=1)


async def test_async_exchange_and_barrier() -> None:
    with RendezvousServer(3) as server:
        tables = await asyncio.gather(*(exchange_addresses_async(server.endpoint, r, 3, f"tcp://h:{r}", 5)
                                        for r in range(3)))
        assert all(t == {0: "tcp://h:0", 1: "tcp://h:1", 2: "tcp://h:2"} for t in tables)
        await asyncio.gather(*(barrier_async(server.endpoint, r, "end", 5) for r in range(3)))
        with pytest.raises(WaitTimeout, match="barrier 'late' .* never arrived: 1, 2"):
            await barrier_async(server.endpoint, 0, "late", 0.2)
        with pytest.raises(WaitTimeout, match="never registered: 1"):
            # a fresh server: the async variant names the missing ranks too
            with RendezvousServer(2) as other:
                await exchange_addresses_async(other.endpoint, 0, 2, "tcp://a", 0.2)


def test_sync_barrier_waits_for_everyone() -> None:
    with RendezvousServer(2) as server:
        done: list[float] = []
        t = threading.Thread(target=lambda: (barrier(server.endpoint, 0, "b", 5), done.append(time.monotonic())))
        t.start()
        time.sleep(0.2)
        assert done == []
        barrier(server.endpoint, 1, "b", 5)
        t.join(5)
        assert len(done) == 1


# ------------------------------------------------------------------------ environment
def _worker_env(**changes: object) -> WorkerEnv:
    values: dict[str, object] = dict(rank=1, world_size=3, local_rank=1, graph_path="/r/graph.json",
                                     rendezvous="tcp://127.0.0.1:5555", run_dir="/r",
                                     config_json=ProtocolConfig(max_ig=3).to_json(), bind_host="127.0.0.1",
                                     node_rank=0)
    values.update(changes)
    return WorkerEnv(**values)  # type: ignore[arg-type]


def test_worker_env_round_trip() -> None:
    env = _worker_env()
    environ = env.to_environ()
    assert set(environ) == set(ENV_VARS)
    assert all(isinstance(v, str) for v in environ.values())
    assert WorkerEnv.from_environ(environ) == env
    assert env.config().max_ig == 3
    assert WorkerEnv.from_environ({"PATH": "/bin"}) is None


@pytest.mark.parametrize("name, value, needle", [
    ("HOPNET_RANK", "x", "HOPNET_RANK"),
    ("HOPNET_RANK", "3", "HOPNET_RANK=3 is out of range"),
    ("HOPNET_WORLD_SIZE", "0", "HOPNET_WORLD_SIZE"),
    ("HOPNET_LOCAL_RANK", "-1", "HOPNET_LOCAL_RANK"),
    ("HOPNET_RENDEZVOUS", "localhost:5", "HOPNET_RENDEZVOUS"),
    ("HOPNET_CONFIG", "{nope", "HOPNET_CONFIG"),
    ("HOPNET_GRAPH", None, "HOPNET_GRAPH"),
])
def test_worker_env_names_the_bad_variable(name: str, value: str | None, needle: str) -> None:
    environ = _worker_env().to_environ()
    if value is None:
        del environ[name]
    else:
        environ[name] = value
    with pytest.raises(ConfigError, match=needle):
        WorkerEnv.from_environ(environ)

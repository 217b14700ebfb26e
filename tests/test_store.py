"""The run's c10d store: hosted by `hopnet launch`, opened by workers, shut down with the run."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from hopnet.errors import ConfigError, HopnetError
from hopnet.bootstrap.env import STORE, WorkerEnv
from hopnet.rendezvous.store import connect_store, host_store, parse_endpoint

from support.paths import WORKERS
from support.launch import run_launch


def _refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1.0).close()
    except OSError:
        return True
    return False


@pytest.mark.slow
def test_launch_hosts_a_store_every_worker_reaches_and_shuts_it_down(tmp_path: Path) -> None:
    proc = run_launch(["--graph", "ring:3", "--run-dir", str(tmp_path / "run"),
                       str(WORKERS / "store_worker.py")], timeout=120)
    assert proc.returncode == 0, proc.stderr
    found = {}
    for line in proc.stdout.splitlines():
        head, _, rest = line.partition("] ")
        if rest.startswith("STORE "):
            found[int(head.removeprefix("[rank "))] = json.loads(rest[len("STORE "):])
    assert sorted(found) == [0, 1, 2]
    assert all(f["values"] == [0, 10, 20] for f in found.values())  # every rank saw every other's key
    endpoint = json.loads((tmp_path / "run" / "launch.json").read_text())["store"]
    assert {f["endpoint"] for f in found.values()} == {endpoint}
    assert _refused(*parse_endpoint(endpoint))  # gone with the launcher


def test_unreachable_store_fails_naming_it_instead_of_hanging() -> None:
    hosted = host_store("127.0.0.1")
    endpoint = hosted.endpoint
    hosted.close()
    started = time.monotonic()
    with pytest.raises(HopnetError, match=rf"c10d store at {endpoint} is unreachable"):
        connect_store(endpoint, timeout_s=1.0)
    assert time.monotonic() - started < 30  # a bound far above 1 s: it gave up, it did not hang


def test_hosted_store_serves_clients_until_closed() -> None:
    hosted = host_store("127.0.0.1")
    client = connect_store(hosted.endpoint, timeout_s=10)
    client.set("k", "v")
    assert client.get("k") == b"v"
    del client
    hosted.close()
    assert _refused("127.0.0.1", hosted.port)


def test_store_endpoint_travels_in_the_worker_env() -> None:
    env = WorkerEnv(rank=1, world_size=2, local_rank=1, graph_path="g.json", rendezvous="tcp://127.0.0.1:5",
                    run_dir="r", config_json="{}", store="127.0.0.1:29500")
    environ = env.to_environ()
    assert environ[STORE] == "127.0.0.1:29500"
    assert WorkerEnv.from_environ(environ) == env
    del environ[STORE]
    assert WorkerEnv.from_environ(environ).store == ""


@pytest.mark.parametrize("value", ["nohost", "127.0.0.1:port", "127.0.0.1:0", ":29500"])
def test_bad_store_endpoint_is_named(value: str) -> None:
    environ = {"HOPNET_RANK": "0", "HOPNET_WORLD_SIZE": "1", "HOPNET_GRAPH": "g.json",
               "HOPNET_RENDEZVOUS": "tcp://127.0.0.1:5", STORE: value}
    with pytest.raises(ConfigError, match="HOPNET_STORE"):
        WorkerEnv.from_environ(environ)

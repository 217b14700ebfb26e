"""`hopnet join`: start workers that join a running elastic run.

The run's rendezvous hands out new ranks and what their workers need (the command, the
protocol's configuration, the elastic settings); each worker then asks the members to admit it
(:mod:`hopnet.elastic`). `hopnet join` watches its workers as `hopnet launch` does its own: it
passes a SIGINT or SIGTERM on, and exits with the first failure's status, else 0."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

from hopnet.bootstrap.env import ELASTIC, JOIN, RUN_DIR, STORE, WorkerEnv
from hopnet.bootstrap.parent_watch import LAUNCHER_PID, PARENT_FD
from hopnet.errors import ConfigError
from hopnet.graph import Graph
from hopnet.launch import forkserver
from hopnet.launch.forkserver import ForkServer
from hopnet.launch.processes import WorkerProcesses
from hopnet.launch.spec import WORKER_ENTRY
from hopnet.replica.layout import REPLICA_SIZE
from hopnet.rendezvous.client import request_join
from hopnet.security import KEY_ENV, CurveKeys, load_key_file

REQUEST_TIMEOUT_S = 10.0


def _run_facts(run_dir: Path, rendezvous: str | None) -> tuple[str, str | None, dict[str, Any]]:
    """The rendezvous, the launcher's working directory, and the run's launch.json (if here)."""
    record: dict[str, Any] = {}
    path = run_dir / "launch.json"
    if path.is_file():
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from None
    endpoint = rendezvous or record.get("rendezvous")
    if not endpoint:
        raise ConfigError(f"{run_dir} holds no launch.json of a running run: give the run's --rendezvous")
    if record.get("result") is not None:
        raise ConfigError(f"the run in {run_dir} has ended ({record['result'].get('summary') or 'finished'})")
    return str(endpoint), record.get("cwd"), record


def join_run(run_dir: str | os.PathLike[str], nproc: int, *, rendezvous: str | None = None,
             key_file: str | os.PathLike[str] | None = None, bind: str | None = None) -> int:
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc}: add at least 1 worker")
    directory = Path(run_dir)
    endpoint, cwd, record = _run_facts(directory, rendezvous)
    keys: CurveKeys | None = load_key_file(key_file) if key_file is not None else None
    if keys is None and record.get("security") == "curve":
        raise ConfigError("the run is secured with a run key: give its --key-file")
    size = _replica_size(record)
    if nproc % size:
        raise ConfigError(f"--nproc {nproc}: the run's replica groups have {size} processes each, and a replica "
                          f"joins whole: give a multiple of {size}")
    reply = request_join(endpoint, nproc, REQUEST_TIMEOUT_S, keys)
    info = reply["info"]
    size = int(info.get("env", {}).get(REPLICA_SIZE, size))
    ranks = [int(r) for r in reply["ranks"]]
    directory.mkdir(parents=True, exist_ok=True)
    graph_path, written = _first_graph(directory, info.get("graph"))
    base = dict(os.environ)
    base.update({str(k): str(v) for k, v in info.get("env", {}).items()})
    # the joiners end when this process does, as a launcher's workers do (hopnet.bootstrap.parent_watch)
    watch_read, watch_write = os.pipe()
    base[PARENT_FD], base[LAUNCHER_PID] = str(watch_read), str(os.getpid())
    if keys is not None:
        base[KEY_ENV] = keys.to_text()
    # the configuration the first workers registered; before they have, the launcher's
    agreed = reply.get("config") or info.get("config")
    config_json = json.dumps(agreed) if agreed else base.get("HOPNET_CONFIG", "{}")
    print(f"hopnet join: starting rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
          f"for the run in {directory}", file=sys.stderr)
    # Forked from a fork server that imported torch and hopnet once (from a template where one runs),
    # as a launcher's workers are; exec'd where none can start.
    server = ForkServer({**base, RUN_DIR: str(directory)}, pass_fds=(watch_read,)) if forkserver.available() else None
    workers = WorkerProcesses(None, None, forkserver=server, fork_entry=WORKER_ENTRY)
    workdir = cwd if cwd and os.path.isdir(cwd) else None
    watching = False
    try:
        for local, rank in enumerate(ranks):
            # (a replica's processes count whole replicas: the world's size is a multiple of the replica's)
            worker = WorkerEnv(rank=rank, world_size=(rank // size + 1) * size, local_rank=local,
                               graph_path=graph_path, rendezvous=endpoint, run_dir=str(directory),
                               config_json=config_json, bind_host=bind or info.get("bind", "127.0.0.1"),
                               explicit_options=tuple(info.get("explicit", ())), store=base.get(STORE, ""))
            env = {**base, **worker.to_environ(), ELASTIC: info["elastic"], JOIN: ",".join(map(str, ranks))}
            workers.spawn(rank, list(info["command"]), env, pass_fds=(watch_read,), cwd=workdir)
        if workers.forkserver_failure is not None:
            print(f"hopnet join: {workers.forkserver_failure}; workers started with exec", file=sys.stderr)
        os.close(watch_read)
        watching = True
        return _watch(workers, ranks)
    finally:
        if not watching:
            os.close(watch_read)
        workers.reap()
        workers.close_forkserver()
        os.close(watch_write)
        if written:
            os.unlink(graph_path)


def _replica_size(record: dict[str, Any]) -> int:
    """The processes of each replica group, by the run's launch.json (1 when it names none)."""
    replicas = record.get("replicas")
    return int(replicas["size"]) if isinstance(replicas, dict) and isinstance(replicas.get("size"), int) else 1


def _first_graph(directory: Path, graph: Any) -> tuple[str, bool]:
    """The run's first graph, which a joiner's worker reads as the first workers did: the run
    directory's ``graph.json``, or, in a directory on another machine, a file written here from
    what the rendezvous served (True: remove it at the end), kept out of that directory, whose
    logs are the joiners' alone."""
    path = directory / "graph.json"
    if path.exists() or not isinstance(graph, dict):
        return str(path), False
    fd, name = tempfile.mkstemp(prefix="hopnet-join-graph-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(Graph.from_dict(graph).to_json())
    return name, True


def _watch(workers: WorkerProcesses, ranks: list[int]) -> int:
    """Wait for the joiners; pass a SIGINT/SIGTERM on to them; the first failure's status, else 0."""
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        workers.signal_all(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    codes: dict[int, int] = {}
    try:
        while len(codes) < len(ranks):
            exited = workers.next_exit()
            if exited is None:
                continue
            rank, code = exited
            codes[rank] = code
            what = "exited 0" if code == 0 else (f"killed by signal {-code}" if code < 0 else f"exited {code}")
            print(f"hopnet join: rank {rank} {what}", file=sys.stderr)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received:
        return 128 + received[0]
    failed = [c for c in codes.values() if c != 0]
    return (failed[0] if failed[0] > 0 else 128 - failed[0]) if failed else 0

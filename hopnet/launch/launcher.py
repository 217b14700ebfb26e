"""`hopnet launch`: start one worker process per node of the graph on this machine.

The launcher

* resolves the graph (a JSON file or a builder spec such as ``ring:4``) and the
  protocol configuration, and checks the options against the graph
  (:mod:`hopnet.config_checks`) before anything is created;
* creates the run directory (refusing one that holds a run, see
  :mod:`hopnet.launch.run_dir`) and writes ``graph.json`` and ``launch.json`` into it;
* sets ``OMP_NUM_THREADS`` for the workers (:mod:`hopnet.launch.threads`);
* runs the rendezvous server (:mod:`hopnet.launch.rendezvous`) in a thread;
* starts ``python SCRIPT ARGS...`` once per rank with the ``HOPNET_*`` variables of
  :mod:`hopnet.launch.env`, through :mod:`hopnet.launch.worker_main` (exit statuses,
  ordered shutdown, the launcher watch of :mod:`hopnet.launch.parent_watch`), each
  worker in a session of its own, so a Ctrl-C on the terminal reaches the launcher
  only, which sends SIGTERM to every worker's process group (workers leave quietly on it);
* prints each worker's output line by line, prefixed ``[rank R] ``;
* stops every worker when more than ``max_failures`` fail or when the launcher is
  signalled (SIGTERM, then SIGKILL after a grace period), names the rank at the root of
  a failure (:mod:`hopnet.launch.blame`), and leaves no process behind;
* prints and records the protocol options that run, once the rendezvous has them;
* secures the run's ZeroMQ sockets with CurveZMQ when they leave loopback (or with
  ``secure``/``key_file``): it makes or reads the run key (:mod:`hopnet.security`),
  serves the rendezvous with it and hands it to the workers in ``HOPNET_CURVE_KEY``.

Multi-host runs (``nnodes``/``node_rank``/``rdzv_endpoint``): one launcher per machine
runs the ranks :func:`hopnet.launch.nodes.place_ranks` gives its machine (:class:`NodePlan`);
node 0's launcher hosts the launchers' store at ``rdzv_endpoint`` (also the run's c10d
store) and the rendezvous server, and publishes the run there; a failure beyond
``max_failures`` anywhere is written to the store and every launcher stops its workers
(:mod:`hopnet.launch.nodes`).
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from hopnet.config import ProtocolConfig
from hopnet.config_checks import check_config_for_graph
from hopnet.errors import ConfigError
from hopnet.graph import Graph
from hopnet.coordinator import make_coordinator
from hopnet.launch import parent_watch
from hopnet.launch.coordinator_proc import CoordinatorProcess, CoordinatorStartError
from hopnet.launch.blame import Blame, RankEnd, explain, read_log_facts
from hopnet.launch.blame import describe_exit as _describe_exit
from hopnet.launch.env import DEFAULT_BIND, STORE, WorkerEnv
from hopnet.launch.options import describe, differences, option_names
from hopnet.launch.rendezvous import RendezvousServer
from hopnet.report.live import LaunchProgress  # [report]
from hopnet.launch.run_dir import clear_previous_run
from hopnet.launch.threads import limit_worker_threads
from hopnet.launch.nodes import LaunchGroup, place_ranks
from hopnet.launch.store import HostedStore, host_store, parse_endpoint
from hopnet.security import KEY_ENV, is_loopback, resolve_run_key

DEFAULT_NPROC = 4
DEFAULT_GRACE_S = 5.0
DEFAULT_SETTLE_S = 1.5
"""After the first failure, how long the other workers may end on their own before being stopped."""
WORKER_ENTRY = (sys.executable, "-m", "hopnet.launch.worker_main")
"""Every worker runs its script through :mod:`hopnet.launch.worker_main`."""
RUNS_DIR = "runs"
_POLL_S = 0.05
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "")
JOIN_TIMEOUT_S = 300.0
"""How long a launcher of node R > 0 waits for node 0's launcher."""
ABORT_POLL_S = 0.25
"""How often a launcher of a multi-machine run looks for another machine's abort."""
FINISH_WAIT_S = 30.0
"""How long node 0's launcher keeps the launchers' store up for the others' end."""
REMOTE_BLAME_WAIT_S = 3.0
"""How long a launcher whose workers failed because of a peer on another machine waits
for that machine's launcher to name the root cause before naming its own."""


@dataclass
class LaunchResult:
    """How a launch ended. ``returncode`` is what `hopnet launch` exits with."""

    returncode: int
    run_dir: str
    failed_rank: int | None = None
    reason: str | None = None
    """``"exit code C"`` / ``"killed by SIGNAME"`` for a failed worker, ``"interrupted by SIGNAME"``
    when the launcher was signalled, ``None`` on success."""
    worker_returncodes: dict[int, int | None] = field(default_factory=dict)
    wall_s: float = 0.0
    summary: str | None = None
    """The line naming what went wrong (the rank at the root of a failure), or the lost ranks."""
    lost_ranks: list[int] = field(default_factory=list)
    """Ranks that failed (with ``max_failures``, possibly while the run still succeeded)."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0


# ------------------------------------------------------------------------ resolution
def resolve_graph(graph: Graph | str | os.PathLike[str] | None, nproc: int | None) -> tuple[Graph, int]:
    """The graph and the number of workers, checked against each other.

    ``graph`` is a :class:`Graph`, a JSON path, a builder spec (``ring:4``), or ``None``
    for a ring over ``nproc`` workers (``nproc`` defaults to the graph's size, or 4).
    """
    if nproc is not None and (not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1):
        raise ConfigError(f"--nproc must be an integer >= 1 (got {nproc!r})")
    if graph is None:
        n = DEFAULT_NPROC if nproc is None else nproc
        return Graph.ring(n), n
    if isinstance(graph, Graph):
        g = graph
        label = g.name or "the graph"
    else:
        label = os.fspath(graph)
        g = Graph.load(label)
    if nproc is not None and nproc != g.n:
        raise ConfigError(f"--nproc {nproc} does not match the graph {label} ({g.n} nodes)")
    return g, g.n


def _slug(text: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9_.]+", "-", text).strip("-.")
    return slug or "graph"


def graph_label(graph: Graph, spec: Graph | str | os.PathLike[str] | None) -> str:
    """A short name for run directories: the graph's name, else the file's stem."""
    if graph.name:
        return _slug(graph.name)
    if spec is not None and not isinstance(spec, Graph):
        return _slug(Path(os.fspath(spec)).stem)
    return f"graph{graph.n}"


def make_run_dir(run_dir: str | os.PathLike[str] | None, protocol: str, label: str,
                 base: str | os.PathLike[str] = RUNS_DIR) -> Path:
    """Create and return the run directory: ``run_dir`` as given, or a fresh
    ``runs/<YYYYmmdd-HHMMSS>-<protocol>-<graph>`` (suffixed ``-2``, ``-3``... if taken)."""
    if run_dir is not None:
        path = Path(run_dir)
        if path.exists() and not path.is_dir():
            raise ConfigError(f"--run-dir {os.fspath(run_dir)!r} exists and is not a directory")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--run-dir {os.fspath(run_dir)!r}: {exc.strerror or exc}") from None
        return path.resolve()
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    stem = f"{stamp}-{_slug(protocol)}-{label}"
    base_path = Path(base)
    try:
        base_path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {os.fspath(base_path)!r}: {exc.strerror or exc}") from None
    for attempt in range(1, 1000):
        path = base_path / (stem if attempt == 1 else f"{stem}-{attempt}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        except OSError as exc:
            raise ConfigError(f"cannot create run directory {os.fspath(path)!r}: {exc.strerror or exc}") from None
        return path.resolve()
    raise ConfigError(f"cannot find a free run directory name under {os.fspath(base_path)!r}")


def _worker_pythonpath(environ: Mapping[str, str]) -> str:
    """PYTHONPATH for workers: this hopnet's parent directory first, so workers import the
    same hopnet as the launcher even when it is not installed."""
    import hopnet

    root = str(Path(hopnet.__file__).resolve().parent.parent)
    parts = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        parts.insert(0, root)
    return os.pathsep.join(parts)


@dataclass(frozen=True)
class NodePlan:
    """The ranks this launcher runs: ``rank_offset .. rank_offset + nproc - 1`` of ``world_size``,
    or the ranks ``placed`` on this machine (see :func:`hopnet.launch.nodes.place_ranks`).

    With one machine ``rank_offset`` is 0 and ``nproc == world_size``.
    """

    world_size: int
    nproc: int
    node_rank: int = 0
    rank_offset: int = 0
    placed: tuple[int, ...] | None = None

    @property
    def ranks(self) -> Sequence[int]:
        if self.placed is not None:
            return self.placed
        return range(self.rank_offset, self.rank_offset + self.nproc)

    def worker_env(self, rank: int, *, graph_path: str, rendezvous: str, run_dir: str,
                   config_json: str, bind: str, explicit_options: tuple[str, ...] = ()) -> WorkerEnv:
        return WorkerEnv(rank=rank, world_size=self.world_size, local_rank=list(self.ranks).index(rank),
                         graph_path=graph_path, rendezvous=rendezvous, run_dir=run_dir,
                         config_json=config_json, bind_host=bind, node_rank=self.node_rank,
                         explicit_options=explicit_options)


# --------------------------------------------------------------------------- output
class _Output:
    """Writes whole lines to a stream under a lock, flushing each one."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.lock = threading.Lock()
        self.muted = False

    def write(self, data: bytes) -> None:
        with self.lock:
            if self.muted:
                return
            try:
                buffer = getattr(self.stream, "buffer", None)
                if buffer is not None:
                    self.stream.flush()
                    buffer.write(data)
                    buffer.flush()
                else:
                    self.stream.write(data.decode("utf-8", errors="replace"))
                    self.stream.flush()
            except (BrokenPipeError, ValueError, OSError):
                pass  # our own output is gone (closed pipe): keep draining the worker


def _pump(pipe: IO[bytes], prefix: bytes, out: _Output) -> None:
    """Copy ``pipe`` to ``out`` line by line with ``prefix`` until EOF."""
    try:
        for line in iter(pipe.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            out.write(prefix + line)
    except (OSError, ValueError):
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# --------------------------------------------------------------------------- workers
class _Workers:
    """The worker processes of one launch, their output pumps and their waiters."""

    def __init__(self, out: _Output | None, err: _Output | None) -> None:
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.exits: queue.Queue[tuple[int, int]] = queue.Queue()
        self.returncodes: dict[int, int | None] = {}
        self.out = out
        self.err = err
        self.threads: list[threading.Thread] = []

    def spawn(self, rank: int, argv: list[str], env: dict[str, str], pass_fds: Sequence[int] = ()) -> None:
        piped = self.out is not None
        proc = subprocess.Popen(
            argv,
            env=env,
            pass_fds=tuple(pass_fds),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if piped else None,
            stderr=subprocess.PIPE if piped else None,
            start_new_session=True,  # own session and process group: we forward signals ourselves
        )
        self.procs[rank] = proc
        self.returncodes[rank] = None
        if piped:
            prefix = f"[rank {rank}] ".encode()
            assert proc.stdout is not None and proc.stderr is not None and self.err is not None
            for pipe, target in ((proc.stdout, self.out), (proc.stderr, self.err)):
                t = threading.Thread(target=_pump, args=(pipe, prefix, target),
                                     name=f"hopnet-pump-{rank}", daemon=True)
                t.start()
                self.threads.append(t)
        waiter = threading.Thread(target=self._wait, args=(rank, proc), name=f"hopnet-wait-{rank}", daemon=True)
        waiter.start()

    def _wait(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        self.exits.put((rank, code))

    def mute(self) -> None:
        """Stop relaying the workers' output (it is still drained)."""
        for out in (self.out, self.err):
            if out is not None:
                out.muted = True

    def running(self) -> list[int]:
        return [r for r, p in self.procs.items() if p.returncode is None]

    def signal_all(self, signum: int) -> None:
        """Send ``signum`` to the process group of every worker still running."""
        for rank, proc in self.procs.items():
            if proc.returncode is None:
                _killpg(proc.pid, signum)

    def sweep(self) -> None:
        """SIGKILL whatever is left in the workers' process groups (orphaned children)."""
        for proc in self.procs.values():
            _killpg(proc.pid, signal.SIGKILL)

    def drain(self, timeout_s: float) -> None:
        """Wait for the output pumps to reach EOF (bounded: a stray process may hold a pipe)."""
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))


def _killpg(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


class _SignalTrap:
    """Turns SIGINT/SIGTERM/SIGHUP into a flag while workers run (main thread only)."""

    SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)

    def __init__(self) -> None:
        self.received: list[int] = []
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _SignalTrap:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                try:
                    self._old[s] = signal.signal(s, self._handle)
                except (OSError, ValueError):
                    pass
        return self

    def _handle(self, signum: int, frame: object) -> None:
        self.received.append(signum)  # list.append is atomic; no locks in a signal handler

    def __exit__(self, *exc: object) -> None:
        for s, old in self._old.items():
            try:
                signal.signal(s, old)
            except (OSError, ValueError):
                pass
        self._old.clear()


# ---------------------------------------------------------------------------- launch
def _log(err: IO[str], text: str) -> None:
    try:
        print(f"hopnet launch: {text}", file=err, flush=True)
    except (OSError, ValueError):
        pass


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)



def _collect_exit(workers: _Workers, pending: set[int]) -> tuple[int, int] | None:
    """Wait up to one poll interval for a worker to exit; record it and return (rank, code)."""
    try:
        rank, code = workers.exits.get(timeout=_POLL_S)
    except queue.Empty:
        return None
    workers.returncodes[rank] = code
    pending.discard(rank)
    return rank, code

def launch(
    script: str | os.PathLike[str],
    script_args: Sequence[str] = (),
    graph: Graph | str | os.PathLike[str] | None = None,
    config: ProtocolConfig | None = None,
    nproc: int | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    bind: str = DEFAULT_BIND,
    prefix: bool = True,
    env_extra: Mapping[str, str] | None = None,
    *,
    module: bool = False,
    grace_s: float = DEFAULT_GRACE_S,
    argv: Sequence[str] | None = None,
    overwrite: bool = False,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    max_failures: int = 0,
    explicit_options: Collection[str] = (),
    settle_s: float = DEFAULT_SETTLE_S,
    progress: bool = True,  # [report] live status line on a terminal
    insecure: bool = False,
    secure: bool = False,
    key_file: str | os.PathLike[str] | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
) -> LaunchResult:
    """Run ``python SCRIPT ARGS...`` once per rank of ``graph`` and wait for all of them.

    Raises :class:`ConfigError` for bad inputs before starting anything. Returns a
    :class:`LaunchResult`: ``returncode`` 0 when every worker exited 0, or when at most
    ``max_failures`` workers failed and every other one finished; 1 when more failed
    (the others are then stopped, and :attr:`LaunchResult.summary` names the rank that
    caused it); ``128 + signal`` when the launcher was signalled.
    With ``module=True`` the script is a module name run as ``python -m MODULE``.
    ``prefix=False`` lets workers write straight to the launcher's stdout/stderr.
    ``explicit_options`` names the protocol options the user gave explicitly (code in the
    workers may set only the others); ``settle_s`` is how long the launcher lets the other
    workers end on their own after a failure before it stops them, to see who blames whom.
    ``progress`` shows a live status line when stderr or stdout is a terminal (and ``prefix``).
    A ``run_dir`` that already holds a run is refused unless ``overwrite`` (which removes
    that run's hopnet files, see :mod:`hopnet.launch.run_dir`).
    Sockets bound to anything but loopback use CurveZMQ with a key made for the run, or
    read from ``key_file``; ``secure`` uses it on loopback too; ``insecure`` turns it off
    (with a warning when ``bind`` is not loopback).
    With ``nnodes > 1`` this is one of ``nnodes`` launchers, one per machine: it runs the
    ranks placed on machine ``node_rank`` (:mod:`hopnet.launch.nodes`); node 0's launcher
    hosts the launchers' store at ``rdzv_endpoint`` (``HOST:PORT``, reachable from every
    machine) and the rendezvous; a failure anywhere stops every machine's workers.
    """
    out_stream = stdout if stdout is not None else sys.stdout
    err_stream = stderr if stderr is not None else sys.stderr
    config = config if config is not None else ProtocolConfig()
    if not isinstance(config, ProtocolConfig):
        raise ConfigError(f"config must be a ProtocolConfig (got {type(config).__name__})")
    config.validate()

    script_text = os.fspath(script)
    if module:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", script_text):
            raise ConfigError(f"-m {script_text!r}: not a module name")
        command = [*WORKER_ENTRY, "-m", script_text, *script_args]
    else:
        if not os.path.exists(script_text):
            raise ConfigError(f"script {script_text!r} not found")
        if os.path.isdir(script_text) and not os.path.exists(os.path.join(script_text, "__main__.py")):
            raise ConfigError(f"script {script_text!r} is a directory without __main__.py")
        command = [*WORKER_ENTRY, script_text, *script_args]
    if not isinstance(bind, str) or not bind.strip():
        raise ConfigError(f"--bind {bind!r}: expected a host name or address")
    bind = bind.strip()
    if grace_s < 0:
        raise ConfigError(f"grace period must be >= 0 (got {grace_s})")
    unknown = sorted(set(explicit_options) - set(option_names()))
    if unknown:
        raise ConfigError(f"explicit_options: {unknown[0]!r} is not a protocol option")

    g, world_size = resolve_graph(graph, nproc)
    notes = check_config_for_graph(config, g)  # before the run directory exists: a refusal leaves nothing
    machine = make_coordinator(config, g)  # the protocol's coordinator, if it needs one (refusals first too)
    coordinator_name = machine.name if machine is not None else None
    if not isinstance(max_failures, int) or isinstance(max_failures, bool) or not 0 <= max_failures < world_size:
        raise ConfigError(f"--max-failures must be an integer from 0 to {world_size - 1} "
                          f"(there are {world_size} workers; got {max_failures!r})")
    group: LaunchGroup | None = None
    published: dict[str, Any] = {}
    if nnodes == 1 and node_rank == 0 and rdzv_endpoint is None:
        plan = NodePlan(world_size=world_size, nproc=world_size)
    else:
        if rdzv_endpoint is None:
            raise ConfigError("--nnodes above 1 needs --rdzv-endpoint HOST:PORT (node 0's address, "
                              "reachable from every machine)")
        placed = tuple(place_ranks(g, nnodes, node_rank))
        plan = NodePlan(world_size=world_size, nproc=len(placed), node_rank=node_rank, placed=placed)
        group = LaunchGroup(nnodes=nnodes, node_rank=node_rank, endpoint=rdzv_endpoint)
        if node_rank > 0:
            try:
                published = group.await_run(JOIN_TIMEOUT_S)
            except BaseException:
                group.finish(0.0)
                raise
            if published["world_size"] != world_size or published["config"] != json.loads(config.to_json()):
                group.finish(0.0)
                raise ConfigError(f"node {node_rank}'s graph or options differ from node 0's "
                                  f"(node 0 runs {published['describe']} on {published['world_size']} workers)")
    security = resolve_run_key(bind, insecure=insecure, secure=secure, key_file=key_file)
    if group is not None and security.keys is not None and key_file is None:
        # the launchers' store is not encrypted: the run key never travels through it
        group.finish(0.0)
        raise ConfigError("several machines with CurveZMQ need the same --key-file on every machine "
                          "(make one with `hopnet keygen PATH`), or --insecure on a trusted network")

    cleared = clear_previous_run(run_dir, overwrite) if run_dir is not None else None
    path = make_run_dir(run_dir, config.protocol, graph_label(g, graph))
    if cleared:
        _log(err_stream, cleared)
    if security.warning:
        _log(err_stream, f"warning: {security.warning}")
    if security.keys is not None and not is_loopback(bind) and config.bulk != "zmq":
        _log(err_stream, f"note: CurveZMQ covers the ZeroMQ sockets; the c10d store and the --bulk {config.bulk} "
                         "torch plane (gloo/NCCL) are not encrypted (use --bulk zmq on untrusted networks)")
    for note in notes:
        _log(err_stream, f"note: {note}")
    graph_path = path / "graph.json"
    g.to_json(graph_path)
    started_at = datetime.now(timezone.utc)
    launch_info: dict[str, Any] = {
        "argv": list(argv) if argv is not None else list(sys.argv),
        "command": command,
        "script": script_text,
        "script_args": list(script_args),
        "module": module,
        "config": json.loads(config.to_json()),
        "config_flags": json.loads(config.to_json()),
        "config_source": "flags",
        "explicit_options": sorted(explicit_options),
        "max_failures": max_failures,
        "graph": graph.name if isinstance(graph, Graph) else (os.fspath(graph) if graph is not None else None),
        "graph_name": g.name,
        "world_size": world_size,
        "nproc": plan.nproc,
        "node_rank": plan.node_rank,
        "nnodes": nnodes,
        "ranks": list(plan.ranks),
        "bind": bind,
        "security": "curve" if security.keys is not None else "plain",
        "security_source": security.source,
        "start_time": started_at.isoformat(timespec="seconds"),
        "python": sys.executable,
        "hostname": socket.gethostname(),
        "cwd": os.getcwd(),
        "launcher_pid": os.getpid(),
    }

    # [report] live status line and end-of-run summary (hopnet.report.live); while the line is up,
    # worker output and launcher messages go through its console, above it.
    view = LaunchProgress(path, list(plan.ranks), out_stream, err_stream, live=progress and prefix)
    out_stream, err_stream = view.stdout, view.stderr  # type: ignore[assignment]
    # [report] end
    err_out = _Output(err_stream)
    workers = _Workers(_Output(out_stream) if prefix else None, err_out if prefix else None)
    rdzv_host = "127.0.0.1" if bind in _WILDCARD_HOSTS else bind
    if group is not None:  # the other machines reach node 0 at the address they were given
        rdzv_host = parse_endpoint(group.endpoint)[0] if bind in _WILDCARD_HOSTS else bind
    base_env = dict(os.environ)
    base_env["PYTHONUNBUFFERED"] = "1"
    base_env["PYTHONPATH"] = _worker_pythonpath(base_env)
    if env_extra:
        base_env.update({str(k): str(v) for k, v in env_extra.items()})
    threads_note = limit_worker_threads(base_env, plan.nproc)
    # The launcher watch: workers hold the read end, only this process the write end.
    watch_read, watch_write = os.pipe()
    base_env[parent_watch.PARENT_FD] = str(watch_read)
    base_env[parent_watch.LAUNCHER_PID] = str(os.getpid())

    t0 = time.monotonic()
    failed_rank: int | None = None
    reason: str | None = None
    summary: str | None = None
    returncode = 0
    lost: dict[int, int] = {}
    stopped: set[int] = set()
    exit_order: list[int] = []
    trap = _SignalTrap()
    base_env.pop(KEY_ENV, None)
    if security.keys is not None:
        base_env[KEY_ENV] = security.keys.to_text()
    server: RendezvousServer | None = None
    store: HostedStore | None = None
    coordinator: CoordinatorProcess | None = None
    coordinator_exit: int | None = None
    try:
        if group is not None and node_rank > 0:
            rendezvous_endpoint = str(published["rendezvous"])
        else:
            server = RendezvousServer(world_size, host=bind if group is not None else rdzv_host,
                                      advertise_host=rdzv_host, curve=security.keys).start()
            rendezvous_endpoint = server.endpoint
        if group is not None:
            store_endpoint = group.endpoint  # node 0's launchers' store is the run's store too
        else:
            store = host_store(rdzv_host)  # the run's c10d store, shut down with the launcher
            store_endpoint = store.endpoint
        launch_info["rendezvous"] = rendezvous_endpoint
        launch_info["store"] = store_endpoint
        _write_json(path / "launch.json", launch_info)
        _log(err_stream, f"{world_size} workers, graph {g.name or graph_path}, protocol {config.protocol}, "
                         f"run dir {path}")
        if threads_note:
            _log(err_stream, threads_note)
        if coordinator_name is not None and (group is None or node_rank == 0):  # node 0 hosts it for all
            try:
                coordinator = CoordinatorProcess.start(
                    coordinator_name, graph_path=str(graph_path), config_json=config.to_json(), run_dir=str(path),
                    bind_host=rdzv_host, env=base_env, pass_fds=(watch_read,),
                    relay=err_out.write if prefix else None)
            except CoordinatorStartError as exc:
                failed_rank, reason, returncode, summary = None, "coordinator did not start", 1, str(exc)
            else:
                base_env.update(coordinator.worker_env())
                launch_info["coordinator"] = {"name": coordinator.name, "address": coordinator.address}
                _write_json(path / "launch.json", launch_info)
                _log(err_stream, f"{coordinator.label} started")
        if group is not None and node_rank == 0:
            # HOPNET_COORDINATOR*: the coordinator node 0 hosts (when the protocol has one) reaches
            # the other machines' workers through the published run
            group.publish_run({"rendezvous": rendezvous_endpoint, "world_size": world_size,
                               "config": json.loads(config.to_json()), "describe": describe(config),
                               "run_dir": path.name,
                               "env": {k: v for k, v in base_env.items() if k.startswith("HOPNET_COORDINATOR")}})
        elif group is not None:
            base_env.update({str(k): str(v) for k, v in published.get("env", {}).items()})
        with trap:
            # --- start
            for rank in plan.ranks:
                if trap.received or summary is not None:
                    break
                wenv = plan.worker_env(rank, graph_path=str(graph_path), rendezvous=rendezvous_endpoint,
                                       run_dir=str(path), config_json=config.to_json(), bind=bind,
                                       explicit_options=tuple(sorted(explicit_options)))
                env = dict(base_env)
                env.update(wenv.to_environ())
                env[STORE] = store_endpoint
                try:
                    workers.spawn(rank, command, env, pass_fds=(watch_read,))
                except OSError as exc:
                    failed_rank, reason, returncode = rank, f"could not start: {exc.strerror or exc}", 1
                    summary = f"worker {rank} failed ({reason})"
                    break
            os.close(watch_read)  # the workers have it; the launcher keeps only the write end
            watch_read = -1

            # --- wait (up to max_failures workers may fail while the others go on)
            pending = set(workers.procs)
            announced = False
            first_failure: int | None = None
            next_abort_check = time.monotonic() + ABORT_POLL_S
            while pending and first_failure is None and failed_rank is None and not trap.received \
                    and summary is None:
                if coordinator is not None and (code := coordinator.exited()) is not None:
                    coordinator_exit = code
                    summary = f"{coordinator.label} died ({_describe_exit(code)})"
                    returncode, reason = 1, "coordinator died"
                    _log(err_stream, f"{summary}; the workers waiting on it fail")
                    break
                if not announced and server is not None and server.complete.is_set():
                    announced = True
                    _announce_options(server, launch_info, path, err_stream)
                if group is not None and time.monotonic() >= next_abort_check:
                    next_abort_check = time.monotonic() + ABORT_POLL_S
                    remote = group.aborted()
                    if remote is not None and remote.get("node") != node_rank:
                        failed_rank, reason, returncode = remote.get("rank"), "stopped by another machine", 1
                        summary = f"stopping: {remote['summary']}" + (
                            f" [rank {remote['rank']} runs on {remote.get('host')}, node {remote.get('node')}]"
                            if remote.get("rank") is not None else "")
                        break
                exited = _collect_exit(workers, pending)
                if exited is None:
                    continue
                rank, code = exited
                exit_order.append(rank)
                if code != 0:
                    lost[rank] = code
                    total_lost = group.lose() if group is not None else len(lost)
                    if total_lost > max_failures:
                        first_failure = rank
                    else:
                        _log(err_stream, f"worker {rank} lost ({_describe_exit(code)}); the others go on "
                                         f"({len(lost)} of --max-failures {max_failures})")

            # --- after a failure, let the others end on their own for a moment: who blames whom
            if first_failure is not None or coordinator_exit is not None:
                # workers notice a dead coordinator themselves within --peer-timeout
                wait_s = settle_s if coordinator_exit is None else max(settle_s, config.peer_timeout_s + 2.0)
                deadline = time.monotonic() + wait_s
                while pending and time.monotonic() < deadline and not trap.received:
                    exited = _collect_exit(workers, pending)
                    if exited is not None:
                        exit_order.append(exited[0])
                        if exited[1] != 0:
                            lost[exited[0]] = exited[1]

            # --- stop the rest
            stopped = set(workers.running())
            if group is not None and first_failure is not None and not trap.received:
                # every machine stops on this record; the first launcher to write one is believed
                blame = _blame(path, workers.returncodes, stopped, exit_order, lost)
                facts = read_log_facts(path / f"rank{blame.rank}.jsonl")
                blamed_peer = facts.error.get("peer") if facts.error else None
                held = None
                if isinstance(blamed_peer, int) and blamed_peer not in plan.ranks:
                    # the root is on another machine: give its launcher a moment to say so
                    deadline = time.monotonic() + REMOTE_BLAME_WAIT_S
                    while held is None and time.monotonic() < deadline:
                        held = group.aborted()
                        time.sleep(ABORT_POLL_S)
                held = held or group.abort({"rank": blame.rank, "host": _host_name(bind), "node": node_rank,
                                    "summary": blame.summary})
                if held.get("node") != node_rank:  # another machine failed first
                    first_failure = None
                    failed_rank, reason, returncode = held.get("rank"), "stopped by another machine", 1
                    summary = f"stopping: {held['summary']} [rank {held.get('rank')} runs on {held.get('host')}, " \
                              f"node {held.get('node')}]"
            if trap.received:
                signum = trap.received[0]
                reason = f"interrupted by {_signal_name(signum)}"
                returncode = 128 + signum
                running = workers.running()
                workers.mute()  # what workers print while being stopped is noise
                _log(err_stream, f"received {_signal_name(signum)}, stopping {len(running)} workers; run dir {path}")
                # SIGTERM, not SIGINT, for both: a worker leaves quietly on SIGTERM.
                _stop(workers, pending, signal.SIGTERM, grace_s, trap, err_stream)
            elif pending:
                _stop(workers, pending, signal.SIGTERM, grace_s, trap, err_stream)
    finally:
        # whatever happened (even an exception in here), leave nothing behind
        for proc in workers.procs.values():
            if proc.returncode is None:
                _killpg(proc.pid, signal.SIGKILL)
        for rank, proc in workers.procs.items():
            try:
                code = proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                code = None
            if workers.returncodes.get(rank) is None:
                workers.returncodes[rank] = code
        workers.sweep()
        if coordinator is not None:  # after the workers, which may need it until they end
            coordinator.stop(grace_s)  # SIGTERM: it writes its summary
        workers.drain(2.0)
        if server is not None:
            server.close()
        if store is not None:
            store.close()
        if group is not None:
            group.finish(FINISH_WAIT_S)
        view.close()  # [report]
        for fd in (watch_read, watch_write):
            if fd >= 0:
                os.close(fd)

    if coordinator_exit is not None and not trap.received:
        if lost:
            summary += (f"; then {_plural_ranks(sorted(lost))} failed "
                        f"({', '.join(f'{r}: {_describe_exit(c)}' for r, c in sorted(lost.items()))})")
    elif not trap.received and failed_rank is None and summary is None:
        if len(lost) > max_failures or (first_failure is not None and group is not None):
            returncode = 1
            blame = _blame(path, workers.returncodes, stopped, exit_order, lost)
            failed_rank, reason, summary = blame.rank, blame.reason, blame.summary
            if group is not None:
                summary = f"{summary} [rank {failed_rank} runs on {_host_name(bind)}, node {node_rank}]"
        elif lost:
            summary = (f"lost {_plural_ranks(sorted(lost))} "
                       f"({', '.join(f'{r}: {_describe_exit(c)}' for r, c in sorted(lost.items()))}); "
                       f"the other {world_size - len(lost)} workers finished")
    if summary is not None:
        _log(err_stream, summary)
    refused = server.refused_handshakes if server is not None else 0  # node 0's launcher hosts it
    if refused:
        _log(err_stream, f"the rendezvous refused {refused} connection attempt(s) without the run key")

    wall_s = time.monotonic() - t0
    result = LaunchResult(returncode=returncode, run_dir=str(path), failed_rank=failed_rank, reason=reason,
                          worker_returncodes=dict(sorted(workers.returncodes.items())), wall_s=wall_s,
                          summary=summary, lost_ranks=sorted(lost))
    launch_info["result"] = {
        "returncode": returncode,
        "failed_rank": failed_rank,
        "reason": reason,
        "summary": summary,
        "lost_ranks": sorted(lost),
        "worker_returncodes": {str(r): c for r, c in result.worker_returncodes.items()},
        "wall_s": round(wall_s, 3),
        "rendezvous_refused_handshakes": refused,
        "end_time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        _write_json(path / "launch.json", launch_info)
    except OSError:
        pass
    if not trap.received:  # [report] the per-rank table; after Ctrl-C/SIGTERM the launcher says one line only
        view.print_summary()
        status = "finished" if returncode == 0 else "failed"
        _log(err_stream, f"{status} in {wall_s:.1f}s; run dir {path}")
    return result


def _host_name(bind: str) -> str:
    """How the summary names this machine: its --bind address, else its host name."""
    return socket.gethostname() if bind in _WILDCARD_HOSTS else bind


def _plural_ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _announce_options(server: RendezvousServer, launch_info: dict[str, Any], path: Path, err: IO[str]) -> None:
    """Once every rank registered: print and record the options that actually run."""
    if server.config is None:
        return  # the workers did not say (not started through hopnet.init)
    try:
        effective = ProtocolConfig.from_dict(dict(server.config))
    except (ConfigError, TypeError, ValueError):
        return
    launch_info["config"] = json.loads(effective.to_json())
    launch_info["config_source"] = "rendezvous"
    changed = differences(ProtocolConfig.from_dict(launch_info["config_flags"]), effective)
    note = f" ({', '.join(changed)} set in code)" if changed else ""
    _log(err, f"running {describe(effective)}{note}")
    try:
        _write_json(path / "launch.json", launch_info)
    except OSError:
        pass


def _blame(path: Path, returncodes: Mapping[int, int | None], stopped: set[int], exit_order: Sequence[int],
           lost: Mapping[int, int]) -> Blame:
    """Read every rank's event log and name the rank that caused the failure."""
    position = {rank: i for i, rank in enumerate(exit_order)}
    ends = []
    for rank, code in sorted(returncodes.items()):
        facts = read_log_facts(path / f"rank{rank}.jsonl")
        ends.append(RankEnd(rank=rank, exit_code=code, stopped=rank in stopped,
                            order=position.get(rank, len(position)), error=facts.error, last_iter=facts.last_iter))
    blame = explain(ends)
    if blame is not None:
        return blame
    rank = min(lost, key=lambda r: position.get(r, len(position)))  # no record to go by: the first to exit
    reason = _describe_exit(lost[rank])
    return Blame(rank, reason, f"worker {rank} failed ({reason})")


def _stop(workers: _Workers, pending: set[int], signum: int, grace_s: float, trap: _SignalTrap,
          err_stream: IO[str]) -> None:
    """Send ``signum`` to every running worker, wait up to ``grace_s``, then SIGKILL the rest.
    Another signal to the launcher during the grace period kills at once."""
    signals_seen = len(trap.received)
    workers.signal_all(signum)
    deadline = time.monotonic() + grace_s
    while pending and time.monotonic() < deadline:
        if len(trap.received) > signals_seen:
            break
        _collect_exit(workers, pending)
    if pending:
        stragglers = sorted(r for r in pending if workers.procs[r].returncode is None)
        if stragglers:
            why = "at once" if len(trap.received) > signals_seen else f"still running after {grace_s:g}s"
            _log(err_stream, f"killing workers {', '.join(map(str, stragglers))} ({why})")
        workers.signal_all(signal.SIGKILL)

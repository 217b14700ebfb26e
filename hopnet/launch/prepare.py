"""The launcher's phases before anything runs: join the other machines, secure the run,
prepare the run directory, record the launch, and build the workers' environment.

Each is a function of the validated :class:`~hopnet.launch.spec.LaunchPlan`, called in
that order by :func:`hopnet.launch.launcher.run_launch`; a refusal here (a
:class:`ConfigError`) leaves no run directory behind, except for what
:func:`prepare_run_dir` itself refuses.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hopnet import checkpoint_files as checkpoint
from hopnet.errors import ConfigError
from hopnet.graph import Graph
from hopnet.bootstrap.env import ELASTIC, JOIN, MAX_FAILURES, MAX_RESTARTS, RESTART, SAVE_MODEL
from hopnet.launch.nodes import LaunchGroup
from hopnet.bootstrap.run_name import graph_label, make_run_dir
from hopnet.launch.run_dir import RunDirClaim, claim_for_resume, claim_run_dir
from hopnet.launch.spec import LaunchPlan
from hopnet.rendezvous.store import parse_endpoint
from hopnet.bootstrap.pythonpath import worker_pythonpath
from hopnet.launch.talk import WaitTalk
from hopnet.launch.threads import limit_worker_threads
from hopnet.security import KEY_ENV, RunSecurity, is_loopback, resolve_run_key

JOIN_TIMEOUT_S = 300.0
"""How long a launcher of node R > 0 waits for node 0's launcher."""
WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "")


# ------------------------------------------------------------------ several machines
@dataclass
class JoinedMachines:
    """This launcher's place among the launchers of a multi-machine run."""

    group: LaunchGroup
    published: dict[str, Any] = field(default_factory=dict)
    """The run node 0's launcher published (empty on node 0, which publishes it)."""

    @property
    def node_rank(self) -> int:
        return self.group.node_rank


def join_launchers(plan: LaunchPlan, say: Callable[[str], None] | None = None) -> JoinedMachines | None:
    """Meet the other machines' launchers at ``--rdzv-endpoint`` (``None`` on one machine).

    Node 0 hosts the launchers' store; every other node waits for the run node 0 publishes
    (and ``say``s so, then every :data:`~hopnet.launch.talk.REMIND_S` while it waits) and
    refuses to go on when its graph or options differ."""
    spec = plan.spec
    if spec.single_machine:
        return None
    assert spec.rdzv_endpoint is not None  # validate() refused its absence
    waiting = None
    if say is not None and spec.node_rank > 0:
        talk = WaitTalk(f"node 0's launcher at {spec.rdzv_endpoint} to publish the run "
                        f"(node {spec.node_rank} of {spec.nnodes} machines; node 0 hosts the rendezvous)")

        def waiting(waited_s: float) -> None:
            line = talk.poll(waited_s)
            if line is not None:
                say(line)
    group = LaunchGroup(nnodes=spec.nnodes, node_rank=spec.node_rank, endpoint=spec.rdzv_endpoint,
                        timeout_s=JOIN_TIMEOUT_S, waiting=waiting)
    if spec.node_rank == 0:
        return JoinedMachines(group)
    try:
        published = group.await_run(JOIN_TIMEOUT_S)
    except BaseException:
        group.finish(0.0)
        raise
    if published["world_size"] != plan.world_size or published["config"] != json.loads(plan.config.to_json()):
        group.finish(0.0)
        raise ConfigError(f"node {spec.node_rank}'s graph or options differ from node 0's "
                          f"(node 0 runs {published['describe']} on {published['world_size']} workers)")
    return JoinedMachines(group, published)


# ---------------------------------------------------------------------------- security
def secure_run(plan: LaunchPlan) -> RunSecurity:
    """The run key (CurveZMQ) or plain sockets, as :func:`resolve_run_key` decides for ``--bind``.
    Called before :func:`join_launchers`: every machine refuses at once what node 0 would refuse."""
    spec = plan.spec
    security = resolve_run_key(plan.bind, insecure=spec.insecure, secure=spec.secure, key_file=spec.key_file)
    if not spec.single_machine and security.keys is not None and spec.key_file is None:
        # the launchers' store is not encrypted: the run key never travels through it
        raise ConfigError("several machines with CurveZMQ need the same --key-file on every machine "
                          "(make one with `hopnet keygen PATH`), or --insecure on a trusted network")
    return security


# ------------------------------------------------------------------------ run directory
def prepare_run_dir(plan: LaunchPlan, security: RunSecurity, say: Callable[[str], None]) -> RunDirClaim:
    """Create and claim the run directory (refusing one that holds a run unless ``--overwrite``,
    and one a running launch holds: :func:`~hopnet.launch.run_dir.claim_run_dir`), write
    ``graph.json`` into it, and ``say`` the notes on the run: what ``--overwrite`` removed,
    security warnings, the config checks' notes. The launch holds the returned claim
    until it ends; a refusal writes nothing into the directory."""
    spec = plan.spec
    existed = spec.run_dir is not None and os.path.exists(spec.run_dir)
    path = make_run_dir(spec.run_dir, plan.config.protocol, graph_label(plan.graph, spec.graph))
    if spec.resume:
        claim = claim_for_resume(spec.run_dir if spec.run_dir is not None else path)
    else:
        claim = claim_run_dir(path if spec.run_dir is None else spec.run_dir, spec.overwrite)  # named as given
        claim.created = not existed
    try:
        _write_graph_and_notes(plan, security, say, claim)
    except BaseException:
        claim.release()
        raise
    return claim


def _write_graph_and_notes(plan: LaunchPlan, security: RunSecurity, say: Callable[[str], None],
                           claim: RunDirClaim) -> None:
    if claim.cleared:
        say(claim.cleared)
    if security.warning:
        say(f"warning: {security.warning}")
    if security.keys is not None and not is_loopback(plan.bind) and plan.config.bulk != "zmq":
        say(f"note: CurveZMQ covers the ZeroMQ sockets; the c10d store and the --bulk {plan.config.bulk} "
            "torch plane (gloo/NCCL) are not encrypted (use --bulk zmq on untrusted networks)")
    for note in plan.notes:
        say(f"note: {note}")
    plan.graph.to_json(claim.path / "graph.json")


class LaunchRecord:
    """``launch.json``: what was launched, filled in as the phases go, rewritten atomically."""

    def __init__(self, path: Path, data: dict[str, Any]) -> None:
        self.path = path
        self.data = data

    def write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)

    def try_write(self) -> None:
        """:meth:`write`, when losing the record must not change how the run ends."""
        try:
            self.write()
        except OSError:
            pass


def launch_record(plan: LaunchPlan, security: RunSecurity, run_dir: Path) -> LaunchRecord:
    """The launch's record as it starts (the rendezvous, the coordinator and the result come later)."""
    spec, nodes = plan.spec, plan.nodes
    config = json.loads(plan.config.to_json())
    graph = spec.graph
    argv = list(spec.argv) if spec.argv is not None else list(sys.argv)
    return LaunchRecord(run_dir / "launch.json", {
        "argv": list(argv),
        "resumable_argv": argv[argv.index("launch") + 1:] if "launch" in argv else None,
        "command": plan.command,
        "script": os.fspath(spec.script),
        "script_args": list(spec.script_args),
        "module": spec.module,
        "config": config,
        "config_flags": json.loads(plan.config.to_json()),
        "config_source": "flags",
        "explicit_options": sorted(spec.explicit_options),
        "max_failures": spec.max_failures,
        "max_restarts": spec.max_restarts,
        "elastic": json.loads(plan.elastic.to_json()) if plan.elastic is not None else None,
        "save_model": spec.save_model,
        "checkpoint_every": spec.checkpoint_every,
        "checkpoint_dir": os.fspath(spec.checkpoint_dir) if spec.checkpoint_dir is not None else None,
        "resumed": spec.resume,
        "graph": graph.name if isinstance(graph, Graph) else (os.fspath(graph) if graph is not None else None),
        "graph_name": plan.graph.name,
        "world_size": plan.world_size,
        "replicas": {"size": plan.replicas.size, "mode": plan.replicas.mode} if plan.replicas.grouped else None,
        "nproc": nodes.nproc,
        "node_rank": nodes.node_rank,
        "nnodes": spec.nnodes,
        "ranks": list(nodes.ranks),
        "bind": plan.bind,
        "security": "curve" if security.keys is not None else "plain",
        "security_source": security.source,
        "start_time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": sys.executable,
        "hostname": socket.gethostname(),
        "cwd": os.getcwd(),
        "launcher_pid": os.getpid(),
    })


# ------------------------------------------------------------------- the workers' world
def rendezvous_host(bind: str, machines: JoinedMachines | None) -> str:
    """The address workers reach the launcher's services at: ``--bind``, unless it is a wildcard
    (then loopback, or with several machines the address the others were given for node 0)."""
    if bind not in WILDCARD_HOSTS:
        return bind
    if machines is not None:
        return parse_endpoint(machines.group.endpoint)[0]
    return "127.0.0.1"


def host_name(bind: str) -> str:
    """How a multi-machine summary names this machine: its --bind address, else its host name."""
    return socket.gethostname() if bind in WILDCARD_HOSTS else bind


def worker_base_env(plan: LaunchPlan, security: RunSecurity,
                    environ: Mapping[str, str]) -> tuple[dict[str, str], str | None]:
    """The environment every worker (and the coordinator) starts from, and the note on the
    threads it gives each worker (``OMP_NUM_THREADS``, :mod:`hopnet.launch.threads`)."""
    env = dict(environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = worker_pythonpath(env)
    if plan.spec.env_extra:
        env.update({str(k): str(v) for k, v in plan.spec.env_extra.items()})
    for name in (SAVE_MODEL, MAX_RESTARTS, MAX_FAILURES, RESTART, ELASTIC, JOIN):  # the launcher's flags decide
        env.pop(name, None)
    if plan.elastic is not None:
        env[ELASTIC] = plan.elastic.to_json()
    if plan.spec.save_model:
        env[SAVE_MODEL] = "1"
    if plan.spec.max_restarts > 0:
        env[MAX_RESTARTS] = str(plan.spec.max_restarts)
    if plan.spec.max_failures > 0:
        env[MAX_FAILURES] = str(plan.spec.max_failures)
    threads_note = limit_worker_threads(env, plan.nodes.nproc)
    env.pop(KEY_ENV, None)
    if security.keys is not None:
        env[KEY_ENV] = security.keys.to_text()
    return env, threads_note


__all__ = ["JOIN_TIMEOUT_S", "JoinedMachines", "LaunchRecord", "host_name", "join_launchers", "launch_record",
           "prepare_run_dir", "rendezvous_host", "secure_run", "worker_base_env", "worker_pythonpath"]


def checkpoint_env(plan: LaunchPlan, run_dir: Path, say: Callable[[str], None]) -> dict[str, str]:
    """The workers' ``HOPNET_CHECKPOINT_*`` and ``HOPNET_RESUME`` variables; on resume, the
    iteration every rank resumes after: the highest that every rank has a complete checkpoint
    of (:func:`hopnet.checkpoint_files.common_iteration`), said in one line."""
    spec = plan.spec
    directory = Path(spec.checkpoint_dir).resolve() if spec.checkpoint_dir is not None \
        else run_dir / checkpoint.DEFAULT_SUBDIR
    env = {checkpoint.CHECKPOINT_DIR: str(directory)}
    if spec.checkpoint_every:
        env[checkpoint.CHECKPOINT_EVERY] = str(spec.checkpoint_every)
    if spec.resume:
        after = checkpoint.common_iteration(directory, plan.world_size)
        if after is None:
            say(f"resume: no iteration has a checkpoint of every rank in {directory}: starting from iteration 0")
        else:
            env[checkpoint.RESUME] = str(after)
            say(f"resume: every rank resumes from its checkpoint of iteration {after} "
                f"(training continues at iteration {after + 1})")
    return env

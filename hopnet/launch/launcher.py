"""`hopnet launch`: start one worker process per node of the graph on this machine.

The launcher

* resolves the graph (a JSON file or a builder spec such as ``ring:4``) and the
  protocol configuration, and checks the options against the graph
  (:mod:`hopnet.config_checks`) before anything is created;
* creates and claims the run directory (refusing one that holds a run, or that another
  launch holds, see :mod:`hopnet.launch.run_dir`) and writes ``graph.json`` and
  ``launch.json`` into it;
* sets ``OMP_NUM_THREADS`` for the workers (:mod:`hopnet.launch.threads`);
* runs the rendezvous server (:mod:`hopnet.rendezvous.server`) in a thread;
* starts ``python SCRIPT ARGS...`` once per rank with the ``HOPNET_*`` variables of
  :mod:`hopnet.bootstrap.env`, through :mod:`hopnet.bootstrap.worker_main` (exit statuses,
  ordered shutdown, the launcher watch of :mod:`hopnet.bootstrap.parent_watch`), each
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

The phases, in the order :func:`run_launch` drives them: :func:`~hopnet.launch.spec.validate`
(a :class:`~hopnet.launch.spec.LaunchSpec` into a :class:`~hopnet.launch.spec.LaunchPlan`),
:func:`~hopnet.launch.prepare.secure_run`, :func:`~hopnet.launch.prepare.join_launchers`,
:func:`~hopnet.launch.prepare.prepare_run_dir`, then the methods of :class:`Launch`: store and
rendezvous, coordinator, spawn, monitor, settle, stop, release and summarise, over one
:class:`~hopnet.launch.state.RunState` (a :class:`~hopnet.launch.state.WorkerState` per worker).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Unpack

from hopnet.config import ProtocolConfig
from hopnet.errors import ConfigError
from hopnet.bootstrap import parent_watch
from hopnet.bootstrap.options import differences
from hopnet.launch import forkserver
from hopnet.launch.blame import describe_exit, read_log_facts
from hopnet.bootstrap.coordinator_proc import CoordinatorProcess, CoordinatorStartError
from hopnet.launch.run_store import RunStore
from hopnet.launch.death_watch import DeathWatch
from hopnet.launch.exit_bound import finished_its_loop, overdue_lines
from hopnet.launch.elastic import is_leaving, join_info, left_the_run, mark_stopping, read_views
from hopnet.bootstrap.env import MODEL_FILE, RESTART, RUN_DIR, STORE
from hopnet.launch.nodes import LaunchGroup
from hopnet.launch.partition import MachineLinks
from hopnet.launch.options import describe
from hopnet.launch.outcome import blame_run, conclude
from hopnet.launch.prepare import (
    JoinedMachines,
    LaunchRecord,
    checkpoint_env,
    host_name,
    join_launchers,
    launch_record,
    prepare_run_dir,
    rendezvous_host,
    secure_run,
    worker_base_env,
)
from hopnet.launch.processes import LineWriter, SignalTrap, TextSink, WorkerProcesses, kill_group, signal_name
from hopnet.rendezvous.server import RendezvousServer
from hopnet.launch.restarts import RestartBudget
from hopnet.launch.run_dir import RunDirClaim
from hopnet.launch.settings import LaunchKeywords, spec_from_keywords
from hopnet.launch.spec import (
    DEFAULT_NPROC,
    WORKER_ENTRY,
    LaunchPlan,
    LaunchSpec,
    NodePlan,
    resolve_graph,
    validate,
)
from hopnet.launch.state import RunState
from hopnet.launch.talk import ShutdownTalk, StartupTalk, ranks_text
from hopnet.report.live import LaunchProgress
from hopnet.report.view_watch import ViewWatch
from hopnet.report.timeline import run_phases
from hopnet.security import RunSecurity
from hopnet.launch.replicas import end_replica, lost_replicas, replicas_note, restart_replica
from hopnet.launch.worker_logs import worker_log

ABORT_POLL_S = 0.25
DEATH_POLL_S = 0.2
"""How often the launcher looks for workers declared dead whose process still runs."""
"""How often a launcher of a multi-machine run looks for another machine's abort."""
VIEW_POLL_S = 0.5
"""How often an elastic launch looks for committed views to say (:class:`~hopnet.report.view_watch.ViewWatch`)."""
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
    restarts: list[dict[str, object]] = field(default_factory=list)
    """The workers replaced (``max_restarts``), as ``launch.json`` records them under ``restarts``."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class LauncherOutput:
    """The launcher's own streams: its ``hopnet launch: ...`` lines go to :attr:`err`.

    Once the run directory exists, :meth:`show_progress` routes both streams through the
    live status line (:class:`hopnet.report.live.LaunchProgress`), which prints the per-rank
    summary table at the end."""

    def __init__(self, out: TextSink, err: TextSink) -> None:
        self.out = out
        self.err = err
        self.view: LaunchProgress | None = None

    def say(self, text: str) -> None:
        try:
            print(f"hopnet launch: {text}", file=self.err, flush=True)
        except (OSError, ValueError):
            pass

    def show_progress(self, run_dir: Path, ranks: list[int], live: bool, stdout: IO[str], stderr: IO[str]) -> None:
        self.view = LaunchProgress(run_dir, ranks, stdout, stderr, live=live)
        self.out, self.err = self.view.stdout, self.view.stderr

    def close_progress(self) -> None:
        if self.view is not None:
            self.view.close()

    def print_summary(self) -> None:
        if self.view is not None:
            self.view.print_summary()


def config_note(run_dir: Path, rank: int, code: int) -> str:
    """``: ConfigError: MESSAGE`` for a worker that exited 2 on a configuration error, which a
    worker under the launcher does not print itself; else nothing."""
    if code != 2:
        return ""
    error = read_log_facts(worker_log(run_dir, rank)).error
    if error is None or error.get("error") in (None, "SystemExit"):
        return ""
    return f": {error.get('error')}: {error.get('message')}"


class Launch:
    """One launch from its services onward: the phases after the run directory, each a method,
    over the resources they start (store, rendezvous, coordinator, workers) and a :class:`RunState`."""

    def __init__(self, plan: LaunchPlan, machines: JoinedMachines | None, security: RunSecurity,
                 run_dir: Path, record: LaunchRecord, output: LauncherOutput, started: float | None = None) -> None:
        self.started = time.monotonic() if started is None else started
        """When the launch began (``time.monotonic()``): start-up counts from here."""
        self.plan = plan
        self.spec = plan.spec
        self.machines = machines
        self.group = machines.group if machines is not None else None
        self.security = security
        self.run_dir = run_dir
        self.record = record
        self.output = output
        self.state = RunState()
        self.trap = SignalTrap()
        self.rdzv_host = rendezvous_host(plan.bind, machines)
        self.base_env, self.threads_note = worker_base_env(plan, security, os.environ)
        self.base_env.update(checkpoint_env(plan, run_dir, output.say))
        self.err_lines = LineWriter(output.err)
        # The launcher watch: workers hold the read end, only this process the write end.
        self.watch_read, self.watch_write = os.pipe()
        self.base_env[parent_watch.PARENT_FD] = str(self.watch_read)
        self.base_env[parent_watch.LAUNCHER_PID] = str(os.getpid())
        self.start_method = self.spec.start_method or ("forkserver" if forkserver.available() else "exec")
        # Started first, so its imports overlap the store, the rendezvous and the coordinator.
        server_env = {**self.base_env, RUN_DIR: str(run_dir), **forkserver.preload_env(self.spec, self.base_env)}
        server = forkserver.ForkServer(server_env, pass_fds=(self.watch_read,)) \
            if self.start_method == "forkserver" else None
        self.workers = WorkerProcesses(LineWriter(output.out) if self.spec.prefix else None,
                                       self.err_lines if self.spec.prefix else None,
                                       forkserver=server, fork_entry=WORKER_ENTRY)
        self.server: RendezvousServer | None = None
        self.store: RunStore | None = None
        self.coordinator: CoordinatorProcess | None = None
        self.rendezvous_endpoint = ""
        self.store_endpoint = ""
        self._announced = False
        self.death_watch = DeathWatch(run_dir, plan.nodes.ranks, stopped_limit_s=plan.config.peer_timeout_s)
        self.restarts = RestartBudget(self.spec.max_restarts)
        self._next_death_check = 0.0
        self.startup_talk = StartupTalk(plan.world_size, self.started)
        self.shutdown_talk = ShutdownTalk()
        self.view_watch = ViewWatch(run_dir) if plan.elastic is not None else None
        self._next_view_check = 0.0
        self.links = MachineLinks(self.group, run_dir, plan, output.say) if self.group is not None else None

    @property
    def node_rank(self) -> int:
        return self.plan.nodes.node_rank

    def _signalled(self) -> bool:
        """Whether the launcher got SIGINT/SIGTERM/SIGHUP (kept in the state for the end)."""
        self.state.signal = self.trap.first
        return self.state.signal is not None

    # -------------------------------------------------------- store and rendezvous
    def start_store_and_rendezvous(self) -> None:
        """Host the rendezvous and the run's c10d store (node 0 of several machines hosts both
        for all; the others use what node 0 published), and record where they are."""
        plan = self.plan
        if self.machines is not None and self.node_rank > 0:
            self.rendezvous_endpoint = str(self.machines.published["rendezvous"])
        else:
            self.server = RendezvousServer(plan.world_size, host=plan.bind if self.machines is not None
                                           else self.rdzv_host, advertise_host=self.rdzv_host,
                                           curve=self.security.keys).start()
            self.rendezvous_endpoint = self.server.endpoint
            if plan.elastic is not None:
                self.server.join_info = join_info(plan, self.run_dir, self.base_env)
        if self.group is not None:
            self.store_endpoint = self.group.endpoint  # node 0's launchers' store is the run's store too
        else:  # the run's c10d store, closed after the workers
            self.store = RunStore.start(self.rdzv_host, run_dir=str(self.run_dir), env=self.base_env,
                                        pass_fds=(self.watch_read,), relay=self.err_lines.write if self.spec.prefix
                                        else None, workers=self.workers)
            self.store_endpoint = self.store.endpoint
        if self.server is not None and self.server.join_info is not None:  # a joiner's replica groups meet there
            self.server.join_info["env"].update({STORE: self.store_endpoint, **plan.replicas.to_environ()})
        self.record.data["rendezvous"] = self.rendezvous_endpoint
        self.record.data["store"] = self.store_endpoint
        self.record.data["store_pid"] = self.store.pid if self.store is not None else None
        self.record.write()
        self.output.say(f"{plan.world_size} workers{replicas_note(plan.replicas)}, graph {plan.graph.name or self.run_dir / 'graph.json'}, "
                        f"protocol {plan.config.protocol}, run dir {self.run_dir}")
        if self.threads_note:
            self.output.say(self.threads_note)

    # -------------------------------------------------------------------- coordinator
    def start_coordinator(self) -> None:
        """Start the protocol's coordinator (node 0 hosts it for every machine), then share the
        run with the other machines (node 0) or take the coordinator's address from it (the others)."""
        plan = self.plan
        if plan.coordinator_name is not None and (self.machines is None or self.node_rank == 0):
            try:
                coordinator = CoordinatorProcess.start(
                    plan.coordinator_name, graph_path=str(self.run_dir / "graph.json"),
                    config_json=plan.config.to_json(), run_dir=str(self.run_dir), bind_host=self.rdzv_host,
                    env=self.base_env, pass_fds=(self.watch_read,),
                    relay=self.err_lines.write if self.spec.prefix else None,
                    forkserver=self.workers.forkserver if self.workers.forking else None)
            except CoordinatorStartError as exc:
                self.state.fail(None, "coordinator did not start", str(exc))
            else:
                self.coordinator = coordinator
                if coordinator.forkserver_failure is not None:
                    self.workers.stop_forking(coordinator.forkserver_failure)
                self.base_env.update(coordinator.worker_env())
                self.record.data["coordinator"] = {"name": coordinator.name, "address": coordinator.address,
                                                   "pid": coordinator.pid}
                self.record.write()
                self.output.say(f"{coordinator.label} started")
        if self.machines is not None and self.node_rank == 0:
            # HOPNET_COORDINATOR*: the coordinator node 0 hosts (when the protocol has one) reaches
            # the other machines' workers through the published run
            self.machines.group.publish_run({
                "rendezvous": self.rendezvous_endpoint, "world_size": plan.world_size,
                "config": json.loads(plan.config.to_json()), "describe": describe(plan.config),
                "run_dir": self.run_dir.name,
                "env": {k: v for k, v in self.base_env.items() if k.startswith("HOPNET_COORDINATOR")}})
        elif self.machines is not None:
            self.base_env.update({str(k): str(v) for k, v in self.machines.published.get("env", {}).items()})

    # ------------------------------------------------------------------------ spawn
    def spawn(self) -> None:
        """Start one worker per rank of this machine (stopping at a signal or a failure to start)."""
        ranks = self.plan.nodes.ranks
        self.output.say(f"starting {len(ranks)} worker{'' if len(ranks) == 1 else 's'}"
                        + (f" ({ranks_text(ranks)} of {self.plan.world_size})" if len(ranks) < self.plan.world_size
                           else ""))
        for rank in ranks:
            if self._signalled() or self.state.summary is not None:
                break
            try:
                self.workers.spawn(rank, self.plan.command, self._worker_env(rank), pass_fds=(self.watch_read,))
            except OSError as exc:
                reason = f"could not start: {exc.strerror or exc}"
                self.state.fail(rank, reason, f"worker {rank} failed ({reason})")
                break
            self.state.started(rank)
        if self.restarts.limit == 0:
            os.close(self.watch_read)  # the workers have it; the launcher keeps only the write end
            self.watch_read = -1  # (a launcher that restarts workers keeps it for the replacements)
        if self.workers.forkserver_failure is not None:
            self.output.say(f"{self.workers.forkserver_failure}; workers started with exec")
        self.record.data["start_method"] = self.start_method if self.workers.forking else "exec"
        self._record_pids()

    def _worker_env(self, rank: int) -> dict[str, str]:
        plan = self.plan
        worker_env = plan.nodes.worker_env(rank, graph_path=str(self.run_dir / "graph.json"),
                                           rendezvous=self.rendezvous_endpoint, run_dir=str(self.run_dir),
                                           config_json=plan.config.to_json(), bind=plan.bind,
                                           explicit_options=plan.explicit_options)
        env = dict(self.base_env)
        env.update(worker_env.to_environ())
        if plan.replicas.grouped:
            env.update(plan.replicas.to_environ())
        env[STORE] = self.store_endpoint
        return env

    def _record_pids(self) -> None:
        """``launch.json``'s ``worker_pids`` (each rank's current process) and ``restarts``."""
        self.record.data["worker_pids"] = {str(r): p.pid for r, p in self.workers.procs.items()}
        if self.restarts.records:
            self.record.data["restarts"] = self.restarts.to_json()
        self.record.try_write()

    # ---------------------------------------------------------------------- monitor
    def monitor(self) -> None:
        """Wait while workers run; up to ``max_failures`` may fail while the others go on.

        Returns once every worker ended, or the run must end: one failure too many, a dead
        coordinator, another machine's abort, a signal."""
        state, spec = self.state, self.spec
        next_abort_check = time.monotonic() + ABORT_POLL_S
        if self.links is not None:
            self.links.watch()
        while state.pending and not self._signalled() and not state.ending:
            if self.coordinator is not None and (code := self.coordinator.exited()) is not None:
                state.coordinator_exit = code
                state.fail(None, "coordinator died", f"{self.coordinator.label} died ({describe_exit(code)})")
            elif self.store is not None and (code := self.store.exited()) is not None:
                state.fail(None, "store died", f"the run's c10d store died ({describe_exit(code)})")
            if state.ending:
                self.output.say(f"{state.summary}; the workers waiting on it fail")
                return
            self._talk()
            self._say_views()
            if not self._announced and self.server is not None and self.server.complete.is_set():
                self._announced = True
                if self.group is not None:
                    self.group.expect_beats()
                self._announce_options()
            if self.group is not None and time.monotonic() >= next_abort_check:
                next_abort_check = time.monotonic() + ABORT_POLL_S
                remote = self.group.aborted()
                if self.links is not None and self.links.run_ends(state, remote):
                    return
                if remote is not None and remote.get("node") != self.node_rank:
                    state.fail(remote.get("rank"), "stopped by another machine",
                               f"stopping: {remote['summary']}" + (
                                   f" [rank {remote['rank']} runs on {remote.get('host')}, node {remote.get('node')}]"
                                   if remote.get("rank") is not None else ""))
                    return
            self._kill_silent()
            if self._exit_overdue():
                return
            exited = self.workers.next_exit()
            if exited is None:
                continue
            rank, code = exited
            if self._restart(rank, code):
                continue
            state.ended(rank, code)
            if code == 0 and not (self.plan.elastic is not None and left_the_run(self.run_dir, rank)):
                self.shutdown_talk.finished(time.monotonic())  # a lost worker's or a leaver's exit is no end
            if code != 0:
                if not end_replica(self.plan.replicas, rank, code, self.workers.procs, state.pending, state.with_replica,
                                   self.output.say):
                    continue  # it failed with a sibling killed before it: that one's exit counts the replica
                total_lost = self.group.lose() if self.group is not None else None
                if total_lost is None:  # one machine, or node 0's store cut off: what this launcher knows
                    total_lost = lost_replicas(self.plan.replicas, state.lost)
                if total_lost > spec.max_failures:
                    state.first_failure = rank
                else:
                    self.output.say(f"worker {rank} lost ({state.describe_end(rank, code)}{config_note(self.run_dir, rank, code)});"
                                    f" the others go on ({total_lost} of --max-failures {spec.max_failures})")

    def _exit_overdue(self) -> bool:
        """Once a worker finished, the others have ``--exit-timeout`` (default ``--timeout``) to exit
        (:mod:`hopnet.launch.exit_bound`); True once it ran out and the rest must be stopped."""
        first = self.shutdown_talk.first_end
        bound = self.spec.exit_timeout if self.spec.exit_timeout is not None else self.plan.config.timeout_s
        if first is None or time.monotonic() - first < bound or not self.state.pending:
            return False
        lines, unfinished = overdue_lines(self.run_dir, self.state.pending, bound)
        for line in lines:
            self.output.say(line)
        if unfinished:
            self.state.fail(unfinished[0], "did not finish", f"{ranks_text(unfinished)} did not finish within "
                            f"{bound:g}s of the first worker that did (--exit-timeout); stopped")
        self.state.exit_overdue = True
        return True

    def _talk(self) -> None:
        """Say what start-up or shutdown waits for (:mod:`hopnet.launch.talk`)."""
        now = time.monotonic()
        if self.server is not None:  # the machine that hosts the rendezvous sees every rank register
            line = self.startup_talk.poll(now, self.server.registered_ranks(), self.server.completed_at)
            if line is not None:
                self.output.say(line)
        if self.shutdown_talk.due(now):  # (the logs are read only when a line is due)
            # only those that finished training: the others are still at it (--max-failures), not slow to exit
            line = self.shutdown_talk.poll(now, [r for r in self.state.pending if finished_its_loop(self.run_dir, r)])
            if line is not None:
                self.output.say(line)

    def _say_views(self, *, now: bool = False) -> None:
        """Say each view of an elastic run once, as its members commit it (``view 1: ranks 4, 5 joined
        (6 workers)``); every :data:`VIEW_POLL_S`, or ``now``."""
        if self.view_watch is None or (not now and time.monotonic() < self._next_view_check):
            return
        self._next_view_check = time.monotonic() + VIEW_POLL_S
        for view in self.view_watch.poll():
            self.output.say(view.line(replicas=self.plan.replicas.grouped))

    def _restart(self, rank: int, code: int) -> bool:
        """Start ``rank`` again if it died and the restart budget allows (:mod:`hopnet.launch.restarts`);
        its new process is pending like the first one. Whether it was restarted."""
        state = self.state
        # With every other rank of this machine done there is no neighbour left to take a model from
        # (on one machine: the run is over), so the death counts as it would without restarts.
        others = self.group is not None or any(r != rank for r in state.pending)
        # A configuration error (exit 2 with a ConfigError in its log) would end a new process alike.
        ending = state.ending or self._signalled() or not others or bool(config_note(self.run_dir, rank, code))
        layout = self.plan.replicas
        if layout.grouped:
            restart = restart_replica(self.restarts, layout, rank, code, state.describe_end(rank, code), ending=ending,
                                      pending=state.pending, procs=self.workers.procs, say=self.output.say)
        else:
            restart = self.restarts.decide(rank, code, state.describe_end(rank, code), ending=ending)
        if restart is None:
            return False
        self.output.say(restart.line())
        old_pid = self.workers.procs[rank].pid
        kill_group(old_pid, signal.SIGKILL)  # whatever the dead worker left in its process group
        env = self._worker_env(rank)
        env[RESTART] = str(restart.number)
        started_mono = time.monotonic()
        try:
            self.workers.spawn(rank, self.plan.command, env, pass_fds=(self.watch_read,))
        except OSError as exc:
            self.output.say(f"rank {rank} could not be restarted: {exc.strerror or exc}")
            return False
        state.silent.pop(rank, None)
        self.death_watch.restarted(rank, started_mono, restart.number)
        self.restarts.done(restart, old_pid=old_pid, new_pid=self.workers.procs[rank].pid,
                           time=datetime.now(timezone.utc).isoformat(timespec="milliseconds"), mono=started_mono)
        self._record_pids()
        return True

    def _kill_silent(self) -> None:
        """SIGKILL every running worker its peers declared dead, or stopped for longer than
        ``--peer-timeout``: it would never exit by itself (:mod:`hopnet.launch.death_watch`)."""
        now = time.monotonic()
        if now < self._next_death_check:
            return
        self._next_death_check = now + DEATH_POLL_S
        running = {r: p.pid for r, p in self.workers.procs.items()
                   if p.returncode is None and r in self.state.pending}
        for found in self.death_watch.poll(running):
            self.state.silent[found.rank] = found.reason
            kill_group(running[found.rank], signal.SIGKILL)
            self.output.say(f"rank {found.rank} went silent ({found.reason}); killed it")

    def _announce_options(self) -> None:
        """Once every rank registered: print and record the options that actually run."""
        assert self.server is not None
        if self.server.config is None:
            return  # the workers did not say (not started through hopnet.init)
        try:
            effective = ProtocolConfig.from_dict(dict(self.server.config))
        except (ConfigError, TypeError, ValueError):
            return
        data = self.record.data
        data["config"] = json.loads(effective.to_json())
        data["config_source"] = "rendezvous"
        changed = differences(ProtocolConfig.from_dict(data["config_flags"]), effective)
        note = f" ({', '.join(changed)} set in code)" if changed else ""
        self.output.say(f"running {describe(effective)}{note}")
        self.record.try_write()

    def settle(self) -> None:
        """After a failure, let the other workers end on their own for a moment: who blames whom.
        Workers notice a dead coordinator themselves, within ``--peer-timeout``."""
        state = self.state
        if state.first_failure is None and state.coordinator_exit is None:
            return
        wait_s = self.spec.settle_s if state.coordinator_exit is None \
            else max(self.spec.settle_s, self.plan.config.peer_timeout_s + 2.0)
        deadline = time.monotonic() + wait_s
        while state.pending and time.monotonic() < deadline and not self._signalled():
            self._kill_silent()
            exited = self.workers.next_exit()
            if exited is not None:
                state.ended(*exited)

    # ------------------------------------------------------------------------- stop
    def stop(self) -> None:
        """Stop the workers still running (SIGTERM, then SIGKILL after ``grace_s``). With several
        machines, a failure here first goes to the abort record every launcher follows."""
        state = self.state
        state.stopping(self.workers.running())
        if self.plan.elastic is not None:
            mark_stopping(self.run_dir)  # an elastic worker takes this SIGTERM for the launcher's, not a preemption
        if self.group is not None and state.first_failure is not None and not self._signalled():
            self._abort_other_machines(self.group)
        if self._signalled():
            signum = self.trap.received[0]
            state.reason = f"interrupted by {signal_name(signum)}"
            state.returncode = 128 + signum
            running = self.workers.running()
            self.workers.mute()  # what workers print while being stopped is noise
            self.output.say(f"received {signal_name(signum)}, stopping {len(running)} workers; "
                            f"run dir {self.run_dir}")
            # SIGTERM, not SIGINT, for both: a worker leaves quietly on SIGTERM.
            self._terminate(signal.SIGTERM)
        elif state.pending:
            self.output.say(f"stopping {ranks_text(state.pending)} (SIGTERM, then SIGKILL after {self.spec.grace_s:g}s)")
            self._terminate(signal.SIGTERM)

    def _abort_other_machines(self, group: LaunchGroup) -> None:
        """Every machine stops on one abort record; the first launcher to write one is believed."""
        state = self.state
        blame = blame_run(self.run_dir, state)
        error = read_log_facts(worker_log(self.run_dir, blame.rank)).error
        blamed_peer = error.get("peer") if error else None
        held = None
        there = self.links.suspect(blamed_peer if isinstance(blamed_peer, int) else None) \
            if self.links is not None else None
        if there is not None and self.links is not None:
            # the root is on another machine: give its launcher a moment to say so, unless the
            # link to it is down (then nothing will come)
            deadline = time.monotonic() + REMOTE_BLAME_WAIT_S
            while held is None and time.monotonic() < deadline:
                held = group.aborted()
                if self.links.blame_the_link(state, there, held, blame.rank):
                    return
                time.sleep(ABORT_POLL_S)
        held = held or group.abort({"rank": blame.rank, "host": host_name(self.plan.bind),
                                    "node": self.node_rank, "summary": blame.summary})
        if held.get("node") != self.node_rank:  # another machine failed first
            state.first_failure = None
            state.fail(held.get("rank"), "stopped by another machine",
                       f"stopping: {held['summary']} [rank {held.get('rank')} runs on {held.get('host')}, "
                       f"node {held.get('node')}]")

    def _terminate(self, signum: int) -> None:
        """Send ``signum`` to every running worker, wait up to ``grace_s``, then SIGKILL the rest.
        Another signal to the launcher during the grace period kills at once."""
        state, grace_s = self.state, self.spec.grace_s
        signals_seen = len(self.trap.received)
        # A worker leaving an elastic run is on its way out: a signal now would stop it (143, not the
        # 0 of a worker that left); it gets the grace period like the others.
        leaving = [r for r in state.pending if self.plan.elastic is not None and is_leaving(self.run_dir, r)]
        self.workers.signal_all(signum, sparing=leaving)
        self.workers.signal_all(signal.SIGCONT)  # a stopped worker acts on the signal only once continued
        deadline = time.monotonic() + grace_s
        while state.pending and time.monotonic() < deadline:
            if len(self.trap.received) > signals_seen:
                break
            exited = self.workers.next_exit()
            if exited is not None:
                state.ended(*exited)
        stragglers = sorted(r for r in state.pending if self.workers.procs[r].returncode is None)
        if stragglers:
            why = "at once" if len(self.trap.received) > signals_seen else f"still running after {grace_s:g}s"
            self.output.say(f"killing workers {', '.join(map(str, stragglers))} ({why})")
        if state.pending:
            self.workers.signal_all(signal.SIGKILL)

    # ---------------------------------------------------------------------- release
    def release(self) -> None:
        """Leave nothing behind, whatever happened (even an exception in a phase)."""
        self._signalled()  # a signal during the last phase still decides how the launch ends
        self.state.reaped(self.workers.reap())
        if self.coordinator is not None:  # after the workers, which may need it until they end
            self.coordinator.stop(self.spec.grace_s)  # SIGTERM: it writes its summary
        self.workers.close_forkserver()  # which ends what it forked and is still running (the store too)
        self.workers.drain(2.0)
        if self.server is not None:
            self.server.close()
        if self.store is not None:  # last: no worker still starting meets a closed store
            self.store.close()
        if self.group is not None:
            self.group.finish(FINISH_WAIT_S)
        if self.links is not None:
            self.links.say_late_cuts()
        self.output.close_progress()
        for fd in (self.watch_read, self.watch_write):
            if fd >= 0:
                os.close(fd)
        self.watch_read = self.watch_write = -1

    # -------------------------------------------------------------------- summarise
    def summarise(self, wall_s: float | None = None) -> LaunchResult:
        """Name what went wrong, record the result in ``launch.json``, print the per-rank table.
        ``wall_s``: the launch's length (default: from :attr:`started` to now), split into start-up,
        training and shutdown from the event logs (:mod:`hopnet.report.timeline`)."""
        state, plan = self.state, self.plan
        ended = time.monotonic() if wall_s is None else self.started + wall_s
        phases = run_phases(self.run_dir, plan.nodes.ranks, self.started, ended, self.workers.exit_times)
        wall_s = phases.total_s
        machine = f"{host_name(plan.bind)}, node {self.node_rank}" if self.group is not None else None
        conclude(state, self.run_dir, max_failures=self.spec.max_failures, world_size=plan.world_size,
                 machine=machine, replica_size=plan.replicas.size)
        self._say_views(now=True)  # the views committed since the last look
        if state.summary is not None:
            self.output.say(state.summary)
        restarted = self.restarts.summary()
        if restarted is not None:
            self.output.say(restarted)
        refused = self.server.refused_handshakes if self.server is not None else 0  # node 0's launcher hosts it
        if refused:
            self.output.say(f"the rendezvous refused {refused} connection attempt(s) without the run key")
        lost = sorted(state.lost)
        result = LaunchResult(returncode=state.returncode, run_dir=str(self.run_dir), failed_rank=state.failed_rank,
                              reason=state.reason, worker_returncodes=state.returncodes, wall_s=wall_s,
                              summary=state.summary, lost_ranks=lost, restarts=self.restarts.to_json())
        if plan.elastic is not None:
            self.record.data["views"] = read_views(self.run_dir, plan.replicas.replicas if plan.replicas.grouped
                                                   else plan.world_size)
        self.record.data["result"] = {
            "returncode": state.returncode,
            "failed_rank": state.failed_rank,
            "reason": state.reason,
            "summary": state.summary,
            "lost_ranks": lost,
            "worker_returncodes": {str(r): c for r, c in result.worker_returncodes.items()},
            "wall_s": round(wall_s, 3),
            "phases": phases.to_json(),
            "rendezvous_refused_handshakes": refused,
            "end_time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        self.record.try_write()
        if state.signal is None and not state.config_error:  # after Ctrl-C/SIGTERM the launcher says one line only
            self.output.print_summary()
            if self.spec.save_model:
                self.output.say(saved_model_line(self.run_dir))
            status = "finished" if state.returncode == 0 else "failed"
            self.output.say(f"{status} in {phases.line()}; run dir {self.run_dir}")
        return result


def saved_model_line(run_dir: Path) -> str:
    """What ``--save-model`` left in ``run_dir``, in one line."""
    path = run_dir / MODEL_FILE
    if path.is_file():
        return f"consensus model saved to {path}"
    return (f"--save-model: no {MODEL_FILE} in the run dir (the script must call worker.consensus() after "
            "training; on a multi-machine run it is on the machine of the lowest live rank)")


def run_launch(spec: LaunchSpec, *, stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> LaunchResult:
    """The driver: run ``spec``'s phases in order (see :func:`launch`)."""
    started = time.monotonic()
    return run_plan(validate(spec), stdout=stdout, stderr=stderr, started=started)


def run_plan(plan: LaunchPlan, *, stdout: IO[str] | None = None, stderr: IO[str] | None = None,
             started: float | None = None) -> LaunchResult:
    """The phases after :func:`~hopnet.launch.spec.validate`, which `hopnet launch` runs before it
    imports this module (and torch with it), so that a bad argument costs no torch import.
    ``started``: the ``time.monotonic()`` the launch's account of its time starts from (the
    command's own start, so that its argument checks and imports count as start-up)."""
    started = time.monotonic() if started is None else started
    spec = plan.spec
    out_stream = stdout if stdout is not None else sys.stdout
    err_stream = stderr if stderr is not None else sys.stderr
    output = LauncherOutput(out_stream, err_stream)
    security = secure_run(plan)  # before joining: node R refuses at once what node 0 would
    machines = join_launchers(plan, output.say)
    claim: RunDirClaim | None = None
    try:
        claim = prepare_run_dir(plan, security, output.say)
        record = launch_record(plan, security, claim.path)
    except BaseException:
        if claim is not None:
            claim.release()
        if machines is not None:
            machines.group.finish(0.0)
        raise
    with claim:  # the run directory is this launch's until its summary is written
        run_dir = claim.path
        output.show_progress(run_dir, list(plan.nodes.ranks), spec.progress and spec.prefix, out_stream, err_stream)
        run = Launch(plan, machines, security, run_dir, record, output, started)
        try:
            run.start_store_and_rendezvous()
            run.start_coordinator()
            with run.trap:
                run.spawn()
                run.monitor()
                run.settle()
                run.stop()
        finally:
            run.release()
        result = run.summarise()
        if run.state.config_error and not spec.resume:
            claim.discard()  # nothing ran: a configuration error leaves no run directory behind
        return result


def launch(script: str | os.PathLike[str], script_args: Sequence[str] = (), *, stdout: IO[str] | None = None,
           stderr: IO[str] | None = None, **settings: Unpack[LaunchKeywords]) -> LaunchResult:
    """Run ``python SCRIPT ARGS...`` once per rank of ``graph`` and wait for all of them.

    The keywords are the launcher's settings, declared once with their defaults and help in
    :class:`~hopnet.launch.settings.LaunchSpec` (each is the `hopnet launch` flag of the same name,
    ``grace_s`` is ``--grace``); an unknown keyword raises ``TypeError``. ``stdout`` and ``stderr``
    take the launcher's own output (default: this process's).

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
    that run's hopnet files, see :mod:`hopnet.launch.run_dir`); one that a running launch
    holds is refused even then.
    Sockets bound to anything but loopback use CurveZMQ with a key made for the run, or
    read from ``key_file``; ``secure`` uses it on loopback too; ``insecure`` turns it off
    (with a warning when ``bind`` is not loopback).
    With ``nnodes > 1`` this is one of ``nnodes`` launchers, one per machine: it runs the
    ranks placed on machine ``node_rank`` (:mod:`hopnet.launch.nodes`); node 0's launcher
    hosts the launchers' store at ``rdzv_endpoint`` (``HOST:PORT``, reachable from every
    machine) and the rendezvous; a failure anywhere stops every machine's workers.
    With ``save_model`` the workers' ``worker.consensus()`` writes the consensus model to
    ``model.pt`` in the run directory (``HOPNET_SAVE_MODEL``).
    ``checkpoint_every`` N: every worker saves its state every N iterations into ``checkpoint_dir``
    (default ``RUN_DIR/checkpoints``); ``resume``: ``run_dir`` is an earlier run's, whose workers
    resume from their checkpoints (:mod:`hopnet.checkpoint`).
    ``max_restarts`` K: a worker that dies (exits non-zero, is killed, or is declared dead by its
    peers) is started again, with ``HOPNET_RESTART=N``, while fewer than K restarts were used on
    this machine and the run is not ending (:mod:`hopnet.launch.restarts`); past K, ``max_failures``
    decides as without it.
    ``start_method`` ``"forkserver"`` (the default on Linux) forks the workers from one process
    that imported torch once (:mod:`hopnet.bootstrap.forkserver`); ``"exec"`` starts each worker as
    a new interpreter. ``launch.json`` records the method and each worker's pid.

    The arguments make a :class:`~hopnet.launch.settings.LaunchSpec`, which :func:`run_launch` runs.
    """
    return run_launch(spec_from_keywords(script, script_args, settings), stdout=stdout, stderr=stderr)


__all__ = ["DEFAULT_NPROC", "Launch", "LaunchPlan", "LaunchResult", "LaunchSpec", "LauncherOutput", "NodePlan",
           "launch", "resolve_graph", "run_launch", "run_plan"]

"""The run's c10d store on one machine (:mod:`hopnet.rendezvous.store`): where `hopnet launch`
hosts it.

With a fork server (the default start method), the store runs in a process forked from it
(:mod:`hopnet.bootstrap.store_main`), so the launcher itself never imports torch: about 1.2 CPU-s
and most of a second of every launch. Without one, the launcher hosts the store in its own
process. Either way the store lives until the launcher closes it after its workers ended; a
store process that dies before then fails the run (:meth:`RunStore.exited`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

from hopnet.bootstrap.forkserver import STORE
from hopnet.bootstrap.service_proc import ServiceProcess, ServiceStartError
from hopnet.bootstrap.store_main import ENDPOINT_PREFIX
from hopnet.launch.processes import WorkerProcesses
from hopnet.rendezvous.store import HostedStore, host_store

FORK_KEY = -2
"""The store's request number at the fork server (workers use their ranks, the coordinator -1)."""
STOP_GRACE_S = 5.0


class RunStore:
    """The run's store, in a process of its own or in the launcher's."""

    def __init__(self, endpoint: str, process: ServiceProcess | None = None, hosted: HostedStore | None = None) -> None:
        self.endpoint = endpoint
        self.process = process
        self.hosted = hosted

    @classmethod
    def start(cls, host: str, *, run_dir: str, env: Mapping[str, str], pass_fds: Sequence[int],
              relay: Callable[[bytes], None] | None, workers: WorkerProcesses) -> RunStore:
        """Fork the store from the fork server of ``workers`` when they are forked (exec it if the
        fork server does not answer: the workers are exec'd from then on too), or host it here.
        Raises :class:`~hopnet.errors.HopnetError` when it cannot be hosted."""
        if workers.forking and workers.forkserver is not None:
            try:
                process = ServiceProcess.launch("the run's c10d store", tag="store", entry=STORE,
                                                module="hopnet.bootstrap.store_main", fork_key=FORK_KEY,
                                                args=["--host", host, "--run-dir", run_dir], prefix=ENDPOINT_PREFIX,
                                                env=env, pass_fds=pass_fds, relay=relay,
                                                forkserver=workers.forkserver)
            except ServiceStartError:
                pass  # (a fork server of another hopnet version, say): host it here, where a real fault is named
            else:
                if process.forkserver_failure is not None:
                    workers.stop_forking(process.forkserver_failure)
                return cls(process.value, process=process)
        hosted = host_store(host)
        return cls(hosted.endpoint, hosted=hosted)

    @property
    def pid(self) -> int:
        """The process that hosts the store: its own, or the launcher's."""
        return self.process.pid if self.process is not None else os.getpid()

    def exited(self) -> int | None:
        """The store process's exit status once it ended (``None`` while it serves, or hosted here)."""
        return self.process.exited() if self.process is not None else None

    def close(self) -> None:
        if self.process is not None:
            self.process.stop(STOP_GRACE_S)
        if self.hosted is not None:
            self.hosted.close()

"""The coordinator process of a launch (group protocols): start it, watch it, stop it.

`hopnet launch` starts ``python -m hopnet.bootstrap.coordinator_main`` before the workers when
:func:`hopnet.coordinator.make_coordinator` says the protocol needs one, reads the address
it prints first, and hands it to the workers in ``HOPNET_COORDINATOR`` (with its name in
``HOPNET_COORDINATOR_NAME``, for their error messages). It is a service process
(:mod:`hopnet.bootstrap.service_proc`): a session of its own, the launcher watch's pipe, its
stderr relayed as ``[coordinator] ...`` lines. If it exits while workers still run, the launch fails with a
line naming it; at the end of the run it gets SIGTERM and writes its summary.

Given the launch's fork server, the coordinator is forked from it instead of exec'd; its
parent is then the fork server, which ends it with the workers when the launcher dies.

Under torchrun or srun there is no launcher of hopnet's own: rank 0's worker starts the
coordinator (:mod:`hopnet.bootstrap.init`), so this module runs in a worker as well as in the
launcher, and lives in the bootstrap.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from hopnet.bootstrap.forkserver import COORDINATOR
from hopnet.bootstrap.service_proc import START_TIMEOUT_S, Forker, ProcessHandle, ServiceProcess, ServiceStartError
from hopnet.coordinator.server import ADDRESS_PREFIX
from hopnet.coordinator.variables import COORDINATOR_ENV, COORDINATOR_NAME_ENV

FORK_KEY = -1
"""The coordinator's request number at the fork server (workers use their ranks)."""
CoordinatorStartError = ServiceStartError
"""The coordinator process did not come up."""


class CoordinatorProcess(ServiceProcess):
    """A running ``python -m hopnet.bootstrap.coordinator_main``."""

    def __init__(self, proc: ProcessHandle, address: str, forkserver_failure: str | None = None,
                 forked: bool = False) -> None:
        super().__init__(proc, address, forkserver_failure, forked)
        self.name = ""

    @property
    def address(self) -> str:
        """``tcp://HOST:PORT``: what it printed first."""
        return self.value

    @property
    def label(self) -> str:
        return f"the coordinator ({self.name}) at {self.address}"

    @classmethod
    def start(cls, name: str, *, graph_path: str, config_json: str, run_dir: str, bind_host: str,
              env: Mapping[str, str], pass_fds: Sequence[int], relay: Callable[[bytes], None] | None,
              timeout_s: float = START_TIMEOUT_S, forkserver: Forker | None = None) -> CoordinatorProcess:
        """Start it and wait for its address (see :meth:`ServiceProcess.launch`)."""
        args = ["--graph", graph_path, "--config", config_json, "--run-dir", run_dir, "--bind", bind_host]
        process = cls.launch(f"the coordinator ({name})", tag="coordinator", entry=COORDINATOR,
                             module="hopnet.bootstrap.coordinator_main", fork_key=FORK_KEY, args=args,
                             prefix=ADDRESS_PREFIX, env=env, pass_fds=pass_fds, relay=relay, timeout_s=timeout_s,
                             forkserver=forkserver)
        assert isinstance(process, CoordinatorProcess)
        process.name = name
        return process

    def worker_env(self) -> dict[str, str]:
        return {COORDINATOR_ENV: self.address, COORDINATOR_NAME_ENV: self.name}

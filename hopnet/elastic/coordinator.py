"""A view's coordinator (partial-reduce's controller, prague's group generator): the lowest member
of each view hosts one, built for that view's members, as rank 0 hosts the run's under torchrun."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hopnet.bootstrap.coordinator_proc import CoordinatorProcess, CoordinatorStartError
from hopnet.bootstrap.parent_watch import LAUNCHER_PID, PARENT_FD
from hopnet.config import ProtocolConfig
from hopnet.coordinator import make_coordinator
from hopnet.errors import HopnetError
from hopnet.graph import Graph

STOP_GRACE_S = 5.0


class ViewCoordinator:
    """The coordinator process this worker hosts for one view (its child, ended with it)."""

    def __init__(self, process: CoordinatorProcess, watch_write: int) -> None:
        self.process = process
        self._watch_write = watch_write

    @classmethod
    def start(cls, config: ProtocolConfig, graph: Graph, run_dir: str, view: int, bind_host: str) -> ViewCoordinator:
        """Start the coordinator of view ``view`` over ``graph`` (its nodes are the view's positions);
        its log goes to ``RUN_DIR/view{view}/coordinator.jsonl``."""
        machine = make_coordinator(config, graph)
        if machine is None:
            raise HopnetError(f"--protocol {config.protocol} needs no coordinator")
        directory = Path(run_dir) / f"view{view}"
        directory.mkdir(parents=True, exist_ok=True)
        graph_path = directory / "graph.json"
        graph.to_json(graph_path)
        # It watches this worker as a launcher's children watch their launcher (a pipe whose write end
        # this process holds): it never outlives the worker that hosts it.
        watch_read, watch_write = os.pipe()
        env = {**os.environ, PARENT_FD: str(watch_read), LAUNCHER_PID: str(os.getpid())}
        stderr = sys.stderr.buffer

        def relay(line: bytes) -> None:
            stderr.write(line)
        try:
            process = CoordinatorProcess.start(machine.name, graph_path=str(graph_path), config_json=config.to_json(),
                                               run_dir=str(directory), bind_host=bind_host, env=env,
                                               pass_fds=(watch_read,), relay=relay)
        except CoordinatorStartError as exc:
            os.close(watch_write)
            raise HopnetError(f"view {view}: {exc}") from None
        finally:
            os.close(watch_read)
        return cls(process, watch_write)

    def worker_env(self) -> dict[str, str]:
        """``HOPNET_COORDINATOR*`` for the view's members (:func:`hopnet.coordinator.client.client_from_environ`)."""
        return self.process.worker_env()

    def stop(self) -> None:
        try:
            self.process.stop(STOP_GRACE_S)
        finally:
            if self._watch_write >= 0:
                os.close(self._watch_write)
                self._watch_write = -1

"""`hopnet launch` on several machines: placement, and what the launchers tell each other.

One launcher runs per machine (``--nnodes N --node-rank R --rdzv-endpoint HOST:PORT``).
The launcher of node 0 hosts a torch ``TCPStore`` at ``HOST:PORT`` (listening on every
interface); it is both the launchers' meeting point and the run's c10d store the workers
use (``HOPNET_STORE``). Through it:

* node 0 publishes the run (:meth:`LaunchGroup.publish_run`): the rendezvous endpoint,
  the run directory's name, the graph, the options and the run key; the other launchers
  wait for it (:meth:`LaunchGroup.await_run`) before starting their ranks;
* every launcher counts its lost workers in one shared counter (:meth:`LaunchGroup.lose`),
  so ``--max-failures`` holds for the whole run, not per machine;
* the launcher whose failure ends the run writes one abort record (first writer wins)
  naming the rank and its host (:meth:`LaunchGroup.abort`); every launcher polls it
  (:meth:`LaunchGroup.aborted`) while its workers run and stops them when it appears;
* at the end each launcher says it is done, and node 0 keeps the store up until all did.

Placement (:func:`place_ranks`): by the graph's ``machine`` labels where every node has one
(the labels in order of first appearance are nodes 0, 1, ...), else contiguous blocks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from hopnet.errors import ConfigError, HopnetError, WaitTimeout
from hopnet.graph import Graph
from hopnet.rendezvous.store import HostedStore, connect_store, format_endpoint, host_store, parse_endpoint

if TYPE_CHECKING:
    import torch.distributed as dist

PREFIX = "hopnet-launch/"
POLL_S = 0.05


def place_ranks(graph: Graph, nnodes: int, node_rank: int) -> list[int]:
    """The global ranks machine ``node_rank`` runs."""
    if not isinstance(nnodes, int) or nnodes < 1:
        raise ConfigError(f"--nnodes must be an integer >= 1 (got {nnodes!r})")
    if not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank must be from 0 to {nnodes - 1} (got {node_rank!r})")
    labels = graph.machines
    labelled = [m for m in labels if m is not None]
    if labelled and len(labelled) != len(labels):
        raise ConfigError("the graph gives a machine to some nodes only: give one to every node or to none")
    if labelled:
        order = list(dict.fromkeys(labelled))
        if len(order) != nnodes:
            raise ConfigError(f"the graph places its nodes on {len(order)} machines ({', '.join(order)}) "
                              f"but --nnodes is {nnodes}")
        return [r for r, m in enumerate(labels) if m == order[node_rank]]
    if graph.n < nnodes:
        raise ConfigError(f"--nnodes {nnodes} is more than the graph's {graph.n} nodes")
    base, extra = divmod(graph.n, nnodes)
    start = node_rank * base + min(node_rank, extra)
    return list(range(start, start + base + (1 if node_rank < extra else 0)))


class LaunchGroup:
    """The launchers of one multi-machine run, talking through node 0's store."""

    def __init__(self, *, nnodes: int, node_rank: int, endpoint: str, timeout_s: float = 300.0,
                 waiting: Callable[[float], None] | None = None) -> None:
        """``waiting`` (node R > 0) is called with the seconds waited so far while node 0's store
        does not answer yet, and later while :meth:`await_run` waits."""
        host, port = parse_endpoint(endpoint)
        self.nnodes = nnodes
        self.node_rank = node_rank
        self.endpoint = format_endpoint(host, port)
        self.hosted: HostedStore | None = None
        if node_rank == 0:
            self.hosted = host_store(host, port)
            assert self.hosted.store is not None
            self.store: dist.TCPStore = self.hosted.store
        else:
            self.store = connect_store(self.endpoint, timeout_s, waiting)
        self.waiting = waiting
        self.store.set_timeout(timedelta(seconds=timeout_s))

    # -- the run, from node 0
    def publish_run(self, info: dict[str, Any]) -> None:
        self.store.set(PREFIX + "run", json.dumps(info))

    def await_run(self, timeout_s: float) -> dict[str, Any]:
        self._wait([PREFIX + "run"], "node 0's launcher to publish the run", timeout_s)
        return json.loads(self.store.get(PREFIX + "run").decode("utf-8"))

    # -- failures
    def lose(self) -> int:
        """Count one lost worker; returns how many the run has lost on every machine."""
        return int(self.store.add(PREFIX + "lost", 1))

    def abort(self, record: dict[str, Any]) -> dict[str, Any]:
        """Ask every launcher to stop; returns the record that holds (an earlier one wins)."""
        value = json.dumps(record)
        held = self.store.compare_set(PREFIX + "abort", "", value)
        return json.loads(held.decode("utf-8"))

    def aborted(self) -> dict[str, Any] | None:
        try:
            if not self.store.check([PREFIX + "abort"]):
                return None
            return json.loads(self.store.get(PREFIX + "abort").decode("utf-8"))
        except Exception as exc:  # node 0's launcher (and its store) went away
            if self.node_rank == 0:
                raise
            return {"rank": None, "host": None, "node": 0,
                    "summary": f"lost node 0's launcher store at {self.endpoint} "
                               f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"}

    # -- the end
    def finish(self, timeout_s: float) -> None:
        """Say this launcher is done; node 0 keeps the store up until every launcher said so."""
        try:
            self.store.set(f"{PREFIX}done/{self.node_rank}", "1")
            if self.node_rank == 0:
                keys = [f"{PREFIX}done/{n}" for n in range(self.nnodes)]
                self._wait(keys, "the other launchers' end", timeout_s)
        except (HopnetError, WaitTimeout, RuntimeError):
            pass
        finally:
            if self.hosted is not None:
                self.hosted.close()
                self.hosted = None

    def _wait(self, keys: list[str], what: str, timeout_s: float) -> None:
        started = time.monotonic()
        while not self.store.check(keys):
            if self.waiting is not None and self.node_rank > 0:
                self.waiting(time.monotonic() - started)
            if time.monotonic() - started >= timeout_s:
                raise WaitTimeout(f"{what} on {self.endpoint}", waited_s=time.monotonic() - started)
            time.sleep(POLL_S)


__all__ = ["LaunchGroup", "place_ranks"]

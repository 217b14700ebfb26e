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

The link between the machines (:meth:`LaunchGroup.watch_links`): once the run trains, every
launcher beats in the store (a counter per node) each time it polls for an abort, and every store
call is waited for at most ``--peer-timeout`` on a thread of its own (:class:`DeadlinedCalls`): a
TCPStore client's call over a link that went dead blocks in the kernel far past the store's own
timeout, which bounds waits for keys, not an unanswered request. So a partition is seen from both
sides within about ``--peer-timeout``: node 0 sees a node's beats stop (:attr:`LaunchGroup.unreachable`),
and a node that cannot reach node 0 gets a ``cut`` abort record of its own making. Node 0 is the
arbiter: the side without it always stops, so at most one side of a partition goes on.

Placement (:func:`place_ranks`): by the graph's ``machine`` labels where every node has one
(the labels in order of first appearance are nodes 0, 1, ...), else contiguous blocks.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from hopnet.errors import ConfigError, HopnetError, WaitTimeout
from hopnet.graph import Graph
from hopnet.rendezvous.store import HostedStore, connect_store, format_endpoint, host_store, parse_endpoint

if TYPE_CHECKING:
    import torch.distributed as dist

PREFIX = "hopnet-launch/"
POLL_S = 0.05


class StoreUnreachable(HopnetError):
    """Node 0's store did not answer a call in time: the link to node 0 is down (or node 0 hangs)."""


class DeadlinedCalls:
    """Calls made on one thread of its own, each waited for at most a deadline. Once one is
    late, every later call fails at once: the thread may be stuck in the kernel for minutes."""

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue[tuple[Callable[[], Any], queue.SimpleQueue[tuple[bool, Any]]]] = \
            queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.late: str | None = None
        """What the late call was, once one was."""

    def call(self, fn: Callable[[], Any], deadline_s: float, what: str) -> Any:
        if self.late is not None:
            raise StoreUnreachable(f"node 0's store stopped answering ({self.late})")
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="hopnet-launch-store", daemon=True)
            self._thread.start()
        answer: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        self._requests.put((fn, answer))
        try:
            ok, value = answer.get(timeout=deadline_s)
        except queue.Empty:
            self.late = f"{what} not answered within {deadline_s:g}s"
            raise StoreUnreachable(f"node 0's store stopped answering ({self.late})") from None
        if not ok:
            raise value
        return value

    def _serve(self) -> None:
        while True:
            fn, answer = self._requests.get()
            try:
                answer.put((True, fn()))
            except BaseException as exc:  # handed to the caller, raised there
                answer.put((False, exc))


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
        self.calls = DeadlinedCalls()
        self.call_deadline_s = timeout_s
        self.ranks_by_node: dict[int, tuple[int, ...]] = {}
        self.unreachable: dict[int, float] = {}
        """Node 0: the other nodes whose launcher stopped beating, with the seconds they were silent."""
        self.cut_off_s: float | None = None
        """Node R > 0: how long node 0's store had not answered when this node gave it up."""
        self._beats: dict[int, tuple[int, float]] = {}
        self._last_answer = time.monotonic()
        self._done: set[int] = set()
        self._expecting = False

    # -- the link between the machines, while the run trains
    def watch_links(self, peer_timeout_s: float, ranks_by_node: Mapping[int, Sequence[int]]) -> None:
        """From now on every store call waits at most ``peer_timeout_s``, and :meth:`aborted` beats
        and (node 0) watches the other nodes' beats (see the module docstring)."""
        self.call_deadline_s = peer_timeout_s
        self.ranks_by_node = {node: tuple(ranks) for node, ranks in ranks_by_node.items()}
        self._last_answer = time.monotonic()

    def _call(self, fn: Callable[[], Any], what: str) -> Any:
        if self.node_rank == 0:
            return fn()  # its own store, in this process: never cut off
        try:
            value = self.calls.call(fn, self.call_deadline_s, what)
        except StoreUnreachable:
            if self.cut_off_s is None:
                self.cut_off_s = time.monotonic() - self._last_answer
            raise
        self._last_answer = time.monotonic()
        return value

    def _beat_and_watch(self) -> None:
        self._call(lambda: self.store.add(f"{PREFIX}alive/{self.node_rank}", 1), "a beat")
        if self.node_rank != 0 or not self.ranks_by_node:
            return
        now = time.monotonic()
        for node in range(1, self.nnodes):
            if node in self.unreachable or node in self._done:
                continue
            if self.store.check([f"{PREFIX}done/{node}"]):
                self._done.add(node)
                continue
            count = int(self.store.add(f"{PREFIX}alive/{node}", 0))
            seen = self._beats.get(node)
            if seen is None or count != seen[0]:
                self._beats[node] = (count, now)
            elif (count > 0 or self._expecting) and now - seen[1] >= self.call_deadline_s:
                self.unreachable[node] = now - seen[1]

    def expect_beats(self) -> None:
        """Node 0: every machine's workers have joined, so every launcher beats by now: one that never
        did is held for unreachable too, counting from now."""
        if not self._expecting:
            self._expecting = True
            now = time.monotonic()
            self._beats = {node: (count, now) for node, (count, _) in self._beats.items()}

    # -- the run, from node 0
    def publish_run(self, info: dict[str, Any]) -> None:
        self.store.set(PREFIX + "run", json.dumps(info))

    def await_run(self, timeout_s: float) -> dict[str, Any]:
        self._wait([PREFIX + "run"], "node 0's launcher to publish the run", timeout_s)
        return json.loads(self.store.get(PREFIX + "run").decode("utf-8"))

    # -- failures
    def lose(self, count: int = 1) -> int | None:
        """Count lost workers; returns how many the run has lost on every machine (``None``: node 0's
        store is cut off, so the run's count is unknown)."""
        try:
            return int(self._call(lambda: self.store.add(PREFIX + "lost", count), "the count of lost workers"))
        except StoreUnreachable:
            return None

    def abort(self, record: dict[str, Any]) -> dict[str, Any]:
        """Ask every launcher to stop; returns the record that holds (an earlier one wins; this one
        when node 0's store is cut off)."""
        value = json.dumps(record)
        try:
            held = self._call(lambda: self.store.compare_set(PREFIX + "abort", "", value), "the abort record")
        except StoreUnreachable:
            return record
        return json.loads(held.decode("utf-8"))

    def aborted(self) -> dict[str, Any] | None:
        """Another launcher's abort record, if one was written; also beats and watches the beats
        (:meth:`watch_links`). A node cut off from node 0's store returns a ``cut`` record of its own."""
        try:
            if self.ranks_by_node:
                self._beat_and_watch()
            if not self._call(lambda: self.store.check([PREFIX + "abort"]), "the check for an abort"):
                return None
            return json.loads(self._call(lambda: self.store.get(PREFIX + "abort"), "the abort record").decode("utf-8"))
        except StoreUnreachable:
            return {"rank": None, "host": None, "node": 0, "cut": True,
                    "summary": f"node 0's launcher at {self.endpoint} did not answer node {self.node_rank} "
                               f"for {self.cut_off_s or self.call_deadline_s:.1f}s"}
        except Exception as exc:  # node 0's launcher (and its store) went away
            if self.node_rank == 0:
                raise
            return {"rank": None, "host": None, "node": 0,
                    "summary": f"lost node 0's launcher store at {self.endpoint} "
                               f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"}

    # -- the end
    def finish(self, timeout_s: float) -> None:
        """Say this launcher is done; node 0 keeps the store up until every launcher it can still
        reach said so."""
        try:
            if self.cut_off_s is None:
                self._call(lambda: self.store.set(f"{PREFIX}done/{self.node_rank}", "1"), "this launcher's end")
            if self.node_rank == 0:
                self._wait_for_ends(timeout_s)
        except (HopnetError, WaitTimeout, RuntimeError):
            pass
        finally:
            if self.hosted is not None:
                self.hosted.close()
                self.hosted = None

    def _wait_for_ends(self, timeout_s: float) -> None:
        """Node 0: wait until every other launcher said it is done, or stopped beating (it never will)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ranks_by_node:
                self._beat_and_watch()
            pending = [n for n in range(1, self.nnodes) if n not in self.unreachable and n not in self._done
                       and not self.store.check([f"{PREFIX}done/{n}"])]
            if not pending:
                return
            time.sleep(POLL_S)

    def _wait(self, keys: list[str], what: str, timeout_s: float) -> None:
        started = time.monotonic()
        while not self.store.check(keys):
            if self.waiting is not None and self.node_rank > 0:
                self.waiting(time.monotonic() - started)
            if time.monotonic() - started >= timeout_s:
                raise WaitTimeout(f"{what} on {self.endpoint}", waited_s=time.monotonic() - started)
            time.sleep(POLL_S)


__all__ = ["DeadlinedCalls", "LaunchGroup", "StoreUnreachable", "place_ranks"]

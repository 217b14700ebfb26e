"""A multi-machine run cut in two: the line that names the link, not a crash.

When the link between two machines goes down, each side's workers see the other side's ranks go
silent (no TCP reset comes, so nothing tells a partition from a hung host but the launchers: each
sees its own workers alive). The launchers see it too: node 0 stops hearing the other node's beats,
and the other node's calls to node 0's store go unanswered (:class:`~hopnet.launch.nodes.LaunchGroup`).
:func:`link_down_line` says so in one line, with the pairs of ranks the workers found unreachable
(``rank 3 unreachable from rank 0``), read from their ``error`` and ``peer_dead`` records.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hopnet.launch.blame import read_log_facts
from hopnet.launch.nodes import LaunchGroup, place_ranks
from hopnet.launch.state import RunState
from hopnet.launch.prepare import host_name
from hopnet.launch.worker_logs import peer_process, worker_log

if TYPE_CHECKING:
    from hopnet.launch.spec import LaunchPlan

LINK_GRACE_S = 1.0
"""How much longer than ``--peer-timeout`` a launcher waits for another machine's launcher before
it holds the link for down: its workers, which wait ``--peer-timeout``, name the ranks first."""


def _ranks(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def unreachable_pairs(run_dir: Path, local_ranks: Iterable[int], remote_ranks: Iterable[int]) -> list[tuple[int, int]]:
    """``(remote, local)`` for every remote rank a local rank declared dead or failed on, from the
    local ranks' event logs: the peers each local rank found unreachable."""
    remote = set(remote_ranks)
    pairs: set[tuple[int, int]] = set()
    for rank in local_ranks:
        facts = read_log_facts(worker_log(run_dir, rank))
        declared = (peer_process(run_dir, rank, peer) for peer in facts.declared_dead)
        pairs.update((peer, rank) for peer in declared if peer in remote)
        error = facts.error or {}
        peer = error.get("peer")
        peer = peer_process(run_dir, rank, peer) if isinstance(peer, int) else peer
        if isinstance(peer, int) and peer in remote and error.get("peer_state") == "dead":
            pairs.add((peer, rank))
    return sorted(pairs, key=lambda pair: (pair[1], pair[0]))


def link_down_line(run_dir: Path, here: int, there: int, ranks_by_node: Mapping[int, Sequence[int]],
                   silent_s: float, launcher_side: str) -> str:
    """``the link between node 0 (ranks 0, 1) and node 1 (ranks 2, 3) is down: rank 3 unreachable
    from rank 0, ...; node 1's launcher silent for 3.0s too``. ``launcher_side``: what this
    launcher saw of the other one (its beats stopped, or node 0's store stopped answering)."""
    mine, theirs = ranks_by_node.get(here, ()), ranks_by_node.get(there, ())
    pairs = unreachable_pairs(run_dir, mine, theirs)
    shown = "; ".join(f"rank {remote} unreachable from rank {local}" for remote, local in pairs[:4])
    if len(pairs) > 4:
        shown += f" (and {len(pairs) - 4} more)"
    if not shown:
        shown = f"{_ranks(list(theirs))} unreachable from {_ranks(list(mine))}" if theirs and mine else "unreachable"
    low, high = sorted((here, there))
    return (f"the link between node {low} ({_ranks(list(ranks_by_node.get(low, ())))}) and node {high} "
            f"({_ranks(list(ranks_by_node.get(high, ())))}) is down: {shown}; {launcher_side} for {silent_s:.1f}s")


class MachineLinks:
    """One launcher's watch on the links to the other machines' launchers (a multi-machine run)."""

    def __init__(self, group: LaunchGroup, run_dir: Path, plan: LaunchPlan, say: Callable[[str], None]) -> None:
        self.group = group
        self.run_dir = run_dir
        self.plan = plan
        self.say = say
        nnodes = plan.spec.nnodes
        self.ranks_by_node = {node: place_ranks(plan.graph, nnodes, node) for node in range(nnodes)}
        self._cut_nodes: set[int] = set()

    @property
    def node_rank(self) -> int:
        return self.group.node_rank

    def watch(self) -> None:
        self.group.watch_links(self.plan.config.peer_timeout_s + LINK_GRACE_S, self.ranks_by_node)

    def node_of(self, rank: int) -> int | None:
        return next((node for node, ranks in self.ranks_by_node.items() if rank in ranks), None)

    def suspect(self, blamed_peer: int | None) -> int | None:
        """The other machine a failure here may come from, whose launcher's word (or silence) to wait
        for: the blamed peer's, else one already cut off, else one whose ranks a local rank
        declared dead (a collective that failed on a closed connection names no peer)."""
        if blamed_peer is not None:
            node = self.node_of(blamed_peer)
            return node if node != self.node_rank else None
        if self.group.unreachable:
            return min(self.group.unreachable)
        if self.group.cut_off_s is not None:
            return 0
        others = [r for node, ranks in self.ranks_by_node.items() if node != self.node_rank for r in ranks]
        pairs = unreachable_pairs(self.run_dir, self.ranks_by_node[self.node_rank], others)
        return self.node_of(pairs[0][0]) if pairs else None

    def line(self, there: int, silent_s: float) -> str:
        side = (f"node {there}'s launcher silent" if self.node_rank == 0
                else f"node 0's launcher store at {self.group.endpoint} unanswered")
        return link_down_line(self.run_dir, self.node_rank, there, self.ranks_by_node, silent_s, side)

    def run_ends(self, state: RunState, remote: dict[str, Any] | None) -> bool:
        """After a poll for aborts (``remote``: what it found): whether a cut link ends the run.
        Node R > 0 cut off from node 0 stops. Node 0 counts the ranks of a machine whose launcher
        stopped beating as lost: past ``--max-failures`` the run stops naming the link, else the
        others go on."""
        if remote is not None and remote.get("cut"):
            line = self.line(0, self.group.cut_off_s or 0.0)
            self.say(line)  # now: the workers' stop may take --grace, and the summary comes after it
            state.fail(None, "cut off", "stopping: " + line)
            return True
        if self.node_rank != 0:
            return False
        max_failures = self.plan.spec.max_failures
        for node, silent_s in sorted(self.group.unreachable.items()):
            if node in self._cut_nodes:
                continue
            self._cut_nodes.add(node)
            line = self.line(node, silent_s)
            total = self.group.lose(len(self.ranks_by_node[node])) or 0
            if total > max_failures:
                self.say(line)
                state.fail(None, "link down", line)
                self.group.abort({"rank": None, "host": host_name(self.plan.bind), "node": 0, "summary": line})
                return True
            self.say(f"{line}; its ranks are lost, the others go on ({total} of --max-failures {max_failures})")
        return False

    def say_late_cuts(self) -> None:
        """Node 0, at the end: the machines found cut off only while it waited for their launchers'
        end (its own workers had finished, with backup workers, without them)."""
        for node, silent_s in sorted(self.group.unreachable.items()):
            if node not in self._cut_nodes:
                self._cut_nodes.add(node)
                self.say(f"{self.line(node, silent_s)}; its ranks were lost")

    def blame_the_link(self, state: RunState, there: int, held: dict[str, Any] | None, rank: int) -> bool:
        """While a launcher whose rank failed on a peer of machine ``there`` waits for that machine's
        word: whether the link to it is down (then the failure is the link's, and the run stops
        naming it)."""
        if not (held is not None and held.get("cut") or there in self.group.unreachable):
            return False
        silent_s = self.group.unreachable.get(there, self.group.cut_off_s or 0.0)
        state.first_failure = None
        self._cut_nodes.add(there)
        state.fail(rank, "link down", self.line(there, silent_s))
        self.group.abort({"rank": rank, "host": host_name(self.plan.bind), "node": self.node_rank,
                          "summary": state.summary})
        return True


__all__ = ["LINK_GRACE_S", "MachineLinks", "link_down_line", "unreachable_pairs"]

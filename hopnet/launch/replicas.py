"""A replica group fails as a unit: the launcher's side of ``--replica-size``.

When one process of a replica exits non-zero (or is killed as silent), the launcher kills the
rest of its replica at once: they would otherwise wait in the replica's collectives until
``--timeout``, and their lanes would go on with a replica that lost a shard. ``--max-failures``
counts the replicas lost, not the processes; ``--max-restarts`` brings the replica back as one.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Protocol

from hopnet.launch.blame import describe_exit
from hopnet.launch.processes import kill_group
from hopnet.launch.restarts import Restart, RestartBudget
from hopnet.replica.layout import ReplicaLayout


def lost_replicas(layout: ReplicaLayout, lost_ranks: Iterable[int]) -> int:
    """How many replicas the lost processes belong to."""
    return len({layout.replica_of(rank) for rank in lost_ranks})


def stop_replica_of(layout: ReplicaLayout, rank: int, pending: Collection[int], pids: dict[int, int],
                    kill: Callable[[int, int], None], say: Callable[[str], None]) -> list[int]:
    """SIGKILL the still-running processes of ``rank``'s replica; returns their ranks."""
    if not layout.grouped:
        return []
    replica = layout.replica_of(rank)
    siblings = [r for r in layout.members(replica) if r != rank and r in pending and r in pids]
    for sibling in siblings:
        kill(pids[sibling], signal.SIGKILL)
    if siblings:
        say(f"rank {rank} ended {layout.describe(replica)}: stopping "
            f"{'rank' if len(siblings) == 1 else 'ranks'} {', '.join(map(str, siblings))} with it")
    return siblings


SIBLING_GRACE_S = 0.5
"""How long a replica member's error exit waits for a sibling's death by a signal to show: that death
ended the replica, and the error followed from it (the member's collectives with it broke)."""


class _Process(Protocol):
    pid: int

    def poll(self) -> int | None: ...


def killed_sibling(layout: ReplicaLayout, rank: int, code: int, procs: Mapping[int, _Process], *,
                   exclude: Collection[int] = (), grace_s: float = SIBLING_GRACE_S) -> int | None:
    """The sibling of ``rank`` that a signal killed, seen within ``grace_s``, when ``rank`` itself exited
    with an error (``code`` > 0): that death ended the replica, and ``rank``'s failure followed from it."""
    if not layout.grouped or code <= 0:
        return None
    siblings = [r for r in layout.members(layout.replica_of(rank)) if r != rank and r in procs and r not in exclude]
    deadline = time.monotonic() + grace_s
    while True:
        killed = [r for r in siblings if (c := procs[r].poll()) is not None and c < 0]
        if killed:
            return killed[0]
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


def end_replica(layout: ReplicaLayout, rank: int, code: int, procs: Mapping[int, _Process], pending: Collection[int],
                with_replica: dict[int, int], say: Callable[[str], None], grace_s: float = SIBLING_GRACE_S) -> bool:
    """``rank`` exited with ``code`` (not 0): its replica fails as a unit. Its running siblings are stopped
    (:func:`stop_replica_of`), each recorded in ``with_replica`` as ended by ``rank``. False when ``rank``
    exited with an error and a sibling had been killed by a signal (within ``grace_s``): that sibling ended
    the replica, and ``rank`` is recorded as ended with it, never as a cause; the sibling's own exit,
    processed next, counts the replica."""
    killed = killed_sibling(layout, rank, code, procs, exclude=with_replica, grace_s=grace_s)
    if killed is not None:
        with_replica[rank] = killed
        say(f"rank {killed} ended {layout.describe(layout.replica_of(rank))}: rank {rank} failed with it")
        return False
    running = {r: p.pid for r, p in procs.items() if p.poll() is None}
    with_replica.update(dict.fromkeys(stop_replica_of(layout, rank, pending, running, kill_group, say), rank))
    return True


def restart_replica(budget: RestartBudget, layout: ReplicaLayout, rank: int, code: int, reason: str, *, ending: bool,
                    pending: Collection[int], procs: Mapping[int, _Process], say: Callable[[str], None],
                    grace_s: float = SIBLING_GRACE_S) -> Restart | None:
    """Under ``--max-restarts`` a replica comes back as a unit: the first of its processes to die decides
    for all of them (a sibling killed by a signal, rather than ``rank`` when ``rank``'s error followed
    from that death: :func:`killed_sibling`), and the others still running are stopped now; each of
    them is restarted as it ends, under the same number. ``None``: ``rank`` stays dead."""
    following = budget.follow(rank)
    if following is not None:
        return following
    members = tuple(layout.members(layout.replica_of(rank)))
    others = any(r not in members for r in pending)  # no other replica left to take a state from
    cause, cause_code, cause_reason = rank, code, reason
    killed = killed_sibling(layout, rank, code, procs, grace_s=grace_s)
    if killed is not None:
        cause, cause_code = killed, procs[killed].poll() or 0
        cause_reason = describe_exit(cause_code)
    restart = budget.decide_replica(members, cause, cause_code, cause_reason, ending=ending or not others, seen=rank)
    if restart is None:
        return None
    running = {r: p.pid for r, p in procs.items() if p.poll() is None}
    stop_replica_of(layout, cause, pending, running, kill_group, say)
    return restart if cause == rank else budget.follow(rank)


def replicas_note(layout: ReplicaLayout) -> str:
    """`` in 2 replicas of 2 (ddp)`` for the launcher's first line; nothing without groups."""
    return f" in {layout.replicas} replicas of {layout.size} ({layout.mode})" if layout.grouped else ""


__all__ = ["SIBLING_GRACE_S", "end_replica", "killed_sibling", "lost_replicas", "replicas_note", "restart_replica", "stop_replica_of"]

"""Workers that are declared dead but whose process is still there.

A worker that stops answering (SIGSTOP, a hang in native code, a machine swapping itself
to death) does not exit, so the launcher, which reacts to exits, would wait for it for
ever. Two things tell the launcher about such a worker:

* its peers: a worker that declares a neighbour dead (``--peer-timeout`` of silence, or
  the coordinator's notice) writes a ``peer_dead`` record and flushes it at once;
  :class:`DeathWatch` follows every local rank's event log for them;
* its own process: a worker stopped (state ``T`` in ``/proc/PID/stat``) for longer than
  ``--peer-timeout`` is silent to everyone, whether or not a peer is left to notice.

The launcher then kills the process with SIGKILL (the only signal a stopped process acts
on), and the worker counts as lost: within ``--max-failures`` the others go on; with
``--max-restarts`` it may be replaced instead (:mod:`hopnet.launch.restarts`). After
:meth:`DeathWatch.restarted`, the ``peer_dead`` records about the rank written before its
replacement started (their ``mono`` is older: the clock is shared by the processes of one
machine) are about the dead process and are ignored, and the stopped-process check follows
the new pid.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hopnet.report.rundir import LogTail
from hopnet.launch.worker_logs import peer_process, worker_log


@dataclass(frozen=True)
class Declaration:
    """Why the launcher holds ``rank`` for dead while its process runs."""

    rank: int
    reason: str
    """``declared dead by rank 2 after 5.0 s of silence, in iteration 427`` or
    ``stopped (SIGSTOP) for 5.0 s``."""
    iteration: int | None = None
    """The iteration its declarer was in (the one it waited in), when a peer declared it."""


def process_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` from ``/proc`` (``R``, ``S``, ``T``...), ``None`` if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return None
    fields = stat.rsplit(b")", 1)[-1].split()
    return fields[0].decode() if fields else None


class DeathWatch:
    """Finds the ranks the launcher should kill: declared dead by a peer, or stopped too long.

    :meth:`poll` is cheap (new log lines and one ``/proc`` read per running worker) and
    returns each rank once."""

    def __init__(self, run_dir: Path, ranks: Iterable[int], stopped_limit_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.run_dir = run_dir
        self.tails = {rank: LogTail(worker_log(run_dir, rank), containing=b"peer_dead") for rank in ranks}
        self.stopped_limit_s = stopped_limit_s
        self.clock = clock
        self.found: dict[int, Declaration] = {}
        self._stopped_since: dict[int, float] = {}
        self._replaced_at: dict[int, tuple[float, int]] = {}
        """Rank -> ``mono`` at which its current process (a replacement) started, and its restart number."""

    def restarted(self, rank: int, mono: float, number: int) -> None:
        """``rank`` runs again in a new process, its ``number``-th replacement, started at ``mono``
        (``time.monotonic()``): watch it afresh, ignoring what was said about the processes it replaces."""
        self.found.pop(rank, None)
        self._stopped_since.pop(rank, None)
        self._replaced_at[rank] = (mono, number)

    def _about_replaced(self, peer: int, record: Mapping[str, object]) -> bool:
        """Whether ``record`` is about a process of ``peer`` older than its current one: by the
        restart number it names (a peer may hear of the old one's death after the new one started),
        else by its time."""
        current = self._replaced_at.get(peer)
        if current is None:
            return False
        since, number = current
        about = record.get("restart")
        if isinstance(about, int) and not isinstance(about, bool):
            return about < number
        mono = record.get("mono")
        return not isinstance(mono, (int, float)) or mono < since

    def poll(self, running: Mapping[int, int]) -> list[Declaration]:
        """New declarations about the ranks of ``running`` (rank -> pid)."""
        new: list[Declaration] = []
        for declarer, tail in self.tails.items():
            for record in tail.read():
                if record.get("event") != "peer_dead":
                    continue
                peer = record.get("peer")
                peer = peer_process(self.run_dir, declarer, peer) if isinstance(peer, int) else peer
                if not isinstance(peer, int) or peer in self.found or peer not in running \
                        or self._about_replaced(peer, record):
                    continue
                iteration = record.get("iter")
                silent_s, cause = record.get("silent_s"), record.get("cause")
                silence = (f" ({cause})" if isinstance(cause, str)  # its transport found it gone
                           else f" after {silent_s:.1f} s of silence" if isinstance(silent_s, (int, float)) else "")
                where = f", in iteration {iteration}" if isinstance(iteration, int) else ""
                new.append(self._found(Declaration(peer, f"declared dead by rank {declarer}{silence}{where}",
                                                   iteration if isinstance(iteration, int) else None)))
        now = self.clock()
        for rank, pid in running.items():
            if rank in self.found:
                continue
            if process_state(pid) != "T":
                self._stopped_since.pop(rank, None)
                continue
            since = self._stopped_since.setdefault(rank, now)
            if now - since >= self.stopped_limit_s:
                new.append(self._found(Declaration(rank, f"stopped (state T) for {now - since:.1f} s")))
        return new

    def _found(self, declaration: Declaration) -> Declaration:
        self.found[declaration.rank] = declaration
        return declaration

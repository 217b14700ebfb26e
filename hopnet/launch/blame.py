"""Which rank caused a failed run, in one line.

When one worker fails, others usually fail because of it: they time out waiting for
its updates, or cannot go on once it left. The launcher collects how every rank ended
(:class:`RankEnd`: what it saw, plus the rank's ``error`` record and last iteration
from its event log) and :func:`explain` follows the blame from the first failure to
the rank at its root:

* the first failure is the earliest ``error`` record, except that a rank that ended without one
  (killed by a signal, or gone silent and killed) comes first: it left no time, and the records
  of the failures it caused come after it, some naming no one (a torch.distributed collective
  fails "Connection closed by peer" on every member);
* a rank whose ``error`` record names a ``peer`` blames that peer;
* the chain ends at a rank with an error of its own (an exception, ``sys.exit(N)``),
  one that died (killed by a signal), one that left early (exit 0 while others ran on),
  or one still running when the launcher stopped the run (it stalled).

The iteration in the line. A rank's own ``error`` record is exact: the rank wrote it at
the moment it ended. A rank that left none (killed by SIGKILL, or stopped by SIGSTOP and
then killed) cannot be placed by its own log: records reach the file in batches, so its
last flushed ``iteration`` record may lag where it was by many iterations. Such a rank is
placed where its neighbours waited for it: the *lowest* iteration among the ``error``
records of the ranks that blame it, else among the ``peer_dead`` records that declare it
dead (``... while its neighbours waited in iteration 427``). The lowest, because a
neighbour that waits on a rank can be ahead of it by the protocol's staleness but has not
got past it, so the lowest is the nearest to where the silent rank stopped. With neither,
the line says only what its log proves: ``after iteration 418``, its last logged one.

:func:`explain` is pure (records in, summary out); :func:`read_log_facts` reads what
it needs from a rank's event log, tolerating missing, partial and corrupt files.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TAIL_BYTES = 256 << 10
"""How much of the end of an event log :func:`read_log_facts` reads (the records it needs are last)."""

STOPPED_BY_LAUNCHER = ("Terminated",)
"""``error`` record classes of ranks that the launcher stopped (not failures of their own)."""


@dataclass(frozen=True)
class RankEnd:
    """How one rank ended, as the launcher saw it and as its event log tells."""

    rank: int
    exit_code: int | None
    """Its exit status (negative: killed by that signal); ``None`` if it never exited."""
    stopped: bool = False
    """Still running when the launcher stopped the run (whatever it exited with after)."""
    order: int = 0
    """Position among the ranks that ended on their own (0 = first)."""
    error: Mapping[str, Any] | None = None
    """Its last ``error`` event record, if it wrote one."""
    last_iter: int | None = None
    """The last iteration it completed (its last ``iteration`` record)."""
    declared_dead: Mapping[int, int] = field(default_factory=dict)
    """The peers it declared dead (``peer_dead`` records), each with the iteration it was in then."""
    silent: str | None = None
    """Why the launcher held it for dead and killed it (it went silent), if it did."""

    @property
    def failed_on_its_own(self) -> bool:
        """It failed before the launcher stopped it: its error record says so, or its exit status."""
        if self.error is not None:
            return self.error.get("error") not in STOPPED_BY_LAUNCHER
        return not self.stopped and self.exit_code not in (None, 0)


@dataclass(frozen=True)
class Blame:
    rank: int
    """The rank at the root of the failure."""
    reason: str
    """Short: ``exit code 3``, ``killed by SIGKILL``, ``stalled``, ``left early``..."""
    summary: str
    """The one line the launcher prints."""
    followers: tuple[int, ...] = ()
    """Ranks that failed because of it."""


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _ranks(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _blamed_peer(end: RankEnd) -> int | None:
    return _int_or_none(end.error.get("peer")) if end.error else None


def _sort_key(end: RankEnd) -> tuple[int, float, int]:
    """Failures in the order they happened, as far as the records tell. A rank that ended without
    an ``error`` record (killed by a signal, or gone silent and killed) left no time, and comes
    first: the failures that follow such a death often cannot name it (a torch.distributed
    collective fails "Connection closed by peer" on every member, naming none), and their records,
    written after it, would otherwise make one of them the root."""
    if end.error is None:
        return (0, 0.0, end.order)
    mono = end.error.get("mono")
    return (1, float(mono) if isinstance(mono, (int, float)) and not isinstance(mono, bool) else float("inf"),
            end.order)


def _root_of(first: RankEnd, ends: Mapping[int, RankEnd]) -> RankEnd:
    seen = {first.rank}
    current = first
    while (peer := _blamed_peer(current)) is not None and peer in ends and peer not in seen:
        seen.add(peer)
        current = ends[peer]
    return current


def _what_followers_did(followers: Sequence[RankEnd]) -> str:
    kinds = {str(f.error.get("error")) for f in followers if f.error}
    if kinds == {"WaitTimeout"}:
        return "timed out waiting for its updates"
    if kinds == {"PeerFailure"}:
        return "could not go on without it"
    return "failed because of it"


def _own_iteration(end: RankEnd) -> int | None:
    """The iteration its own ``error`` record says it was in, if it wrote one."""
    return _int_or_none(end.error.get("iter")) if end.error else None


def _iteration(end: RankEnd) -> int | None:
    """The iteration a follower was in when it failed: its error record's, else after its last one."""
    own = _own_iteration(end)
    if own is not None:
        return own
    return None if end.last_iter is None else end.last_iter + 1


def _where(root: RankEnd, followers: Sequence[RankEnd], ends: Sequence[RankEnd]) -> str:
    """Where ``root`` was when it ended, as the summary says it (see the module docstring)."""
    if root.error is not None:
        own = _iteration(root)
        return f" in iteration {own}" if own is not None else ""
    waited = [i for f in followers if (i := _own_iteration(f)) is not None]
    if not waited:
        waited = [it for end in ends if end.rank != root.rank
                  if (it := end.declared_dead.get(root.rank)) is not None]
    if waited:
        return f" while its neighbours waited in iteration {min(waited)}"
    return f" after iteration {root.last_iter}" if root.last_iter is not None else ""


def explain(ends: Sequence[RankEnd]) -> Blame | None:
    """Name the rank that caused the run to fail, or ``None`` if no rank failed."""
    by_rank = {end.rank: end for end in ends}
    failures = sorted((e for e in ends if e.failed_on_its_own), key=_sort_key)
    if not failures:
        return None
    root = _root_of(failures[0], by_rank)
    followers = [f for f in failures if f.rank != root.rank and _blamed_peer(f) == root.rank]
    consequence = f": {_ranks([f.rank for f in followers])} {_what_followers_did(followers)}" if followers else ""
    follower_iters = [i for f in followers if (i := _iteration(f)) is not None]
    in_iter = _where(root, followers, ends)

    if root.failed_on_its_own:
        error = root.error
        code = _int_or_none(error.get("exit_code")) if error else None
        code = code if code is not None else int(root.exit_code or 0)
        reason = describe_exit(code)
        if root.silent is not None:
            reason = "went silent"
            summary = f"rank {root.rank} went silent{in_iter} ({root.silent}; the launcher killed it)"
        elif code < 0:
            summary = f"rank {root.rank} died ({reason}){in_iter}"
        elif error is None or error.get("error") in ("SystemExit", "Exit"):
            summary = f"worker {root.rank} failed ({reason})"
        else:
            summary = f"worker {root.rank} failed{in_iter} ({reason}): {error.get('error')}: {error.get('message')}"
        if followers:
            summary += f"; then {_ranks([f.rank for f in followers])} {_what_followers_did(followers)}"
        return Blame(root.rank, reason, summary, tuple(f.rank for f in followers))

    states = {f.error.get("peer_state") for f in followers if f.error and f.error.get("peer_state")}
    if root.exit_code == 0 and not root.stopped:
        last = f" after iteration {root.last_iter}" if root.last_iter is not None else " early"
        ran_on = f" while its neighbours ran on to iteration {max(follower_iters)}" if follower_iters else ""
        return Blame(root.rank, "left early", f"rank {root.rank} left{last}{ran_on}{consequence}",
                     tuple(f.rank for f in followers))
    state = "stalled"
    if "dead" in states or any(root.rank in end.declared_dead for end in ends):
        state = "went silent"
    elif "departed" in states:
        state = "left"
    return Blame(root.rank, state, f"rank {root.rank} {state}{in_iter}{consequence}",
                 tuple(f.rank for f in followers))


@dataclass(frozen=True)
class LogFacts:
    error: dict[str, Any] | None = None
    last_iter: int | None = None
    declared_dead: dict[int, int] = field(default_factory=dict)
    """Peer -> the iteration of this rank's first ``peer_dead`` record naming it."""


def parse_log_tail(text: str) -> LogFacts:
    """The last ``error`` record, the last completed iteration and the peers declared dead
    among JSON lines (a cut first or last line and lines that are not JSON objects are skipped)."""
    error: dict[str, Any] | None = None
    last_iter: int | None = None
    declared_dead: dict[int, int] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        event = record.get("event")
        if event == "error":
            error = record
        elif event == "iteration" and (it := _int_or_none(record.get("iter"))) is not None:
            last_iter = it if last_iter is None else max(last_iter, it)
        elif event == "peer_dead" and (peer := _int_or_none(record.get("peer"))) is not None:
            if (it := _int_or_none(record.get("iter"))) is not None:
                declared_dead.setdefault(peer, it)
    return LogFacts(error, last_iter, declared_dead)


def read_log_facts(path: str | os.PathLike[str], tail_bytes: int = TAIL_BYTES) -> LogFacts:
    """:func:`parse_log_tail` of the end of the file at ``path``; empty facts if it cannot be read."""
    try:
        with Path(path).open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - tail_bytes))
            data = handle.read()
    except OSError:
        return LogFacts()
    return parse_log_tail(data.decode("utf-8", errors="replace"))

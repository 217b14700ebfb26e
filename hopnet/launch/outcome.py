"""How a launch ended, in one line: the launcher's last phase before the report.

:func:`blame_run` names the rank at the root of a failure from every rank's event log
(:mod:`hopnet.launch.blame`); :func:`conclude` decides the exit status and the closing
line from the :class:`~hopnet.launch.state.RunState` the earlier phases left. A run that
every failing rank left with a :class:`~hopnet.errors.ConfigError` before any iteration
ended on a configuration error (:func:`config_error`): the launcher says it once, as its
own ``error:`` line, and exits 2.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hopnet.launch.blame import Blame, RankEnd, explain, read_log_facts
from hopnet.launch.state import RunState
from hopnet.launch.worker_logs import peer_process, worker_log


def plural_ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _exits(state: RunState, lost: dict[int, int]) -> str:
    return ", ".join(f"{r}: {state.describe_end(r, c)}" for r, c in sorted(lost.items()))


def blame_run(run_dir: Path, state: RunState) -> Blame:
    """Read every rank's event log and name the rank that caused the failure."""
    position = {rank: i for i, rank in enumerate(state.exit_order)}
    stopped = state.stopped | set(state.with_replica)  # killed by the launcher: never the cause
    ends = []
    for rank, code in state.returncodes.items():
        facts = read_log_facts(worker_log(run_dir, rank))
        ends.append(RankEnd(rank=rank, exit_code=code, stopped=rank in stopped,
                            order=position.get(rank, len(position)), error=facts.error, last_iter=facts.last_iter,
                            silent=state.silent.get(rank),
                            declared_dead={peer_process(run_dir, rank, p): it for p, it in facts.declared_dead.items()}))
    blame = explain(ends)
    if blame is not None:
        return blame
    lost = state.lost
    rank = min(lost, key=lambda r: position.get(r, len(position)))  # no record to go by: the first to exit
    reason = state.describe_end(rank, lost[rank])
    return Blame(rank, reason, f"worker {rank} failed ({reason})")


def config_error(run_dir: Path, state: RunState) -> str | None:
    """The message of the configuration error that ended the run before it trained, if one did:
    every failed rank exited 2 with an ``error`` record of an exception (a
    :class:`~hopnet.errors.ConfigError` or a subclass, such as the rendezvous's refusal of
    ranks that run different options; not ``sys.exit(2)``), which the workers launched by
    `hopnet launch` leave to the launcher to print, and no rank finished an iteration. The
    lowest rank's message, when ranks differ."""
    lost = state.lost
    if not lost:
        return None
    messages: dict[int, str] = {}
    for rank in state.returncodes:
        facts = read_log_facts(worker_log(run_dir, rank))
        if facts.last_iter is not None:
            return None
        if rank in lost:
            if lost[rank] != 2 or facts.error is None or facts.error.get("error") in (None, "SystemExit"):
                return None
            messages[rank] = str(facts.error.get("message"))
    return messages[min(messages)]


def conclude(state: RunState, run_dir: Path, *, max_failures: int, world_size: int,
             machine: str | None = None, replica_size: int = 1) -> None:
    """Settle ``state``'s exit status, failed rank, reason and closing line once every worker ended.

    ``machine`` names this launcher in a multi-machine run (``"HOST, node N"``): the closing
    line then says where the blamed rank runs. A launcher that was signalled says nothing more.
    ``replica_size``: processes per replica; ``max_failures`` counts replicas.
    """
    if state.signal is not None:
        return
    lost = state.lost
    if state.coordinator_exit is not None:
        if lost and state.summary is not None:
            state.summary += f"; then {plural_ranks(sorted(lost))} failed ({_exits(state, lost)})"
        return
    if state.failed_rank is not None or state.summary is not None:
        return  # a phase already named the failure (a worker that did not start, another machine)
    failures = len({rank // replica_size for rank in lost})  # replicas fail as units (hopnet.launch.replicas)
    if failures > max_failures or (state.first_failure is not None and machine is not None):
        message = config_error(run_dir, state)
        if message is not None:
            state.fail(min(lost), "config error", f"error: {message}", returncode=2)
            state.config_error = True
            return
        blame = blame_run(run_dir, state)
        summary = blame.summary if machine is None else f"{blame.summary} [rank {blame.rank} runs on {machine}]"
        state.fail(blame.rank, blame.reason, summary)
    elif lost:
        state.summary = (f"lost {plural_ranks(sorted(lost))} ({_exits(state, lost)}); "
                         f"the other {world_size - len(lost)} workers finished")


__all__ = ["blame_run", "conclude", "config_error", "plural_ranks"]

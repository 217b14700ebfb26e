"""More busy workers than cores: what the workers waited for was a core, not a peer.

Each worker records, at its start and once training is over, how long its threads ran and how
long they waited runnable for a core (``cpu_s``, ``runq_s``: :mod:`hopnet.runtime.cpu_time`).
Where the workers of one machine spent a notable share of their training time waiting for a core
(they outnumber its cores, or other processes kept them busy), their waits on each other are
CPU contention: a link looks slow because its receiver, or its sender, was not running. No
protocol option gives a worker a core, so the diagnosis says so instead of suggesting options
(:mod:`hopnet.report.diagnosis`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from hopnet.report.rundir import Record, RunData

CONTENDED_SHARE = 0.25
"""A machine is contended when its workers' threads waited runnable for a core this many seconds per
second of training or more (the median worker's): CPU-bound workers that outnumber the cores twice
wait about half of it. A worker that mostly sleeps (waits on its peers, or on I/O) waits little for a
core even on a busy machine."""


@dataclass(frozen=True)
class Contention:
    host: str
    workers: int
    """Processes training on the machine (a replica group's processes count one each)."""
    cores: int
    shares: dict[int, float]
    """Per rank logged on the machine: the share of its threads' runnable time spent waiting for a core."""

    @property
    def oversubscribed(self) -> bool:
        return self.workers > self.cores

    def words(self) -> str:
        low, high = min(self.shares.values()), max(self.shares.values())
        share = f"{low:.2f} s" if round(low, 2) == round(high, 2) else f"{low:.2f}-{high:.2f} s"
        who = (f"{self.workers} busy workers share {self.cores} cores on {self.host}" if self.oversubscribed else
               f"the threads of {self.workers} workers (each computes and talks at once) and of any other process "
               f"outnumbered the {self.cores} cores of {self.host}")
        return (f"{who}: each worker waited runnable for a core {share} per second of training, so the waits on "
                "its peers are CPU contention, not a slow link or a straggler")

    def advice(self) -> str:
        where = (f"run at most {self.cores} busy workers on {self.host} (for example `--nproc {self.cores}`)"
                 if self.oversubscribed else f"give each worker two cores of {self.host}, or measure with them free")
        return f"no option suggested: no protocol option gives a worker a core; {where}"


def _times(records: list[Record]) -> tuple[str, int, float, int] | None:
    """(host, cores, seconds waiting for a core per second, processes per rank) of this rank's last
    process while it trained, from its ``start`` and first ``cpu`` record after it."""
    start = next((r for r in reversed(records) if r.get("event") == "start"), None)
    if start is None or not isinstance(start.get("host"), str) or not isinstance(start.get("cores"), int):
        return None
    after = records[records.index(start):]
    end = next((r for r in after if r.get("event") == "cpu"), None)
    numbers = [start.get("mono"), start.get("runq_s"), end.get("mono") if end else None,
               end.get("runq_s") if end else None]
    if not all(isinstance(n, (int, float)) for n in numbers):
        return None
    began, queued_before, ended, queued_after = (float(n) for n in numbers)  # type: ignore[arg-type]
    if ended <= began:
        return None
    size = start.get("replica_size")
    return (start["host"], start["cores"], (queued_after - queued_before) / (ended - began),
            size if isinstance(size, int) and size > 0 else 1)


def core_waits(run: RunData) -> dict[int, float]:
    """Per rank, the seconds its threads waited runnable for a core per second of training (ranks
    without ``start`` and ``cpu`` records left out)."""
    return {rank: max(0.0, found[2]) for rank, records in sorted(run.events.items())
            if (found := _times(records)) is not None}


def contention(run: RunData) -> list[Contention]:
    """The machines whose workers waited runnable for a core :data:`CONTENDED_SHARE` s per second of
    training or more (the median worker's)."""
    by_host: dict[str, list[tuple[int, int, float, int]]] = {}
    for rank, records in sorted(run.events.items()):
        found = _times(records)
        if found is not None:
            host, cores, share, size = found
            by_host.setdefault(host, []).append((rank, cores, share, size))
    found_contention = []
    for host, ranks in sorted(by_host.items()):
        workers = sum(size for _, _, _, size in ranks)
        cores = min(cores for _, cores, _, _ in ranks)
        shares = {rank: max(0.0, share) for rank, _, share, _ in ranks}
        if statistics.median(shares.values()) >= CONTENDED_SHARE:
            found_contention.append(Contention(host, workers, cores, shares))
    return found_contention


__all__ = ["CONTENDED_SHARE", "Contention", "contention", "core_waits"]

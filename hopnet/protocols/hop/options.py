"""Hop's options (Table 1's settings), its message kinds, and what the algorithm and the declaration
(:mod:`.spec`) both read of them. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from hopnet.errors import ConfigError
from hopnet.options import option
from hopnet.protocols.local_steps import LocalStepsOptions

WELCOME = "hop_welcome"
"""Worker -> a neighbour's replacement (``--max-restarts``): the iteration it is in, and, when it
sends updates to that neighbour, its update of that iteration (the one the dead process got)."""


# ---------------------------------------------------------------------- options
def parse_backup_workers(text: str | int | dict[int, int] | dict[str, int] | None) -> int | dict[int, int]:
    """``N`` (every rank) or ``R:N,R:N`` (per rank; unnamed ranks get 0)."""
    if text is None:
        return 0
    if isinstance(text, bool):
        raise ConfigError(f"--backup-workers must be a count, not {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"--backup-workers must be >= 0 (got {text})")
        return text
    if isinstance(text, dict):
        return {int(k): int(v) for k, v in text.items()}
    text = text.strip()
    if ":" not in text:
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(f"--backup-workers {text!r}: expected N or R:N,R:N") from None
        if value < 0:
            raise ConfigError(f"--backup-workers must be >= 0 (got {value})")
        return value
    result: dict[int, int] = {}
    for item in text.split(","):
        try:
            rank_text, count_text = item.split(":")
            rank, count = int(rank_text), int(count_text)
        except ValueError:
            raise ConfigError(f"--backup-workers {text!r}: expected N or R:N,R:N") from None
        if rank < 0 or count < 0:
            raise ConfigError(f"--backup-workers {text!r}: ranks and counts must be >= 0")
        if rank in result:
            raise ConfigError(f"--backup-workers {text!r}: rank {rank} given twice")
        result[rank] = count
    return result


DEFAULT_MAX_IG = 2
STREAM_MIB_TORCH = 16.0
"""Default chunk size of streamed updates on the torch plane: its threshold under ``--bulk auto``
(:data:`hopnet.bootstrap.plane.AUTO_CPU_MIN_BYTES`), so the chunks of a CPU model take gloo there, as
whole updates did (twice as fast as ZeroMQ at 100 MB: docs/performance/archive.md, "Streamed updates")."""
STREAM_MIB_ZMQ = 2.0
STREAM_DEFAULT_MIN_MIB = 256.0
"""Without ``--stream-mib``, only updates of this size or more stream. Streaming bounds memory but
costs speed where the transfers are a large part of the iteration: at 100 MB it took Hop's
defaults from 4.0x to 3.3x the model in memory and from 1.44 to 1.01-1.16 it/s on the reference
VM; at 400 MB it took them from 4.0x to 2.3x, where the memory is what limits the model size."""
"""Default chunk size with ``--bulk zmq``: the ROUTER takes in up to
:data:`hopnet.transports.zmq.RCVHWM` messages per in-neighbour ahead of the reader, so small chunks
keep that backlog small."""


@dataclass(frozen=True)
class HopOptions(LocalStepsOptions):
    """Hop's options (Table 1's settings). With ``--local-steps H`` a worker mixes every H iterations,
    and everything Table 1 bounds counts rounds of H iterations (docs/protocols/local-steps.md)."""

    max_ig: int = option(DEFAULT_MAX_IG, minimum=1, metavar="N",
                         help="maximum iteration gap between neighbours, via token queues")
    token_queues: bool = option(True, help="turn token queues off (the gap is then bounded by path lengths only)")
    serial: bool = option(False, help="serial approach: compute, apply, send, then reduce (default: parallel)")
    backup_workers: int | dict[int, int] = option(0, metavar="N|R:N,...", parse=parse_backup_workers,
                                                  help="updates a worker may go without per iteration: one "
                                                       "number or per rank")
    staleness: int | None = option(None, minimum=0, metavar="S",
                                   help="bounded staleness: use neighbours' newest update if no older than k-S")
    skip_threshold: int | None = option(None, minimum=1, metavar="T",
                                        help="skip iterations when more than T behind every out-neighbour")
    max_jump: int | None = option(None, minimum=1, metavar="J", help="at most J iterations per skip")
    stream_mib: float | None = option(None, minimum=0, metavar="MIB",
                                      help="send an update larger than this many MiB as chunks of this size, "
                                           "each mixed as it arrives (0: never; not with --staleness; default: "
                                           "updates of 256 MiB or more stream, in chunks of 16 MiB on the "
                                           "torch plane, 2 with --bulk zmq)")
    hold_back: bool = option(True, help="take neighbours' updates of the next iteration in as they come (the torch "
                                        "plane's default holds them at their senders until this iteration is "
                                        "mixed: a model's size less memory, some rate where transfers dominate)")

    def __post_init__(self) -> None:
        object.__setattr__(self, "backup_workers", parse_backup_workers(self.backup_workers))
        super().__post_init__()

    def check(self) -> None:
        if (self.max_jump is None) != (self.skip_threshold is None):
            raise ConfigError("--skip-threshold and --max-jump go together")
        if self.skip_threshold is not None and not self.token_queues:
            raise ConfigError("iteration skipping needs token queues (it reads them to spot a straggler)")
        if self.has_backup_workers and not self.token_queues:
            raise ConfigError("backup workers need token queues: without them the iteration gap is unbounded")
        if self.skip_threshold is not None and self.local_steps > 1:
            raise ConfigError(f"--skip-threshold with --local-steps {self.local_steps}: iteration skipping "
                              "jumps iterations, not rounds; use one or the other")

    def check_ranks(self, world_size: int) -> None:
        if isinstance(self.backup_workers, dict):
            bad = sorted(r for r in self.backup_workers if r >= world_size)
            if bad:
                raise ConfigError(f"--backup-workers: rank {bad[0]} out of range (there are {world_size} workers)")

    def stream_bytes(self, bulk: str, update_bytes: int) -> int:
        """The chunk size an update of ``update_bytes`` streams in (0: it goes whole): ``--stream-mib``
        when given; by default the chunk size that suits the plane the chunks take under ``--bulk``,
        for updates of :data:`STREAM_DEFAULT_MIN_MIB` or more."""
        mib = self.stream_mib
        if mib is None:
            if update_bytes < STREAM_DEFAULT_MIN_MIB * (1 << 20):
                return 0
            mib = STREAM_MIB_ZMQ if bulk == "zmq" else STREAM_MIB_TORCH
        return int(mib * (1 << 20))

    @property
    def has_backup_workers(self) -> bool:
        bw = self.backup_workers
        return any(v > 0 for v in bw.values()) if isinstance(bw, dict) else bw > 0

    def backup_workers_for(self, rank: int) -> int:
        bw = self.backup_workers
        return bw.get(rank, 0) if isinstance(bw, dict) else bw

    def settings(self) -> list[str]:
        shown = [f"max_ig={self.max_ig}" if self.token_queues else "no token queues"]
        if self.local_steps > 1:
            shown.append(f"local_steps={self.local_steps}")
        if self.serial:
            shown.append("serial")
        if self.backup_workers:
            shown.append(f"backup_workers={self.backup_workers}")
        if self.staleness is not None:
            shown.append(f"staleness={self.staleness}")
        if self.skip_threshold is not None:
            shown.append(f"skip_threshold={self.skip_threshold} max_jump={self.max_jump}")
        return shown


@dataclass(frozen=True)
class NotifyAckOptions(LocalStepsOptions):
    """Notify-ack is a baseline: its gap of at most 2 leaves no room for backup workers, staleness,
    skipping or token queues (Sec. 3.4-3.5); only the approach and local steps are choices."""

    serial: bool = option(False, help="serial approach: compute, apply, send, then reduce (default: parallel)")

    def as_hop(self) -> HopOptions:
        return HopOptions(serial=self.serial, local_steps=self.local_steps)


def backup_workers_flag(options: HopOptions) -> str:
    """``--backup-workers`` as the user would have written it."""
    bw = options.backup_workers
    if isinstance(bw, dict):
        return "--backup-workers " + ",".join(f"{r}:{n}" for r, n in sorted(bw.items()))
    return f"--backup-workers {bw}"


def restart_refusal(options: HopOptions, protocol: str = "hop") -> str | None:
    if options.local_steps > 1:
        return (f"--protocol {protocol} --local-steps {options.local_steps} cannot replace a dead worker (a "
                "replacement's welcome counts in iterations, not rounds)")
    if options.serial:
        return f"--protocol {protocol} --serial cannot replace a dead worker"
    if protocol == "hop" and not options.token_queues:
        return "--protocol hop cannot replace a dead worker without token queues (its welcome counts on them)"
    return None


__all__ = ["DEFAULT_MAX_IG", "HopOptions", "NotifyAckOptions", "STREAM_DEFAULT_MIN_MIB", "STREAM_MIB_TORCH", "STREAM_MIB_ZMQ", "WELCOME", "backup_workers_flag", "parse_backup_workers", "restart_refusal"]

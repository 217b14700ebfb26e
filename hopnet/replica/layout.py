"""Which process is which in a run of replica groups: the arithmetic, without torch.

Processes are numbered replica by replica: process ``p`` is member ``p % size`` of replica
``p // size``, so a machine's consecutive ranks form its replicas. The graph's nodes are the
replicas. Member ``m`` of every replica forms lane ``m``: a run of the protocol on shard ``m``
of the model, whose ranks are the replica numbers. Lane 0's event logs are the run's
``rank{R}.jsonl`` (what the report reads: one log per replica); lane ``m > 0`` logs to
``lane{m}/rank{R}.jsonl``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hopnet.errors import ConfigError

REPLICA_SIZE = "HOPNET_REPLICA_SIZE"
REPLICA_MODE = "HOPNET_REPLICA_MODE"
MODES = ("ddp", "fsdp")
"""``ddp``: every process of a replica holds the whole model and the gradient is averaged over the
replica in the backward pass; ``fsdp``: parameters, gradients and optimizer state are sharded
over the replica (torch's ``fully_shard``)."""


def lane_log_name(replica: int, member: int) -> str:
    """The event log of ``member`` of ``replica``, relative to the run directory."""
    return f"rank{replica}.jsonl" if member == 0 else f"lane{member}/rank{replica}.jsonl"


@dataclass(frozen=True)
class ReplicaLayout:
    """``size`` processes per replica, ``mode`` inside it, ``processes`` in the run."""

    size: int = 1
    mode: str = "ddp"
    processes: int = 1

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ConfigError(f"--replica-size must be >= 1 (got {self.size})")
        if self.mode not in MODES:
            raise ConfigError(f"--replica-mode {self.mode!r}: expected one of {', '.join(MODES)}")
        if self.processes % self.size:
            raise ConfigError(f"--replica-size {self.size} does not divide the {self.processes} processes "
                              f"(--nproc must be a multiple of it)")

    @property
    def grouped(self) -> bool:
        """Whether replicas have more than one process (else every process is a replica of its own)."""
        return self.size > 1

    @property
    def replicas(self) -> int:
        return self.processes // self.size

    def replica_of(self, process: int) -> int:
        return process // self.size

    def member_of(self, process: int) -> int:
        return process % self.size

    def process(self, replica: int, member: int) -> int:
        return replica * self.size + member

    def members(self, replica: int) -> range:
        """The processes of ``replica``."""
        return range(replica * self.size, (replica + 1) * self.size)

    def log_name(self, process: int) -> str:
        """Its event log, relative to the run directory."""
        return lane_log_name(self.replica_of(process), self.member_of(process))

    def log_path(self, run_dir: Path, process: int) -> Path:
        return run_dir / self.log_name(process)

    def describe(self, replica: int) -> str:
        """``replica 1 (ranks 2, 3)``."""
        ranks = ", ".join(map(str, self.members(replica)))
        return f"replica {replica} ({'rank' if self.size == 1 else 'ranks'} {ranks})"

    def to_environ(self) -> dict[str, str]:
        return {REPLICA_SIZE: str(self.size), REPLICA_MODE: self.mode}

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], processes: int) -> ReplicaLayout:
        """``HOPNET_REPLICA_SIZE``/``HOPNET_REPLICA_MODE`` (under torchrun or srun, ``HOPNET_REPLICA_MODE``
        alone makes each machine one replica: its ``LOCAL_WORLD_SIZE``)."""
        mode = environ.get(REPLICA_MODE, "").strip() or "ddp"
        text = environ.get(REPLICA_SIZE, "").strip()
        if not text and environ.get(REPLICA_MODE, "").strip():
            text = environ.get("LOCAL_WORLD_SIZE", "").strip() or environ.get("SLURM_NTASKS_PER_NODE", "1").strip()
        try:
            size = int(text) if text else 1
        except ValueError:
            raise ConfigError(f"{REPLICA_SIZE}={text!r} is not an integer") from None
        return cls(size=size, mode=mode, processes=processes)


__all__ = ["MODES", "REPLICA_MODE", "REPLICA_SIZE", "ReplicaLayout", "lane_log_name"]

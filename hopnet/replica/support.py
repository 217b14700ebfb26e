"""What runs between replica groups today, and the one-line refusal of what does not (no torch).

A replica decides once what its lanes do. A protocol whose choices depend only on iteration
numbers and the graph (allreduce, Pipe-SGD, Hop, notify-ack, DiLoCo without a quorum) makes the same
choice on every lane, because the lanes of a replica step together. Hop's backup workers and
its skipping, and DiLoCo's quorum, choose by what arrived: there the lanes agree first
(:mod:`hopnet.replica.agreement`). What else chooses by what arrives first (staleness,
AD-PSGD's pairings, eager-SGD's rounds, the coordinators of Prague and Partial Reduce) would let the lanes
of one replica choose differently, so it is refused until its choice is made once per replica.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hopnet.config import ProtocolConfig

RUNS_BETWEEN_REPLICAS = ("allreduce", "hop", "notify-ack", "diloco", "pipe-sgd", "prague", "partial-reduce", "ad-psgd")
"""The protocols whose lanes make the same choices without talking to each other."""

_CHOOSING_OPTIONS: dict[str, tuple[tuple[str, Any, str], ...]] = {}


def replica_refusal(config: ProtocolConfig) -> str | None:
    """Why ``config`` cannot run between replica groups of more than one process, else ``None``."""
    protocol = config.protocol
    if protocol not in RUNS_BETWEEN_REPLICAS:
        return (f"--protocol {protocol} does not run between replica groups yet (its lanes would choose apart); "
                f"{', '.join(RUNS_BETWEEN_REPLICAS)} do")
    for field, default, flag in _CHOOSING_OPTIONS.get(protocol, ()):
        if getattr(config.options, field) != default:
            return (f"{flag} does not run between replica groups yet: each lane of a replica would choose by "
                    "what reaches it first")
    return None


__all__ = ["RUNS_BETWEEN_REPLICAS", "replica_refusal"]

"""What runs between replica groups today, and the one-line refusal of what does not (no torch).

A replica decides once what its lanes do. A protocol whose choices depend only on iteration
numbers and the graph (allreduce, Pipe-SGD, Hop, notify-ack, DiLoCo without a quorum) makes the same
choice on every lane, because the lanes of a replica step together. Where a protocol chooses by
what arrived (Hop's backup workers, skipping and staleness, DiLoCo's quorum, AD-PSGD's pairings
and serves; which gradients an eager-SGD round carries and which round's result a call takes) the
lanes agree first (:mod:`hopnet.replica.agreement`); a coordinator's decisions (Prague, Partial
Reduce) reach every lane through member 0 (:mod:`hopnet.replica.relay`). A protocol registered
later runs between replicas only once it is listed here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hopnet.config import ProtocolConfig

RUNS_BETWEEN_REPLICAS = ("allreduce", "hop", "notify-ack", "diloco", "pipe-sgd", "prague", "partial-reduce", "ad-psgd",
                         "eager-sgd")
"""The protocols whose lanes make one choice per replica."""


def replica_refusal(config: ProtocolConfig) -> str | None:
    """Why ``config`` cannot run between replica groups of more than one process, else ``None``."""
    protocol = config.protocol
    if protocol not in RUNS_BETWEEN_REPLICAS:
        return (f"--protocol {protocol} does not run between replica groups yet (its lanes would choose apart); "
                f"{', '.join(RUNS_BETWEEN_REPLICAS)} do")
    return None


__all__ = ["RUNS_BETWEEN_REPLICAS", "replica_refusal"]

"""What runs between replica groups today, and the one-line refusal of what does not (no torch).

A replica decides once what its lanes do. A protocol whose choices depend only on iteration
numbers and the graph (allreduce, Pipe-SGD, Hop, notify-ack, DiLoCo without a quorum) makes the same
choice on every lane, because the lanes of a replica step together. Where a protocol chooses by
what arrived (Hop's backup workers, skipping and staleness, DiLoCo's quorum, AD-PSGD's pairings
and serves; which gradients an eager-SGD round carries and which round's result a call takes) the
lanes agree first (:mod:`hopnet.replica.agreement`); a coordinator's decisions (Prague, Partial
Reduce) reach every lane through member 0 (:mod:`hopnet.replica.relay`). A protocol says so in its
declaration (``ProtocolSpec.between_replicas``); one that does not is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hopnet.config import ProtocolConfig


def replica_refusal(config: ProtocolConfig) -> str | None:
    """Why ``config`` cannot run between replica groups of more than one process, else ``None``."""
    if config.spec.between_replicas:
        return None
    from hopnet import registry

    running = [name for name in registry.names() if registry.lookup(name).between_replicas]
    return (f"--protocol {config.protocol} does not run between replica groups (its lanes could choose apart: "
            f"its declaration does not say between_replicas=True); {', '.join(running)} do")


def replica_restart_refusal(config: ProtocolConfig) -> str | None:
    """Why ``--max-restarts`` cannot bring back a replica group of ``config``'s protocol, else ``None``."""
    if config.spec.restarts_replicas:
        return None
    from hopnet import registry

    able = [name for name in registry.names() if registry.lookup(name).restarts_replicas]
    return (f"--max-restarts: --protocol {config.protocol} cannot bring back a replica group yet (docs/guides/"
            f"replicas.md says why); {', '.join(able)} can; --max-failures counts replicas with any protocol")


__all__ = ["replica_refusal", "replica_restart_refusal"]

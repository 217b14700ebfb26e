"""Which runs can change membership mid-run: refused in one line at `hopnet launch`, not mid-run."""

from __future__ import annotations

from hopnet.config import ProtocolConfig

REPLICA_PROTOCOLS = ("allreduce", "diloco", "hop", "notify-ack", "pipe-sgd")
"""The protocols whose runs of replica groups can change membership: none with a coordinator (a view's
coordinator would need a relay of its own to every member of a replica), nor eager-SGD (its round
engine runs apart from the step boundaries where a replica changes views)."""


def elastic_refusal(config: ProtocolConfig, replica_size: int = 1) -> str | None:
    """Why ``config`` cannot change membership mid-run, in one line (None: it can); ``replica_size``: the
    processes of each replica group."""
    name = config.protocol
    if replica_size > 1 and name not in REPLICA_PROTOCOLS:
        return (f"--protocol {name} cannot change the membership of replica groups yet; "
                f"{', '.join(REPLICA_PROTOCOLS)} can")
    if name == "ad-psgd":
        return "--protocol ad-psgd's workers drift apart without bound (a passive one runs far ahead), and a " \
               "view begins at one iteration for all; it cannot change membership yet"
    options = config.options
    overlap = getattr(options, "overlap", None)
    if name == "diloco" and (getattr(options, "fragments", 1) != 1 or (callable(overlap) and overlap())
                             or getattr(options, "outer_quorum", None) is not None):
        return "--protocol diloco changes membership at an outer step: not with --fragments, --overlap-steps " \
               "or --outer-quorum"
    if config.bulk == "torch":
        return "an elastic run needs the ZeroMQ plane (--bulk zmq or auto): the torch plane's process groups " \
               "are fixed"
    return None

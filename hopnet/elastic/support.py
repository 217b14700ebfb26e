"""Which runs can change membership mid-run: refused in one line at `hopnet launch`, not mid-run."""

from __future__ import annotations

from hopnet.config import ProtocolConfig


def elastic_refusal(config: ProtocolConfig) -> str | None:
    """Why ``config`` cannot change membership mid-run, in one line (None: it can)."""
    name = config.protocol
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

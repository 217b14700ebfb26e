"""The environment variables that tell a worker where its run's coordinator is. A module of its own
so that the launcher, which sets them, does not import the client (and torch) to name them."""

from __future__ import annotations

COORDINATOR_ENV = "HOPNET_COORDINATOR"
"""``tcp://HOST:PORT`` of the run's coordinator, set by `hopnet launch` when the protocol needs one."""
COORDINATOR_NAME_ENV = "HOPNET_COORDINATOR_NAME"
"""What the coordinator is (``prague random group generator``), for error messages."""

"""Launching workers: the `hopnet launch` launcher, the worker environment, the rendezvous.

Worker code needs only :class:`WorkerEnv` and the rendezvous functions; the launcher
itself (which imports the graph module) is loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hopnet.launch.env import ENV_VARS, WorkerEnv
from hopnet.launch.rendezvous import (
    RendezvousError,
    RendezvousServer,
    barrier,
    barrier_async,
    exchange_addresses,
    exchange_addresses_async,
    rendezvous_status,
)

if TYPE_CHECKING:
    from hopnet.launch.launcher import LaunchResult, launch

__all__ = [
    "ENV_VARS",
    "LaunchResult",
    "RendezvousError",
    "RendezvousServer",
    "WorkerEnv",
    "barrier",
    "barrier_async",
    "exchange_addresses",
    "exchange_addresses_async",
    "launch",
    "rendezvous_status",
]


def __getattr__(name: str) -> Any:
    if name in ("launch", "LaunchResult"):
        from hopnet.launch import launcher

        return getattr(launcher, name)
    raise AttributeError(f"module 'hopnet.launch' has no attribute {name!r}")

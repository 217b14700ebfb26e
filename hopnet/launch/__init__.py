"""Launching workers: the `hopnet launch` launcher, the worker environment, the rendezvous.

Worker code needs only :class:`WorkerEnv` and the rendezvous functions; every name here is
loaded on first use, so `hopnet launch`'s argument checks (:mod:`hopnet.launch.spec`) import
neither the rendezvous (ZeroMQ) nor the launcher (torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hopnet.launch.env import ENV_VARS, WorkerEnv
    from hopnet.launch.launcher import LaunchResult, launch
    from hopnet.launch.rendezvous import (
        RendezvousError,
        RendezvousServer,
        barrier,
        barrier_async,
        exchange_addresses,
        exchange_addresses_async,
        rendezvous_status,
    )

_HOMES = {
    "ENV_VARS": "env", "WorkerEnv": "env",
    "launch": "launcher", "LaunchResult": "launcher",
    "RendezvousError": "rendezvous", "RendezvousServer": "rendezvous", "barrier": "rendezvous",
    "barrier_async": "rendezvous", "exchange_addresses": "rendezvous", "exchange_addresses_async": "rendezvous",
    "rendezvous_status": "rendezvous",
}

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
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'hopnet.launch' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hopnet.launch.{home}"), name)

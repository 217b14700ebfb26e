"""The launcher: `hopnet launch`, the process that starts a run's workers and watches them.

The code is split by the process it runs in:

* :mod:`hopnet.launch` (here): the launcher process: its settings (:mod:`~hopnet.launch.settings`),
  checks and plan (:mod:`~hopnet.launch.spec`), the run directory's claim, the workers'
  processes and the handle on their fork server, restarts, the death watch, the blame;
* :mod:`hopnet.bootstrap`: what each worker (and the fork server, and the coordinator
  process) runs to start: the ``HOPNET_*`` environment, :func:`hopnet.init`'s phases,
  joining torchrun or srun, the plane, the entry point scripts run through;
* :mod:`hopnet.rendezvous`: the meeting point, its server (which the launcher runs) apart
  from its client (which every worker calls), and the run's c10d store.

The names below stay importable from here for code that held them (``from hopnet.launch
import WorkerEnv, exchange_addresses``). Each is loaded on first use, so `hopnet launch`'s
argument checks import neither the rendezvous (ZeroMQ) nor the launcher (torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hopnet.bootstrap.env import ENV_VARS, WorkerEnv
    from hopnet.launch.launcher import LaunchResult, launch
    from hopnet.rendezvous.client import (
        barrier,
        barrier_async,
        exchange_addresses,
        exchange_addresses_async,
        rendezvous_status,
    )
    from hopnet.rendezvous.server import RendezvousServer
    from hopnet.rendezvous.wire import RendezvousError

_HOMES = {
    "ENV_VARS": "hopnet.bootstrap.env", "WorkerEnv": "hopnet.bootstrap.env",
    "launch": "hopnet.launch.launcher", "LaunchResult": "hopnet.launch.launcher",
    "RendezvousError": "hopnet.rendezvous.wire", "RendezvousServer": "hopnet.rendezvous.server",
    "barrier": "hopnet.rendezvous.client", "barrier_async": "hopnet.rendezvous.client",
    "exchange_addresses": "hopnet.rendezvous.client", "exchange_addresses_async": "hopnet.rendezvous.client",
    "rendezvous_status": "hopnet.rendezvous.client",
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
    return getattr(importlib.import_module(home), name)

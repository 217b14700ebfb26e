"""One GPU per rank on the torch plane.

NCCL refuses to build a communicator whose two ranks sit on one device, and it says so only
when a pair's first send or receive fails: the torch plane then takes the peer for dead, and
the run ends naming a "silent" peer instead of the cause. So each rank of a CUDA run puts its
device's identity (host and GPU UUID) in the run's c10d store before it starts, and a rank
that finds a neighbour's identity equal to its own refuses to start, naming both ranks and
the device. Only the graph's neighbours are compared: the pairs hopnet opens at once are
theirs (others form on demand, and would still fail as NCCL does).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch

from hopnet.errors import ConfigError

KEY = "hopnet/gpu/{rank}"


def device_identity(device: torch.device) -> tuple[str, str]:
    """(identity, words): what tells this GPU from every other one of the run, and how to name it."""
    host = socket.gethostname()
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    identity = f"{host}/{uuid}" if uuid is not None else f"{host}/cuda:{device.index}"
    return identity, f"{props.name} ({device}) of {host}"


def refuse_shared_gpus(store: Any, rank: int, peers: Iterable[int], identity: str, words: str,
                       wait_s: float) -> None:
    """Publish ``identity`` for ``rank`` and raise :class:`ConfigError` if a peer of ``peers``
    published the same one. A peer that does not publish within ``wait_s`` is not compared (it
    never started: the rendezvous names it)."""
    store.set(KEY.format(rank=rank), identity)
    for peer in sorted(peers):
        key = KEY.format(rank=peer)
        try:
            store.wait([key], timedelta(seconds=wait_s))
        except Exception:  # torch raises DistStoreError (or RuntimeError) on a timeout
            continue
        if store.get(key).decode() == identity:
            low, high = sorted((rank, peer))
            raise ConfigError(
                f"ranks {low} and {high} are both on {words}: NCCL needs a GPU of its own for each rank. "
                "Put each worker of a machine on its own device (torch.cuda.set_device(local_rank), "
                "with HOPNET_LOCAL_RANK) and start at most torch.cuda.device_count() workers per machine, "
                "or keep the model on the CPU")


__all__ = ["KEY", "device_identity", "refuse_shared_gpus"]

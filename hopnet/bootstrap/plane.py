"""Which plane carries a worker's update tensors: ``--bulk zmq|torch|auto``.

- ``zmq``: everything over :class:`~hopnet.transports.zmq.ZmqTransport` (CPU tensors only).
- ``torch``: headers and control over ZeroMQ, tensors over torch.distributed
  (:class:`~hopnet.transports.torchdist.TorchBulkTransport`: gloo on CPU, NCCL on CUDA).
- ``auto``: torch for CUDA tensors; for CPU tensors, per message, whichever
  ``bench/bulk.py`` measured faster for its size: messages of at least
  :data:`AUTO_CPU_MIN_BYTES` go over gloo, smaller ones over ZeroMQ.

It lives with the launch code, above the transports and the collectives, because it
wires both to the run's c10d store that `hopnet launch` hosts (``HOPNET_STORE``).
"""

from __future__ import annotations

import torch

from hopnet.errors import ConfigError
from hopnet.runtime.services import AllReduce, CollectiveFactory, NodeServices
from hopnet.security import CurveKeys
from hopnet.transports.base import Transport
from hopnet.transports.zmq import ZmqTransport

AUTO_CPU_MIN_BYTES: int | None = 16 << 20
"""Smallest CPU message ``auto`` sends over gloo (``None`` would mean ZeroMQ for every size).
From bench/bulk.py and bench/transport.py (docs/performance/index.md, "The bulk plane"): ZeroMQ was
faster up to 1 MiB in every run, gloo at 16 MiB in most, 4 MiB was a toss-up."""


def cpu_min_bytes(bulk: str) -> int | None:
    """For CPU tensors: the smallest message that goes over torch, or None for none."""
    if bulk == "torch":
        return 0
    if bulk == "auto":
        return AUTO_CPU_MIN_BYTES
    return None


def make_transport(*, rank: int, peers: frozenset[int], bind_host: str, bulk: str, device: torch.device,
                   store_endpoint: str, timeout_s: float, message_bytes: int | None = None,
                   curve: CurveKeys | None = None, handover: bool = False) -> Transport:
    """The transport for a worker whose parameters live on ``device``.

    ``message_bytes``: the size of the worker's updates when known (the flat parameters);
    ``auto`` then skips the torch plane altogether for CPU updates below its threshold,
    and also when no store is at hand (a launcher other than `hopnet launch`).
    ``curve``: the run key; the ZeroMQ sockets then use CurveZMQ (see :mod:`hopnet.security`).
    ``handover``: peers may be replaced by new processes (see :class:`ZmqTransport`)."""
    control = ZmqTransport(rank, peers, bind=f"tcp://{bind_host}:*", curve=curve, handover=handover)
    if device.type == "cpu":
        min_bytes = cpu_min_bytes(bulk)
        if min_bytes is None:
            return control
        if bulk == "auto" and (not store_endpoint or (message_bytes is not None and message_bytes < min_bytes)):
            return control
    elif bulk == "zmq":
        raise ConfigError(f"--bulk zmq moves CPU tensors only; the model is on {device} "
                          "(use --bulk torch or auto)")
    else:
        min_bytes = 0
    if not store_endpoint:
        raise ConfigError(f"--bulk {bulk} with {device.type} tensors needs the run's c10d store "
                          "(HOPNET_STORE, set by `hopnet launch`)")
    from hopnet.rendezvous.store import connect_store
    from hopnet.transports.torchdist import TorchBulkTransport

    store = connect_store(store_endpoint, timeout_s)
    if device.type == "cuda":
        from hopnet.transports.gpu_placement import device_identity, refuse_shared_gpus

        refuse_shared_gpus(store, rank, peers, *device_identity(device), wait_s=timeout_s)
    return TorchBulkTransport(control, store, min_bytes=min_bytes, timeout_s=timeout_s, host=bind_host,
                              device=device)


def collective_factory(*, rank: int, world_size: int, bulk: str, device: torch.device, store_endpoint: str,
                       timeout_s: float, bind_host: str, tensor_bytes: int | None) -> CollectiveFactory | None:
    """How a worker's all-reduces travel, by the same rule as its updates: ``None`` for the
    ring over hopnet's own messages (the protocol's default), else a factory of
    :class:`~hopnet.collectives.torchdist.TorchCollective` (CUDA tensors, ``--bulk torch``,
    or ``auto`` with a store and tensors of at least :data:`AUTO_CPU_MIN_BYTES`)."""
    if device.type == "cpu":
        min_bytes = cpu_min_bytes(bulk)
        if min_bytes is None or not store_endpoint:
            return None
        if bulk == "auto" and (tensor_bytes is None or tensor_bytes < min_bytes):
            return None
    elif not store_endpoint:
        raise ConfigError(f"all-reduces of {device.type} tensors need the run's c10d store "
                          "(HOPNET_STORE, set by `hopnet launch`)")

    def build(node: NodeServices) -> AllReduce:
        from hopnet.collectives.torchdist import TorchCollective
        from hopnet.rendezvous.store import connect_store

        return TorchCollective(rank, world_size, connect_store(store_endpoint, timeout_s),
                               timeout_s=timeout_s, host=bind_host, node=node)

    return build


__all__ = ["AUTO_CPU_MIN_BYTES", "collective_factory", "cpu_min_bytes", "make_transport"]

"""A message as ZeroMQ frames: tensors as byte views cut into chunks of ``limits.CHUNK_BYTES``,
sent without pyzmq's per-call checks, and received frames checked against the header's specs
and copied into tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeGuard

import numpy as np
import torch
import zmq

from hopnet.transports.zmq import limits
from hopnet.wire import TensorSpec

_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)


def byte_view(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor's memory (works for bfloat16)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def frame_count(nbytes: int) -> int:
    return max(1, -(-nbytes // limits.CHUNK_BYTES))


def send_now(sock: zmq.Socket, parts: list[Any]) -> None:
    """``send_multipart(parts, NOBLOCK, copy=False)`` minus pyzmq's per-call checks.

    Raises ``zmq.Again`` only on the first part: libzmq counts the high-water mark in
    whole messages, so once a message's first part is accepted the rest are too.
    """
    send = sock.send
    last = len(parts) - 1
    for i, part in enumerate(parts):
        send(part, _NOBLOCK_MORE if i < last else _NOBLOCK, copy=False)


def first_frames(sizes: list[int]) -> list[int]:
    out, i = [], 2
    for nbytes in sizes:
        out.append(i)
        i += frame_count(nbytes)
    return out


def buffers_match(target: object, specs: tuple[TensorSpec, ...]) -> TypeGuard[Sequence[torch.Tensor]]:
    if not isinstance(target, (list, tuple)) or len(target) != len(specs):
        return False
    for t, spec in zip(target, specs):
        if (not isinstance(t, torch.Tensor) or t.dtype != spec.dtype or tuple(t.shape) != spec.shape
                or t.device.type != "cpu" or not t.is_contiguous()):
            return False
    return True


def new_tensor(dtype: torch.dtype, shape: tuple[int, ...], frames: list[zmq.Frame], first: int) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return t
    dst = byte_view(t)
    off = 0
    i = first
    while off < nbytes:
        frame = frames[i]
        n = len(frame)
        dst[off:off + n] = np.frombuffer(frame.buffer, dtype=np.uint8)
        off += n
        i += 1
    return t

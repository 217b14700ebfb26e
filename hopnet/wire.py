"""The message envelope shared by every transport.

A message is a small msgpack header plus zero or more raw tensor frames. The header
names the message ``kind``, the sender ``src``, the receiver ``dst``, the sender's
iteration ``iter``, an optional ``tag``, small protocol ``meta`` data, and for every
tensor its dtype and shape, so the receiver can validate the frames and place the
bytes into a buffer it already owns.

Header keys on the wire are single letters to keep control messages small:
``k`` kind, ``s`` src, ``d`` dst, ``i`` iter, ``t`` tag, ``m`` meta, ``x`` tensors
(a list of ``[dtype_name, [dims...]]``), and, on a numbered link (the ZeroMQ transport:
:mod:`hopnet.transports.link_numbers`), ``e`` the sender's connection epoch and ``n`` the
message's number in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from hopnet.errors import HopnetError
from hopnet.kinds import (BYE_FINAL_ITER, any_rank_kinds, is_any_rank_kind, is_known_kind, known_kinds,
                          register_kind)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

MAX_TENSORS_PER_MESSAGE = 64
MAX_DIMS = 8
MAX_TENSOR_BYTES = 1 << 46
"""No tensor on the wire is larger (64 TiB): a bound that keeps sizes computed from a
header far inside what torch and numpy can represent."""
MAX_RANK = (1 << 31) - 1
_INT64 = 1 << 63


class DecodeError(HopnetError):
    """An inbound message failed validation. ``reason`` is a short stable key for counters."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size() if dtype not in _ITEMSIZE else _ITEMSIZE[dtype]


_ITEMSIZE: dict[torch.dtype, int] = {dt: torch.empty((), dtype=dt).element_size() for dt in DTYPES.values()}


@dataclass(slots=True)
class Header:
    kind: str
    src: int
    dst: int
    iter: int
    tag: Any = None
    meta: dict[str, Any] | None = None
    specs: tuple[TensorSpec, ...] = ()
    epoch: int = 0
    """The sender's connection epoch on a numbered link (0: the message is not numbered)."""
    seq: int = 0
    """The message's number within ``epoch``, from 1 (0: not numbered)."""


@dataclass(slots=True)
class Message:
    """One protocol message. ``tensors`` are contiguous CPU (or, later, CUDA) tensors."""

    kind: str
    src: int
    dst: int
    iter: int
    tag: Any = None
    meta: dict[str, Any] | None = None
    tensors: list[torch.Tensor] = field(default_factory=list)

    def header(self) -> Header:
        return Header(self.kind, self.src, self.dst, self.iter, self.tag, self.meta,
                      tuple(TensorSpec(t.dtype, tuple(t.shape)) for t in self.tensors))


def encode_header(msg: Message, epoch: int = 0, seq: int = 0) -> bytes:
    """Serialise a message's header (everything but the tensor bytes); with ``seq`` (from 1),
    numbered ``seq`` in the sender's connection ``epoch``."""
    tensors = []
    for t in msg.tensors:
        try:
            name = DTYPE_NAMES[t.dtype]
        except KeyError:
            raise HopnetError(f"cannot send tensors of dtype {t.dtype}") from None
        if not t.is_contiguous():
            raise HopnetError("tensors sent by hopnet must be contiguous")
        tensors.append([name, list(t.shape)])
    head: dict[str, Any] = {"k": msg.kind, "s": msg.src, "d": msg.dst, "i": msg.iter}
    if msg.tag is not None:
        head["t"] = msg.tag
    if msg.meta:
        head["m"] = msg.meta
    if tensors:
        head["x"] = tensors
    if seq:
        head["e"] = epoch
        head["n"] = seq
    return msgpack.packb(head, use_bin_type=True)


def decode_header(data: bytes | memoryview) -> Header:
    """Parse and validate a header. Raises :class:`DecodeError` on anything malformed."""
    try:
        head = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise DecodeError("bad_header", f"not msgpack ({type(exc).__name__})") from None
    if not isinstance(head, dict):
        raise DecodeError("bad_header", "header is not a map")
    kind = head.get("k")
    if not isinstance(kind, str):
        raise DecodeError("bad_header", "missing kind")
    if not is_known_kind(kind):
        raise DecodeError("unknown_kind", repr(kind)[:40])
    src, dst, it = head.get("s"), head.get("d"), head.get("i")
    if not (isinstance(src, int) and isinstance(dst, int) and isinstance(it, int)):
        raise DecodeError("bad_header", "src/dst/iter must be integers")
    if not (0 <= src <= MAX_RANK and 0 <= dst <= MAX_RANK and -_INT64 <= it < _INT64):
        raise DecodeError("bad_header", "src/dst/iter out of range")
    tag = head.get("t")
    if tag is not None and not isinstance(tag, (str, int)):
        raise DecodeError("bad_header", "tag must be a string or an integer")  # it keys dicts downstream
    meta = head.get("m")
    if meta is not None and not isinstance(meta, dict):
        raise DecodeError("bad_header", "meta must be a map")
    seq = head.get("n")
    if seq is None:
        return Header(kind, src, dst, it, tag, meta, decode_specs(head.get("x", [])))
    epoch = head.get("e")
    if not (type(seq) is int and type(epoch) is int and seq > 0 and epoch >= 0):  # msgpack: < 2**64
        raise DecodeError("bad_header", "epoch/number must be integers in range")
    return Header(kind, src, dst, it, tag, meta, decode_specs(head.get("x", [])), epoch, seq)


def decode_specs(raw_specs: Any) -> tuple[TensorSpec, ...]:
    """Tensor specs from the wire: a list of ``[dtype_name, [dims...]]``, each tensor at most
    :data:`MAX_TENSOR_BYTES`. Raises :class:`DecodeError`."""
    if not isinstance(raw_specs, list) or len(raw_specs) > MAX_TENSORS_PER_MESSAGE:
        raise DecodeError("bad_header", "bad tensor list")
    specs = []
    for entry in raw_specs:
        if not (isinstance(entry, list) and len(entry) == 2):
            raise DecodeError("bad_header", "bad tensor spec")
        name, shape = entry
        dtype = DTYPES.get(name) if isinstance(name, str) else None
        if dtype is None:
            raise DecodeError("bad_dtype", repr(name)[:40])
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_TENSOR_BYTES
                           for d in shape)):
            raise DecodeError("bad_shape", repr(shape)[:60])
        extent = _ITEMSIZE[dtype]
        for d in shape:
            extent *= max(d, 1)  # zero dims too: torch sizes the others before it multiplies by 0
        if extent > MAX_TENSOR_BYTES:
            raise DecodeError("bad_shape", f"{repr(shape)[:60]} exceeds {MAX_TENSOR_BYTES} bytes")
        specs.append(TensorSpec(dtype, tuple(shape)))
    return tuple(specs)


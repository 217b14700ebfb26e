"""Light gradient compression for the ring's hops (Pipe-SGD, Sec. 3.2): pure, element-wise codecs.

Both run inside the all-reduce on every hop (decode, add, encode), so they must cost less
than the bytes they save; both are deterministic functions of the chunk, which is what
keeps every member of a group bit-identical (see :mod:`hopnet.collectives.codec`).

* ``trunc16`` keeps the top 16 bits of each float32's bit pattern (sign, exponent and 7
  mantissa bits: bfloat16 with rounding toward zero). Half the bytes; each element keeps
  its sign, never grows in magnitude and loses less than 2^-7 of it.
* ``int8`` is symmetric scalar quantization: ``scale = max|block| / 127`` (sent along with
  the block, in the block's dtype), ``q = round(x / scale)`` in [-127, 127]. A quarter of
  the bytes plus one scale per chunk; each element is off by at most ``scale / 2``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hopnet.collectives.codec import Codec, IdentityCodec
from hopnet.errors import ConfigError
from hopnet.wire import TensorSpec

COMPRESSIONS = ("none", "trunc16", "int8")
"""What ``make_codec`` knows: no compression, the top 16 bits of each float32, int8 blocks."""


def truncate16(values: torch.Tensor) -> torch.Tensor:
    """The top 16 bits of each float32 of ``values`` (1-D), as int16."""
    if values.dtype != torch.float32:
        raise ConfigError(f"trunc16 compresses float32 values, not {values.dtype}")
    return torch.bitwise_right_shift(values.view(torch.int32), 16).to(torch.int16)


def expand16(bits: torch.Tensor) -> torch.Tensor:
    """The float32 values whose top 16 bits are ``bits`` (int16) and whose low 16 bits are zero."""
    return torch.bitwise_left_shift(bits.to(torch.int32), 16).view(torch.float32)


def quantize8(values: torch.Tensor, work: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: int8 levels in [-127, 127] and the one-element scale ``max|values| / 127``.

    A block of zeros gets scale 0 and zero levels. ``work`` (like ``values``) holds the
    scaled values on the way, saving an allocation per hop."""
    if values.numel() == 0:
        return torch.zeros(0, dtype=torch.int8), torch.zeros(1, dtype=values.dtype)
    low, high = torch.aminmax(values)
    scale = torch.maximum(-low, high) / 127  # 0-dim: broadcasting a 0-dim tensor is the fast path
    if not torch.isfinite(scale):
        raise ValueError("int8 compression met a non-finite gradient value")
    if scale.item() == 0.0:
        return torch.zeros(values.numel(), dtype=torch.int8), scale.reshape(1)
    scaled = torch.div(values, scale, out=work) if work is not None else values / scale
    levels = scaled.round_().clamp_(-127, 127).to(torch.int8)
    return levels, scale.reshape(1)


def dequantize8(levels: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return levels.to(dtype).mul_(scale.reshape(()))


class Trunc16Codec(Codec):
    """bf16-style truncation of float32 chunks: 2 bytes per element on the wire."""

    name = "trunc16"

    def payload_specs(self, numel: int, dtype: torch.dtype) -> tuple[TensorSpec, ...]:
        if dtype != torch.float32:
            raise ConfigError(f"--compress trunc16 needs float32 gradients, not {dtype}")
        return (TensorSpec(torch.int16, (numel,)),)

    def encode(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        return [truncate16(chunk)]

    def decode(self, payload: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        out.copy_(expand16(payload[0]))

    def decode_add(self, payload: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        out.add_(expand16(payload[0]))


class Int8Codec(Codec):
    """Symmetric int8 quantization per chunk: 1 byte per element plus one scale per chunk."""

    name = "int8"

    def payload_specs(self, numel: int, dtype: torch.dtype) -> tuple[TensorSpec, ...]:
        if not dtype.is_floating_point:
            raise ConfigError(f"--compress int8 needs floating-point gradients, not {dtype}")
        return (TensorSpec(torch.int8, (numel,)), TensorSpec(dtype, (1,)))

    def encode(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        levels, scale = quantize8(chunk, self._scratch(chunk))
        return [levels, scale.to(chunk.dtype)]

    def decode(self, payload: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        out.copy_(dequantize8(payload[0], payload[1], out.dtype))

    def decode_add(self, payload: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        out.add_(dequantize8(payload[0], payload[1], out.dtype))


def make_codec(compression: str) -> Codec:
    """The codec a ``--compress`` value names (``none`` is the identity)."""
    if compression == "none":
        return IdentityCodec()
    if compression == "trunc16":
        return Trunc16Codec()
    if compression == "int8":
        return Int8Codec()
    raise ConfigError(f"unknown compression {compression!r} (choose from {', '.join(COMPRESSIONS)})")

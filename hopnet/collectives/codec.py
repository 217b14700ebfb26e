"""Per-hop codecs: how a chunk of a collective looks on the wire.

The ring all-reduce encodes every chunk before it sends it and decodes it on receipt,
on every hop. A codec may change the payload's dtype and size (bf16 truncation sends
half the bytes; int8 quantization sends a quarter plus a scale per block), so the
receiver learns the payload's layout from :meth:`Codec.payload_specs`, computed from the
chunk's length and dtype alone: both ends agree without asking each other.

Codecs are pure functions of their input. That is what keeps the members of a group
bit-identical under lossy compression: the owner of a segment encodes its final value
once, replaces its own copy with the decoded payload, and every other member decodes
the very same bytes (forwarded unchanged around the ring) with the same function.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from hopnet.wire import TensorSpec


class Codec(abc.ABC):
    """Encode a chunk for one hop and decode it on the other side."""

    name: str = "codec"
    lossless: bool = False
    """True when ``decode(encode(x)) == x`` bit for bit (the owner may then skip the round trip)."""
    in_place: bool = False
    """True when the payload is one tensor holding the chunk's own values (decode is a copy):
    the all-gather then receives it straight into the result, with no copy."""

    @abc.abstractmethod
    def payload_specs(self, numel: int, dtype: torch.dtype) -> tuple[TensorSpec, ...]:
        """The tensors :meth:`encode` produces for a 1-D chunk of ``numel`` elements of ``dtype``."""

    @abc.abstractmethod
    def encode(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        """The payload for ``chunk`` (1-D, contiguous). It may alias ``chunk``: the ring does not
        modify the chunk until the send is done."""

    @abc.abstractmethod
    def decode(self, payload: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        """Write the decoded values into ``out``."""

    def decode_add(self, payload: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        """``out += decoded``; override to fuse the two (the default decodes into scratch)."""
        scratch = self._scratch(out)
        self.decode(payload, scratch)
        out.add_(scratch)

    def _scratch(self, like: torch.Tensor) -> torch.Tensor:
        cache: dict[tuple[torch.dtype, int], torch.Tensor] = self.__dict__.setdefault("_scratch_cache", {})
        key = (like.dtype, like.numel())
        buf = cache.get(key)
        if buf is None:
            buf = cache[key] = torch.empty_like(like)
        return buf


class IdentityCodec(Codec):
    """The chunk itself, sent without a copy."""

    name = "identity"
    lossless = True
    in_place = True

    def payload_specs(self, numel: int, dtype: torch.dtype) -> tuple[TensorSpec, ...]:
        return (TensorSpec(dtype, (numel,)),)

    def encode(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        return [chunk]

    def decode(self, payload: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        out.copy_(payload[0])

    def decode_add(self, payload: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        out.add_(payload[0])

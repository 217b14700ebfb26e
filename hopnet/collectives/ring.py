"""Ring all-reduce over the Node's own messages: reduce-scatter, then all-gather.

The tensor (viewed flat, ``n`` elements) is cut into ``p`` segments, one per member, and
each segment into chunks of at most ``chunk_bytes`` so that hops pipeline: a chunk is
forwarded as soon as it has been reduced, while the rest of its segment is still on the
wire. With the members ordered as the group lists them, member ``i`` sends to member
``i + 1`` and receives from ``i - 1`` (mod ``p``):

* reduce-scatter, steps ``s = 0 .. p-2``: send segment ``i - s``, receive segment
  ``i - s - 1`` and add it to the local copy. Afterwards member ``i`` holds the complete
  sum of segment ``i + 1``: it owns that segment;
* the owner divides by ``p`` (mean) and encodes its segment once; its own copy becomes the
  decoded payload;
* all-gather, steps ``s = 0 .. p-2``: send segment ``i + 1 - s``, receive segment ``i - s``,
  decode it into place and forward the received payload unchanged. With the identity
  codec the receives are posted in the node's mailbox before the messages arrive, so the
  bytes land in the result directly.

Every member ends with the owner's values for every segment, decoded from the same
bytes: the results are bitwise identical whatever the codec. Each member sends
``2 (p-1) / p * n`` elements (as encoded) in ``2 (p-1)`` steps, which is the ring model's
``2 (p-1) latency + 2 (p-1) / p * n / bandwidth``.

Messages are of kind ``coll``, tagged with the round's tag, and numbered within the
round (``seq`` in the envelope's ``iter``), so concurrent groups and back-to-back rounds
never mix; they wait in the node's mailbox until the step that needs them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
import torch

from hopnet.collectives.base import REDUCE_OPS, Collective, ReduceOp, check_group
from hopnet.collectives.codec import Codec, IdentityCodec
from hopnet.errors import ConfigError, ProtocolError
from hopnet.runtime.mailbox import COLLECTIVE_KIND
from hopnet.runtime.services import NodeServices
from hopnet.wire import Message, TensorSpec

DEFAULT_CHUNK_BYTES = 16 << 20
"""Largest chunk on one hop (before encoding). Smaller chunks pipeline the hops more finely
but cost a message each: over ZeroMQ on the reference VM (docs/performance/index.md, "All-reduce against torch.distributed"),
16 MiB chunks all-reduced 64 MiB tensors faster than 1 MiB ones in every run (1.4x at
P = 4, 3.7x or more at P = 2; noisy, a loaded machine). (The ZeroMQ
transport still splits a message into 1 MiB frames.)"""


@dataclass(frozen=True)
class RingPlan:
    """Where the segments and chunks of an ``n``-element tensor lie, for ``p`` members.

    Every member computes the same plan from ``n``, ``p`` and the chunk size, so chunk ``c``
    of the message numbered ``seq(step, c)`` means the same slice everywhere."""

    n: int
    p: int
    chunk_elems: int

    def segment(self, k: int) -> tuple[int, int]:
        k %= self.p
        return k * self.n // self.p, (k + 1) * self.n // self.p

    def chunks(self, k: int) -> list[tuple[int, int]]:
        lo, hi = self.segment(k)
        return [(a, min(a + self.chunk_elems, hi)) for a in range(lo, hi, self.chunk_elems)]

    @property
    def max_chunks(self) -> int:
        longest = -(-self.n // self.p)
        return max(1, -(-longest // self.chunk_elems))

    def seq(self, step: int, chunk: int) -> int:
        return step * self.max_chunks + chunk


class RingCollective(Collective):
    """:class:`~hopnet.collectives.base.Collective` over the node's messages (any transport,
    the simulator included). ``codec`` transforms every chunk on every hop."""

    def __init__(self, node: NodeServices, *, codec: Codec | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes must be >= 1 (got {chunk_bytes})")
        self.node = node
        self.rank = node.rank
        self.world_size = node.graph.n
        self.codec = codec if codec is not None else IdentityCodec()
        self.chunk_bytes = chunk_bytes
        self._active: set[object] = set()
        self.rounds = 0

    def with_codec(self, codec: Codec) -> RingCollective:
        """The same ring over the same node, compressing every hop with ``codec``."""
        sibling = RingCollective(self.node, codec=codec, chunk_bytes=self.chunk_bytes)
        sibling._active = self._active  # one set of open tags per node
        return sibling

    async def allreduce(self, group: Sequence[int], tensor: torch.Tensor, op: ReduceOp = "mean", *,
                        tag: str) -> torch.Tensor:
        members = check_group(group, self.rank, self.world_size)
        if op not in REDUCE_OPS:
            raise ConfigError(f"unknown reduce op {op!r} (choose from {', '.join(REDUCE_OPS)})")
        if not tensor.is_contiguous():
            raise ConfigError("all-reduce needs a contiguous tensor")
        if op == "mean" and not tensor.is_floating_point():
            raise ConfigError(f"a mean all-reduce needs a floating-point tensor, got {tensor.dtype}")
        if tag in self._active:
            raise ProtocolError(f"rank {self.rank}: all-reduce tag {tag!r} is already in use by a round "
                                "that has not finished; every round needs a tag of its own")
        if len(members) == 1:
            return tensor
        self._active.add(tag)
        self.node.mailbox.open_round(COLLECTIVE_KIND, tag, members)
        try:
            await _RingRound(self, members, tensor.view(-1), op, tag).run()
        except BaseException:
            self.node.mailbox.discard_tag(COLLECTIVE_KIND, tag)
            raise
        finally:
            self.node.mailbox.close_round(COLLECTIVE_KIND, tag)
            self._active.discard(tag)
        self.rounds += 1
        return tensor


class _RingRound:
    """One member's part in one all-reduce round."""

    def __init__(self, ring: RingCollective, members: tuple[int, ...], flat: torch.Tensor,
                 op: ReduceOp, tag: str) -> None:
        self.ring = ring
        self.node = ring.node
        self.codec = ring.codec
        self.members = members
        self.flat = flat
        self.op = op
        self.tag = tag
        p = len(members)
        self.p = p
        self.pos = members.index(ring.rank)
        self.left = members[(self.pos - 1) % p]
        self.right = members[(self.pos + 1) % p]
        chunk_elems = max(1, ring.chunk_bytes // flat.element_size())
        self.plan = RingPlan(flat.numel(), p, chunk_elems)
        self._reduce_sends: dict[tuple[int, int], asyncio.Task[None]] = {}
        self._sends: list[asyncio.Task[None]] = []

    async def run(self) -> None:
        await self.node.connect_to([self.right])
        try:
            self._reduce_scatter_first()
            await self._reduce_scatter()
            self._own_segment()
            await self._all_gather()
        finally:
            # The caller may modify the tensor once we return: every send must be done.
            pending = [t for t in self._sends if not t.done()]
            if pending:
                await asyncio.wait(pending)
        for task in self._sends:
            if not task.cancelled() and task.exception() is not None:
                raise ProtocolError(f"rank {self.ring.rank}: all-reduce {self.tag!r} of group "
                                    f"{list(self.members)}: a send failed: {task.exception()}")

    # ------------------------------------------------------------------ phases
    def _reduce_scatter_first(self) -> None:
        for c, (lo, hi) in enumerate(self.plan.chunks(self.pos)):
            self._send(self.plan.seq(0, c), self.codec.encode(self.flat[lo:hi]), key=(self.pos, c))

    async def _reduce_scatter(self) -> None:
        p, plan, flat = self.p, self.plan, self.flat
        for s in range(p - 1):
            segment = (self.pos - s - 1) % p
            for c, (lo, hi) in enumerate(plan.chunks(segment)):
                msg = await self._receive(s, c, hi - lo)
                payload = msg.tensors
                if payload and payload[0].device != flat.device:  # landed in the mailbox's host buffers
                    payload = [t.to(flat.device) for t in payload]
                self.codec.decode_add(payload, flat[lo:hi])
                self.node.mailbox.release(msg)
                if s < p - 2:  # forward the chunk just reduced, as the next step's send
                    self._send(plan.seq(s + 1, c), self.codec.encode(flat[lo:hi]), key=(segment, c))

    def _own_segment(self) -> None:
        """Finish the owned segment (divide for a mean), encode it once, start the all-gather."""
        owned = (self.pos + 1) % self.p
        step = self.p - 1
        for c, (lo, hi) in enumerate(self.plan.chunks(owned)):
            chunk = self.flat[lo:hi]
            if self.op == "mean":
                chunk.div_(self.p)
            payload = self.codec.encode(chunk)
            if not self.codec.lossless:
                self.codec.decode(payload, chunk)  # keep exactly what the others will decode
            self._send(self.plan.seq(step, c), payload)

    async def _all_gather(self) -> None:
        p, plan, flat = self.p, self.plan, self.flat
        posted = self._post_in_place() if self.codec.in_place else {}
        for s in range(p - 1):
            step = p - 1 + s
            segment = (self.pos - s) % p
            for c, (lo, hi) in enumerate(plan.chunks(segment)):
                dest = flat[lo:hi]
                target = posted.get((step, c))
                if target is None:
                    earlier = self._reduce_sends.pop((segment, c), None)
                    if earlier is not None and not earlier.done():
                        await asyncio.wait((earlier,))  # its bytes may still be read by the transport
                msg = await self._receive(step, c, hi - lo)
                if target is not None and self.node.mailbox.is_posted(msg, target):
                    if s < p - 2:
                        self._send(plan.seq(step + 1, c), target)  # the result itself, unchanged
                    continue
                self.codec.decode(msg.tensors, dest)
                if s < p - 2:
                    self._forward(plan.seq(step + 1, c), msg)
                else:
                    self.node.mailbox.release(msg)

    def _post_in_place(self) -> dict[tuple[int, int], list[torch.Tensor]]:
        """Post the all-gather's receives straight into the result, for every chunk whose
        reduce-scatter send has let go of that memory (the others go through the pool)."""
        p, plan = self.p, self.plan
        posted: dict[tuple[int, int], list[torch.Tensor]] = {}
        for s in range(p - 1):
            step = p - 1 + s
            segment = (self.pos - s) % p
            for c, (lo, hi) in enumerate(plan.chunks(segment)):
                earlier = self._reduce_sends.get((segment, c))
                if earlier is not None and not earlier.done():
                    continue
                target = [self.flat[lo:hi]]
                if self.node.mailbox.post(COLLECTIVE_KIND, self.tag, self.left, plan.seq(step, c), target):
                    posted[(step, c)] = target
        return posted

    # ------------------------------------------------------------------ messages
    def _send(self, seq: int, payload: list[torch.Tensor], *, key: tuple[int, int] | None = None) -> None:
        msg = Message(COLLECTIVE_KIND, self.ring.rank, self.right, seq, self.tag, None, payload)
        task = self.node.post_tracked(msg)
        if task is not None:
            self._sends.append(task)
            if key is not None:
                self._reduce_sends[key] = task

    def _forward(self, seq: int, received: Message) -> None:
        """Send a received payload on unchanged; its pool buffers return once it has left."""
        msg = Message(COLLECTIVE_KIND, self.ring.rank, self.right, seq, self.tag, None, received.tensors)
        task = self.node.post_tracked(msg)
        if task is None:
            self.node.mailbox.release(received)
            return
        self._sends.append(task)
        task.add_done_callback(lambda _t: self.node.mailbox.release(received))

    async def _receive(self, step: int, chunk: int, numel: int) -> Message:
        p = self.p
        phase = "reduce-scatter" if step < p - 1 else "all-gather"
        what = (f"chunk {chunk} of {phase} step {step % (p - 1) + 1}/{p - 1} of all-reduce {self.tag!r} "
                f"among group {list(self.members)} (rank {self.ring.rank})")
        msg = await self.node.mailbox.receive(COLLECTIVE_KIND, self.tag, self.left, self.plan.seq(step, chunk),
                                              what=what)
        expected = self.codec.payload_specs(numel, self.flat.dtype)
        got = tuple(TensorSpec(t.dtype, tuple(t.shape)) for t in msg.tensors)
        if got != expected:
            self.node.mailbox.release(msg)
            raise ProtocolError(
                f"rank {self.ring.rank}: all-reduce {self.tag!r} of group {list(self.members)}: rank "
                f"{self.left} sent {_describe(got)} where {_describe(expected)} was expected; do all "
                f"members pass tensors of the same size and dtype, with the same codec?")
        return msg


def _describe(specs: tuple[TensorSpec, ...]) -> str:
    return ", ".join(f"{str(s.dtype).removeprefix('torch.')}{list(s.shape)}" for s in specs) or "nothing"

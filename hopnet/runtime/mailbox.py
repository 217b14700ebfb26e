"""The node's mailbox for collective messages: messages wait here until a receive asks for them.

A collective message is addressed by its key ``(kind, tag, src, seq)``: the message kind,
the tag of the round it belongs to (which keeps concurrent groups and back-to-back rounds
apart), its sender, and its sequence number within the round (carried in the envelope's
``iter`` field). A message may arrive before the receive that wants it (a ring neighbour
that runs ahead) or after; either way it is matched by key, never by arrival order.

Tensor payloads land in buffers from a :class:`SpecPool`, keyed by dtype and shape. The
receiver hands them back with :meth:`Mailbox.release` once it has read them, so in steady
state (the same shapes round after round) receiving allocates no tensor memory. A
receiver that knows where a payload should end up may :meth:`Mailbox.post` that place
before the message arrives; the bytes then land there directly, with no copy.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

from hopnet.errors import PeerFailure
from hopnet.runtime.clock import Clock
from hopnet.wire import Header, Message, TensorSpec, register_kind

COLLECTIVE_KIND = "coll"
"""The kind of every collective message (chunks of a ring all-reduce, say)."""
COLLECTIVE_KINDS: frozenset[str] = frozenset({COLLECTIVE_KIND})
for _kind in COLLECTIVE_KINDS:
    register_kind(_kind, any_rank=True)

MailKey = tuple[str, Any, int, int]
"""(kind, tag, src, seq)"""


class SpecPool:
    """Free tensors by (dtype, shape), allocated on demand and reused after release."""

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self.held_bytes = 0
        self.allocated = 0
        self._free: dict[TensorSpec, list[torch.Tensor]] = defaultdict(list)

    def take(self, spec: TensorSpec) -> torch.Tensor:
        free = self._free.get(spec)
        if free:
            tensor = free.pop()
            self.held_bytes -= spec.nbytes
            return tensor
        self.allocated += 1
        return torch.empty(spec.shape, dtype=spec.dtype)

    def give(self, tensor: torch.Tensor) -> None:
        spec = TensorSpec(tensor.dtype, tuple(tensor.shape))
        if self.held_bytes + spec.nbytes > self.max_bytes:
            return  # let it go: keeps a burst of odd shapes from pinning memory
        self.held_bytes += spec.nbytes
        self._free[spec].append(tensor)


class Mailbox:
    """Collective messages by key, for the kinds given; lives on the node's event loop."""

    def __init__(self, kinds: frozenset[str], clock: Clock, *, pool: SpecPool | None = None) -> None:
        self.kinds = kinds
        self.clock = clock
        self.pool = pool if pool is not None else SpecPool()
        self._arrived: dict[MailKey, Message] = {}
        self._waiting: dict[MailKey, asyncio.Future[Message]] = {}
        self._posted: dict[MailKey, list[torch.Tensor]] = {}
        self._departed: dict[int, tuple[str, str]] = {}
        self._rounds: dict[tuple[str, Any], frozenset[int]] = {}  # open rounds' members, by (kind, tag)
        self._broken: dict[tuple[str, Any], PeerFailure] = {}  # open rounds a dead member broke
        self.replaceable = False
        """Dead peers may be replaced (``--max-restarts``): a round with a dead member fails rather than wait."""

    def __len__(self) -> int:
        return len(self._arrived)

    # ------------------------------------------------------------------ the transport's side
    def buffers_for(self, header: Header) -> list[torch.Tensor] | None:
        if not header.specs:
            return None
        if self._posted:
            posted = self._posted.pop((header.kind, header.tag, header.src, header.iter), None)
            if posted is not None and _matches(posted, header.specs):
                return posted
        return [self.pool.take(spec) for spec in header.specs]

    def deliver(self, msg: Message) -> None:
        key: MailKey = (msg.kind, msg.tag, msg.src, msg.iter)
        waiter = self._waiting.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(msg)
            return
        old = self._arrived.get(key)
        if old is not None:  # a duplicate key: a peer reused a tag while its round was still open
            self.release(old)
        self._arrived[key] = msg

    def peer_departed(self, peer: int, why: str, state: str = "departed") -> None:
        """``peer`` will send nothing more (``state``: "departed" or "dead"): fail the receives
        waiting on it, now and later."""
        self._departed[peer] = (why, state)
        for key, waiter in list(self._waiting.items()):
            if key[2] == peer and not waiter.done():
                del self._waiting[key]
                waiter.set_exception(self._departure(key, (why, state)))

    def open_round(self, kind: str, tag: Any, members: Iterable[int]) -> None:
        """A round among ``members`` starts (:meth:`break_rounds_with` fails it if one of them dies;
        with ``replaceable``, one that starts with a dead member fails at once)."""
        key = (kind, tag)
        self._rounds[key] = frozenset(members)
        if self.replaceable:
            dead = sorted(m for m in self._rounds[key] if self._departed.get(m, ("", ""))[1] == "dead")
            if dead:
                self._broken[key] = PeerFailure(f"rank {dead[0]} is dead (waiting for its replacement): round "
                                                f"{tag!r} among {sorted(self._rounds[key])} cannot run",
                                                peer=dead[0], peer_state="dead")

    def close_round(self, kind: str, tag: Any) -> None:
        self._rounds.pop((kind, tag), None)
        self._broken.pop((kind, tag), None)

    def break_rounds_with(self, peer: int, why: str) -> None:
        """``peer`` died: fail every open round it is a member of, whoever each member waits on now,
        so that no member waits for a round that cannot finish (a dead member's replacement never
        takes up its predecessor's rounds). Only with replacements about (``--max-restarts``): a
        round a member died in may otherwise still finish."""
        for (kind, tag), members in self._rounds.items():
            if peer not in members or (kind, tag) in self._broken:
                continue
            failure = PeerFailure(f"rank {peer} {why} in round {tag!r} among {sorted(members)}",
                                  peer=peer, peer_state="dead")
            self._broken[(kind, tag)] = failure
            for key, waiter in list(self._waiting.items()):
                if key[0] == kind and key[1] == tag and not waiter.done():
                    del self._waiting[key]
                    waiter.set_exception(failure)

    def peer_rejoined(self, peer: int) -> None:
        """A new process took over ``peer``'s rank: receives from it wait again."""
        self._departed.pop(peer, None)

    # ------------------------------------------------------------------ the collective's side
    def post(self, kind: str, tag: Any, src: int, seq: int, tensors: list[torch.Tensor]) -> bool:
        """Receive the message with this key straight into ``tensors`` (if its payload matches
        them). False if it has already arrived (into pool buffers): read it with :meth:`receive`.
        Tell posted tensors from pool ones with :meth:`is_posted`; never release posted ones."""
        key: MailKey = (kind, tag, src, seq)
        if key in self._arrived:
            return False
        self._posted[key] = tensors
        return True

    @staticmethod
    def is_posted(msg: Message, tensors: list[torch.Tensor]) -> bool:
        """Whether ``msg`` was received into ``tensors`` (given to :meth:`post`)."""
        return len(msg.tensors) == len(tensors) and all(a is b for a, b in zip(msg.tensors, tensors))

    async def receive(self, kind: str, tag: Any, src: int, seq: int, *, what: str) -> Message:
        """The message with this key, waiting at most the clock's timeout for it.

        ``what`` names the wait in the timeout's message (the group, the round and the step)."""
        key: MailKey = (kind, tag, src, seq)
        msg = self._arrived.pop(key, None)
        if msg is not None:
            return msg
        why = self._departed.get(src)
        if why is not None:
            raise self._departure(key, why)
        broken = self._broken.get((kind, tag))
        if broken is not None:
            raise broken
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Message] = loop.create_future()
        self._waiting[key] = waiter
        try:
            return await self.clock.wait(waiter, what, peer=src)
        except BaseException:
            # Cancelled after deliver() handed the message over, before this task resumed: keep it
            # for the next receive of the key (a consensus cancels its waits for the next round's
            # views once this round is complete, and lost one so).
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._arrived.setdefault(key, waiter.result())
            raise
        finally:
            if self._waiting.get(key) is waiter:
                del self._waiting[key]

    def release(self, msg: Message) -> None:
        """Give the message's tensors back to the pool (the caller has read them)."""
        for tensor in msg.tensors:
            self.pool.give(tensor)
        msg.tensors = []

    def discard_tag(self, kind: str, tag: Any) -> int:
        """Drop what arrived for a round that will not be read any more (it failed). Returns the count."""
        for key in [key for key in self._posted if key[0] == kind and key[1] == tag]:
            del self._posted[key]  # the caller's tensors: nothing may land in them any more
        keys = [key for key in self._arrived if key[0] == kind and key[1] == tag]
        for key in keys:
            self.release(self._arrived.pop(key))
        return len(keys)

    @staticmethod
    def _departure(key: MailKey, why: tuple[str, str]) -> PeerFailure:
        kind, tag, src, seq = key
        text, state = why
        return PeerFailure(f"rank {src} {text} before sending {kind} message {seq} of round {tag!r}",
                           peer=src, peer_state=state)


def _matches(tensors: list[torch.Tensor], specs: tuple[TensorSpec, ...]) -> bool:
    return len(tensors) == len(specs) and all(
        t.dtype == s.dtype and tuple(t.shape) == s.shape for t, s in zip(tensors, specs))

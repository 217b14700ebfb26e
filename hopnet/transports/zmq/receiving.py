"""Receiving over ZeroMQ: the event loop's reader callback drains the ROUTER, each message is checked
(its frames, and that its sender is who its header says), its tensors land in the receiver's buffers
and it is delivered; messages that came over a payload stream are checked and delivered here too.
No exception escapes to the loop: a bad message is dropped and counted."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import cast

import numpy as np
import torch
import zmq

from hopnet.transports import payload_stream as ps
from hopnet.transports.base import DISCARD, Receiver
from hopnet.transports.zmq import limits
from hopnet.transports.zmq.addresses import routing_id
from hopnet.transports.zmq.frames import buffers_match, byte_view, first_frames, frame_count, new_tensor
from hopnet.transports.zmq.state import ZmqState
from hopnet.wire import DecodeError, Header, Message, TensorSpec, decode_header

log = logging.getLogger(__name__)

DRAIN_BATCH = 256  # messages handled per wake-up before yielding to other tasks

_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


class ZmqReceiving(ZmqState):
    """The ROUTER's reader, the checks on each inbound message, and the payload streams' inbox callbacks."""

    def _on_handshake_events(self) -> None:
        """Count connections refused at the CURVE handshake (a process without the run key)."""
        watch = self._handshakes
        if watch is None:
            return
        refused = watch.poll()
        if refused:
            self.stats.dropped["unauthenticated"] += refused
            log.debug("rank %d: refused %d connection attempt(s) without the run key", self.rank, refused)

    def _on_readable(self) -> None:
        """Drain the ROUTER. Called by the loop when the socket's (edge-triggered) FD fires.

        A reader callback instead of a task awaiting zmq.asyncio's recv: no Future and no
        task switch per message, which is most of the cost of a control message.
        """
        sock = self._router
        if sock is None:
            return
        handle = self._handle
        get = cast(Callable[[int], int], sock.get)  # EVENTS is an int option
        try:
            for _ in range(DRAIN_BATCH):
                # Reading EVENTS makes libzmq process its pending commands and re-arms the
                # edge-triggered FD; cheaper than a receive that fails with EAGAIN.
                if not get(_EVENTS) & _POLLIN:
                    return
                try:
                    frames = sock.recv_multipart(_NOBLOCK, copy=False)
                except zmq.Again:
                    continue
                handle(frames)
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.ETERM, zmq.ENOTSOCK) or sock.closed:
                return
            self.stats.drop("internal_error")
            log.debug("rank %d: receive failed", self.rank, exc_info=True)
        except Exception:
            self.stats.drop("internal_error")
            log.debug("rank %d: receive failed", self.rank, exc_info=True)
        # Batch used up (or an error): let other callbacks run, then continue draining.
        if self._router is sock and self._loop is not None:
            self._loop.call_soon(self._on_readable)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        try:
            checked = self._checked(frames)
            if checked is None:
                return
            inbox = self._inbox
            if inbox is not None and frames[0].bytes[:1] != b"x":  # express messages overtake by contract
                # A sender's messages keep their order with its streamed ones (its lane).
                inbox.arrived(checked[0].src, checked, ps.read_tag(frames[1].buffer))
                return
            self._take(*checked)
        except Exception:
            self.stats.drop("internal_error")
            log.debug("rank %d: error handling an inbound message", self.rank, exc_info=True)

    def _handle_now(self, checked: tuple[Header, list[zmq.Frame]]) -> None:
        """Handle a message whose turn in its sender's lane has come."""
        try:
            self._take(*checked)
        except Exception:
            self.stats.drop("internal_error")
            log.debug("rank %d: error handling an inbound message", self.rank, exc_info=True)

    def _checked(self, frames: list[zmq.Frame]) -> tuple[Header, list[zmq.Frame]] | None:
        """``(header, frames)`` of a message from whom it says, or None: dropped and counted. A
        dropped message takes no place in its sender's lane (a streamed message sent after it
        may wait ``payload_stream.ORDER_WAIT_S``): what a working sender sends is not dropped here."""
        stats = self.stats
        if len(frames) < 2:
            stats.drop("truncated")
            return None
        first = frames[1].buffer
        if ps.is_tagged(first):  # its place in the sender's lane: for the inbox
            first = first[ps.LANE.size:]
        try:
            header = decode_header(first)
        except DecodeError as exc:
            stats.drop(exc.reason)
            return None
        reason = self.check_header(header)
        if reason is not None:
            stats.drop(reason)
            return None
        expected_id = self._ids.get(header.src)
        if expected_id is None:
            expected_id = self._ids[header.src] = routing_id(header.src)
        sender_id = frames[0].bytes
        if sender_id != expected_id and sender_id != b"x" + expected_id:
            stats.drop("spoofed_src")
            return None
        return header, frames

    def _take(self, header: Header, frames: list[zmq.Frame]) -> None:
        """Validate a checked message's frames, receive its tensors and deliver it."""
        stats = self.stats
        specs = header.specs
        if not specs:
            if len(frames) != 2:
                stats.drop("extra_frames")
                return
            receiver = self._receiver
            if receiver is not None:
                seq = header.seq
                if seq and not self._numbers.take(_key(header, frames), header.epoch, seq):
                    return
                stats.received_messages += 1
                receiver.deliver(Message(header.kind, header.src, header.dst, header.iter,
                                         header.tag, header.meta))
            return

        # Validate every frame against the specs before asking for buffers.
        expected = 0
        sizes = []
        for spec in specs:
            nbytes = spec.nbytes
            sizes.append(nbytes)
            expected += frame_count(nbytes)
        got = len(frames) - 2
        if got != expected:
            stats.drop("truncated" if got < expected else "extra_frames")
            return
        i = 2
        for nbytes in sizes:
            if nbytes <= limits.CHUNK_BYTES:
                if len(frames[i]) != nbytes:
                    stats.drop("bad_size")
                    return
                i += 1
                continue
            for off in range(0, nbytes, limits.CHUNK_BYTES):
                if len(frames[i]) != min(limits.CHUNK_BYTES, nbytes - off):
                    stats.drop("bad_size")
                    return
                i += 1

        receiver = self._receiver
        if receiver is None:
            return
        if header.seq and not self._numbers.take(_key(header, frames), header.epoch, header.seq):
            return
        target = receiver.buffers_for(header)
        if target is DISCARD:
            stats.drop("discarded")
            return
        if target is None:
            tensors = [new_tensor(spec.dtype, spec.shape, frames, i)
                       for spec, i in zip(specs, first_frames(sizes))]
        else:
            if not buffers_match(target, specs):
                stats.drop("bad_buffers")
                log.debug("rank %d: buffers_for returned tensors that do not match %s", self.rank, specs)
                return
            tensors = list(target)
            i = 2
            for t, nbytes in zip(tensors, sizes):
                if nbytes == 0:
                    i += 1
                    continue
                dst = byte_view(t)
                for off in range(0, nbytes, limits.CHUNK_BYTES):
                    frame = frames[i]
                    i += 1
                    dst[off:off + len(frame)] = np.frombuffer(frame.buffer, dtype=np.uint8)
        stats.received_messages += 1
        stats.received_bytes += sum(sizes)
        receiver.deliver(Message(header.kind, header.src, header.dst, header.iter,
                                 header.tag, header.meta, tensors))

    def _check_streamed(self, header: Header, rank: int) -> str | None:
        """A streamed message's header (from ``rank``'s stream): a drop reason, or None."""
        reason = self.check_header(header)
        if reason is None and header.src != rank:
            reason = "spoofed_src"
        return reason

    def _admits_stream(self, rank: int) -> bool:
        """Whether a payload stream's hello from ``rank`` is accepted: from any rank this one
        takes messages from (its senders, or every rank of the run once ``admit_run``)."""
        size = self.world_size
        return rank in self.allowed_senders or (size is not None and 0 <= rank < size and rank != self.rank)

    def _stream_targets(self, header: Header) -> ps.Prepared:
        """Where a streamed message's bytes go. Its number is checked here, before a byte lands in a
        buffer, and taken once the bytes are all read (:meth:`_stream_received`; a message cut off
        mid-way is a gap, not a message received), or now if the receiver will not have it (as on
        ZeroMQ). Nothing else of its sender is handled in between (the inbox keeps the sender's order)."""
        receiver = self._receiver
        if receiver is None:
            return [], "closed"
        seq = header.seq
        if seq and not self._numbers.fresh(header.src, header.epoch, seq):
            return [], "duplicate"
        tensors, reason = self._receiver_targets(receiver, header)
        if reason is not None and seq:
            self._numbers.take(header.src, header.epoch, seq)
        return tensors, reason

    def _receiver_targets(self, receiver: Receiver, header: Header) -> ps.Prepared:
        try:
            target = receiver.buffers_for(header)
        except Exception:
            log.debug("rank %d: buffers_for failed", self.rank, exc_info=True)
            return [], "internal_error"
        if target is DISCARD:
            return [], "discarded"
        if target is None:
            return [torch.empty(spec.shape, dtype=spec.dtype) for spec in header.specs], None
        if not buffers_match(target, header.specs):
            log.debug("rank %d: buffers_for returned tensors that do not match %s", self.rank, header.specs)
            return [], "bad_buffers"
        return list(target), None

    def _stream_received(self, header: Header, tensors: list[torch.Tensor]) -> None:
        receiver = self._receiver
        if receiver is None:
            return
        if header.seq and not self._numbers.take(header.src, header.epoch, header.seq):
            return
        self.stats.received_messages += 1
        self.stats.received_bytes += _stream_nbytes(header.specs)
        try:
            receiver.deliver(Message(header.kind, header.src, header.dst, header.iter, header.tag, header.meta,
                                     tensors))
        except Exception:
            self.stats.drop("internal_error")
            log.debug("rank %d: error delivering a streamed message", self.rank, exc_info=True)


def _key(header: Header, frames: list[zmq.Frame]) -> int:
    """The link a ZeroMQ message came on: its sender's, or its sender's express one (routing id ``x``):
    :func:`~hopnet.transports.link_numbers.link_key`, inlined (once per message)."""
    return ~header.src if frames[0].bytes[:1] == b"x" else header.src


def _stream_nbytes(specs: tuple[TensorSpec, ...]) -> int:
    return sum(spec.nbytes for spec in specs)

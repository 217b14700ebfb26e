"""Sending over ZeroMQ: a control message in one non-blocking call; a message with tensors copied,
staged in a pooled buffer or sent zero-copy by its size (or over the peer's payload stream); and a
send that libzmq does not take within ``send_timeout`` dropped, with the peer's DEALER reset.
The module docstring of :mod:`hopnet.transports.zmq` gives the design."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
import torch
import zmq

from hopnet.errors import HopnetError
from hopnet.transports import payload_stream as ps
from hopnet.transports.zmq import limits
from hopnet.transports.zmq.addresses import express_routing_id
from hopnet.transports.zmq.frames import byte_view, send_now
from hopnet.transports.zmq.peer import Peer
from hopnet.transports.zmq.send_memory import SendDone
from hopnet.transports.zmq.state import WaitTimeout
from hopnet.transports.zmq.stream_sending import ZmqStreamSending
from hopnet.wire import Message, encode_header

log = logging.getLogger(__name__)


class ZmqSending(ZmqStreamSending):
    """``send`` and ``send_express``, and the ways a message's tensors reach libzmq."""

    async def send(self, msg: Message) -> None:
        peer = self._peers.get(msg.dst)
        while peer is not None and peer.gate is not None:  # a payload stream to it is opening
            await asyncio.shield(peer.gate)
            peer = self._peers.get(msg.dst)
        if peer is None:
            if msg.dst in self._departed:
                self.stats.drop("peer_left")
                return
            if self._closed:
                raise HopnetError("transport is closed")
            raise HopnetError(f"rank {self.rank} has no connection to rank {msg.dst}; call connect() first")
        if not msg.tensors:
            header = encode_header(msg, peer.epoch, peer.numbered + 1)  # numbered once it encodes
            peer.numbered += 1
            header = peer.tagged(header)
            # The hot path for control messages: one non-blocking send, no Futures.
            if not peer.busy:
                try:
                    peer.raw.send(header, zmq.NOBLOCK)
                except zmq.Again:
                    pass
                else:
                    self.stats.sent_messages += 1
                    return
            await self._send_queued(peer, [header], 0)
            return
        await self._send_tensors(peer, msg)

    async def send_express(self, msg: Message) -> None:
        """See :meth:`Transport.send_express`: a control message on a connection of its own
        (opened at the first use), so it waits behind no tensor bytes, in libzmq or in the
        kernel's socket buffer."""
        peer = self._peers.get(msg.dst)
        if peer is None or msg.tensors:
            await self.send(msg)
            return
        if peer.express is None:
            peer.open_express(self._open_dealer(peer.endpoint, express_routing_id(self.rank)))
        assert peer.express is not None and peer.express_raw is not None
        header = encode_header(msg, peer.epoch, peer.xnumbered + 1)
        peer.xnumbered += 1
        try:
            peer.express_raw.send(header, zmq.NOBLOCK)
        except zmq.Again:  # HWM messages already wait (a peer not up yet): queue behind them
            sent = peer.express.send(header)
            try:
                await asyncio.wait_for(sent, self.send_timeout)
            except WaitTimeout:
                self.stats.drop("send_timeout")
                return
        self.stats.sent_messages += 1

    async def _send_tensors(self, peer: Peer, msg: Message) -> None:
        tensors = msg.tensors
        sizes = []
        for t in tensors:
            if t.device.type != "cpu":
                raise HopnetError(f"ZmqTransport sends CPU tensors only, got one on {t.device}")
            sizes.append(t.numel() * t.element_size())
        total = sum(sizes)
        # Numbered in the order of the sends: a stream being opened below holds back the sends to
        # this peer behind it (its gate), and nothing else awaits before the message is queued.
        header = encode_header(msg, peer.epoch, peer.numbered + 1)
        peer.numbered += 1
        if total >= ps.MIN_BYTES and peer.data is not None and self.payload_stream:
            if await self._send_streamed(peer, header, tensors, sizes, total):
                return
        header = peer.tagged(header)  # no await from here until the message is in libzmq's queue
        if max(sizes) < limits.COPY_THRESHOLD:
            # pyzmq copies every frame (all under sock.copy_threshold): done once libzmq has it.
            parts: list[Any] = [header]
            parts.extend(byte_view(t) if n else b"" for t, n in zip(tensors, sizes))
            await self._send_copied(peer, parts, total)
        elif total <= limits.STAGE_BYTES:
            await self._send_staged(peer, header, tensors, sizes, total)
        else:
            await self._send_zero_copy(peer, header, tensors, sizes, total)

    async def _send_copied(self, peer: Peer, parts: list[Any], total: int) -> None:
        if not peer.busy:
            try:
                send_now(peer.raw, parts)
            except zmq.Again:
                pass
            else:
                self.stats.sent_messages += 1
                self.stats.sent_bytes += total
                return
        await self._send_queued(peer, parts, total)

    async def _send_queued(self, peer: Peer, parts: list[Any], total: int, *, count: bool = True) -> bool:
        """Send through zmq.asyncio, which waits for room in the queue. False if the message
        was dropped instead (timed out, or the socket was closed meanwhile)."""
        peer.busy += 1
        try:
            fut = asyncio.ensure_future(peer.sock.send_multipart(parts, copy=False))  # zmq.asyncio's Future
            del parts
            try:
                done, _ = await asyncio.wait((fut,), timeout=self.send_timeout)
            except asyncio.CancelledError:
                fut.cancel()  # never send it later, from memory the caller owns again
                raise
            if not done:
                fut.cancel()
                log.warning("rank %d: queue to rank %d full for %.1fs; dropping a message",
                            self.rank, peer.rank, self.send_timeout)
                self.stats.drop("send_timeout")
                return False
            if fut.cancelled():  # zmq.asyncio cancels queued sends when the socket closes
                self.stats.drop(self._lost_reason(peer.rank))
                return False
            fut.result()
        finally:
            peer.busy -= 1
            self._send_held_if_free(peer)
        if count:
            self.stats.sent_messages += 1
            self.stats.sent_bytes += total
        return True

    async def _send_staged(self, peer: Peer, header: bytes, tensors: list[torch.Tensor],
                           sizes: list[int], total: int) -> None:
        """Copy the tensors into a pooled buffer, hand that to libzmq and return early.

        For small messages the wait until libzmq releases a zero-copy frame (written to
        the kernel, then pyzmq's gc thread wakes the loop) would leave the link idle
        between messages; a memcpy is cheaper. The staged message is queued at once (so
        order is kept), then ``send`` waits only while more than STAGE_INFLIGHT staged
        messages to this peer are still in libzmq: the link always has the next message
        ready. Past STAGE_MAX_INFLIGHT (many concurrent senders) messages go zero-copy,
        which bounds the staging memory.
        """
        if peer.staged >= limits.STAGE_MAX_INFLIGHT:
            await self._send_zero_copy(peer, header, tensors, sizes, total)
            return
        buf = self._stage_pool.take(total)
        done = SendDone(self._loop or asyncio.get_running_loop())
        parts: list[Any] = [header]
        view = buf.data
        off = 0
        for t, n in zip(tensors, sizes):
            if n < limits.COPY_THRESHOLD:
                parts.append(byte_view(t) if n else b"")  # pyzmq copies it anyway
                continue
            buf[off:off + n] = byte_view(t)
            for c in range(off, off + n, limits.CHUNK_BYTES):
                frame = view[c:min(c + limits.CHUNK_BYTES, off + n)]
                if frame.nbytes >= limits.COPY_THRESHOLD:
                    done.track(frame)  # else pyzmq copies it during the send call
                parts.append(frame)
            off += n
        del view, frame
        peer.staged += 1
        self._inflight.add(done)  # the weakref callbacks need `done` alive
        done.future.add_done_callback(lambda _f: self._unstage(peer, buf, done))
        await self._send_copied(peer, parts, total)
        del parts  # only libzmq may keep the frames alive now, or they are never released
        if peer.staged > limits.STAGE_INFLIGHT:
            await self._wait_staged(peer)

    def _unstage(self, peer: Peer, buf: np.ndarray, done: SendDone) -> None:
        self._inflight.discard(done)
        peer.staged -= 1
        self._stage_pool.give(buf)
        if peer.stage_waiters:
            waiters, peer.stage_waiters = peer.stage_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)
        self._send_held_if_free(peer)

    async def _wait_staged(self, peer: Peer) -> None:
        """Wait until at most STAGE_INFLIGHT staged messages to ``peer`` are in libzmq."""
        loop = self._loop or asyncio.get_running_loop()
        deadline = loop.time() + self.send_timeout
        while peer.staged > limits.STAGE_INFLIGHT and self._peers.get(peer.rank) is peer:
            fut = loop.create_future()
            peer.stage_waiters.append(fut)
            try:
                await asyncio.wait_for(fut, max(0.0, deadline - loop.time()))
            except WaitTimeout:
                if self._peers.get(peer.rank) is not peer:
                    return
                log.warning("rank %d: sends to rank %d not taken within %.1fs; dropping what "
                            "is queued and resetting the connection", self.rank, peer.rank,
                            self.send_timeout)
                self.stats.drop("send_timeout")
                self._reset_peer(peer)
                return

    async def _send_zero_copy(self, peer: Peer, header: bytes, tensors: list[torch.Tensor],
                              sizes: list[int], total: int) -> None:
        parts: list[Any] = [header]
        done = SendDone(self._loop or asyncio.get_running_loop())
        for t, n in zip(tensors, sizes):
            if n < limits.COPY_THRESHOLD:
                parts.append(byte_view(t) if n else b"")  # pyzmq copies it
                continue
            flat = byte_view(t).data
            for off in range(0, n, limits.CHUNK_BYTES):
                chunk = flat[off:off + limits.CHUNK_BYTES]
                if chunk.nbytes >= limits.COPY_THRESHOLD:
                    done.track(chunk)  # else pyzmq copies it during the send call
                parts.append(chunk)
            del flat, chunk
        self._inflight.add(done)
        peer.zero_copy += 1
        try:
            sent = False
            if not peer.busy:
                try:
                    send_now(peer.raw, parts)
                    sent = True
                except zmq.Again:
                    pass
            if sent:
                del parts  # from now on only libzmq holds the tensor memory
                ok = await self._await_release(peer, done)
            else:
                ok = await self._send_queued(peer, parts, total, count=False)
                del parts
                if ok:
                    ok = await self._await_release(peer, done)
                else:
                    await done.future  # the queued message was discarded: wait for its release
            if ok:
                self.stats.sent_messages += 1
                self.stats.sent_bytes += total
        finally:
            self._inflight.discard(done)
            peer.zero_copy -= 1
            self._send_held_if_free(peer)

    async def _await_release(self, peer: Peer, done: SendDone) -> bool:
        """Wait until libzmq is done with the frames. False if that took too long."""
        fut = done.future
        if fut.done():
            return True
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.send_timeout)
            return True
        except WaitTimeout:
            log.warning("rank %d: send to rank %d not taken within %.1fs; dropping it and "
                        "resetting the connection", self.rank, peer.rank, self.send_timeout)
            self.stats.drop("send_timeout")
            self._reset_peer(peer)
            await fut  # closing the socket makes libzmq release the queued frames
            return False

"""The sending side of payload streams: a large message whole over a plain TCP stream to its peer
(:mod:`hopnet.transports.payload_stream`), the stream opened at the first such message."""

from __future__ import annotations

import asyncio
import logging

import torch

from hopnet.transports import payload_stream as ps
from hopnet.transports.zmq.frames import byte_view
from hopnet.transports.zmq.latest import ZmqLatest
from hopnet.transports.zmq.peer import Peer
from hopnet.transports.zmq.state import WaitTimeout

log = logging.getLogger(__name__)


class ZmqStreamSending(ZmqLatest):
    """Sends a message's header and tensors over the peer's payload stream."""

    async def _send_streamed(self, peer: Peer, header: bytes, tensors: list[torch.Tensor],
                             sizes: list[int], total: int) -> bool:
        """The whole message over the peer's payload stream (opened now if need be). False if
        there is no stream to the peer: the caller sends over ZeroMQ."""
        stream = peer.stream
        if stream is None or stream.closed:
            stream = await self._open_stream(peer)
            if stream is None:
                return False
        done = stream.write(header, [byte_view(t).data for t, n in zip(tensors, sizes) if n], total, peer.zseq)
        peer.streaming += 1
        try:
            reason = await self._await_stream(peer, stream, done)
        finally:
            peer.streaming -= 1
            self._send_held_if_free(peer)
        if reason is None:
            self.stats.sent_messages += 1
            self.stats.sent_bytes += total
            self.streamed_messages += 1
        else:
            self.stats.drop(reason)
        return True

    async def _open_stream(self, peer: Peer) -> ps.OutStream | None:
        loop = self._loop or asyncio.get_running_loop()
        if peer.data is None or loop.time() < peer.stream_retry_at:
            return None
        gate = peer.gate = loop.create_future()
        stream: ps.OutStream | None = None
        try:
            host, port = peer.data
            stream = await ps.OutStream.open(loop, host, port, self.rank, peer.epoch,
                                             min(ps.CONNECT_TIMEOUT_S, self.send_timeout))
        except (OSError, WaitTimeout) as exc:
            peer.stream_retry_at = loop.time() + ps.RETRY_S
            log.warning("rank %d: cannot open a payload stream to rank %d at %s:%d (%s); its tensors go "
                        "over ZeroMQ for %.0fs", self.rank, peer.rank, *peer.data, exc or "timed out", ps.RETRY_S)
        finally:
            peer.gate = None
            gate.set_result(None)
        if stream is not None and (self._closed or self._peers.get(peer.rank) is not peer):
            stream.abort("closed")
            return None
        peer.stream = stream
        return stream

    async def _await_stream(self, peer: Peer, stream: ps.OutStream, done: asyncio.Future[str | None]) -> str | None:
        """Wait until the payload is in the kernel; None, or why it was dropped."""
        if done.done():
            return done.result()
        try:
            return await asyncio.wait_for(asyncio.shield(done), self.send_timeout)
        except WaitTimeout:
            log.warning("rank %d: payload stream to rank %d took nothing for %.1fs; closing it", self.rank,
                        peer.rank, self.send_timeout)
            stream.abort("send_timeout")
            return "send_timeout"
        except asyncio.CancelledError:
            stream.abort("cancelled")  # the caller owns the tensors again: never write from them later
            raise

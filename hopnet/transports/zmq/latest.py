"""Links slower than the sender (:meth:`ZmqTransport.send_latest`): while a peer's link is busy, one
message per peer is held aside, a newer one replacing it, and sent once the link is free."""

from __future__ import annotations

import asyncio
import logging

import torch

from hopnet.errors import HopnetError
from hopnet.transports.zmq.peer import Peer
from hopnet.transports.zmq.state import ZmqState
from hopnet.wire import Message

log = logging.getLogger(__name__)


class ZmqLatest(ZmqState):
    """``send_latest`` and ``drain``: the held message of each peer, and when it leaves."""

    async def send_latest(self, msg: Message) -> None:
        """See :meth:`Transport.send_latest`. The held copy is a snapshot of the tensors taken
        now; a message that replaces a held one is copied into the held one's tensors."""
        peer = self._peers.get(msg.dst)
        if peer is None or not msg.tensors or not peer.backlogged:
            await self.send(msg)
            return
        held = peer.held
        if held is not None and _same_layout(held.tensors, msg.tensors):
            for mine, theirs in zip(held.tensors, msg.tensors):
                mine.copy_(theirs)
            snapshot = held.tensors
        else:
            snapshot = [t.detach().clone() for t in msg.tensors]
        if held is not None:
            self.stats.drop("superseded")
        peer.held = Message(msg.kind, msg.src, msg.dst, msg.iter, msg.tag, msg.meta, snapshot)
        self._send_held_if_free(peer)  # the link may have freed while we copied

    async def drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.send_timeout
        while not self._closed and (self._held_sends or any(p.held is not None for p in self._peers.values())):
            if self._held_sends:
                await asyncio.wait(list(self._held_sends), timeout=max(0.0, deadline - loop.time()))
            else:
                await asyncio.sleep(0.005)  # a held message leaves when its link frees (_send_held_if_free)
            if loop.time() >= deadline:
                for peer in self._peers.values():
                    self._drop_held(peer, "send_timeout")
                return

    def _send_held_if_free(self, peer: Peer) -> None:
        """Send the peer's held message once nothing else to it is still in libzmq."""
        held = peer.held
        if (held is None or peer.busy or peer.staged or peer.zero_copy or peer.streaming or peer.sending_held
                or self._closed):
            return
        if self._peers.get(peer.rank) is not peer:
            self._drop_held(peer, self._lost_reason(peer.rank))
            return
        peer.held = None
        peer.sending_held = True
        task = (self._loop or asyncio.get_running_loop()).create_task(self._send_held(peer, held))
        self._held_sends.add(task)
        task.add_done_callback(self._held_sends.discard)

    async def _send_held(self, peer: Peer, msg: Message) -> None:
        try:
            await self.send(msg)
        except HopnetError as exc:  # closed or forgotten meanwhile: lost, as any queued message
            self.stats.drop(self._lost_reason(msg.dst))
            log.debug("rank %d: held message to rank %d not sent: %s", self.rank, msg.dst, exc)
        finally:
            peer.sending_held = False
            self._send_held_if_free(peer)


def _same_layout(mine: list[torch.Tensor], theirs: list[torch.Tensor]) -> bool:
    return len(mine) == len(theirs) and all(
        a.dtype == b.dtype and a.shape == b.shape for a, b in zip(mine, theirs))

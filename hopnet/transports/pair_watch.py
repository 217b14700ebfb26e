"""The torch plane's watch on a gloo pair: a receive that is always posted, so that a peer's death is news.

gloo fails every op pending on a pair whose connection closes or resets, which the kernel does
for a process that ends, however it ends (SIGKILL, a crash, the launcher killing a stopped worker).
A worker that is neither sending to a peer nor receiving from it (Hop's worker blocked on that
peer's tokens, a late update already taken in) has no op pending there and would learn nothing.
So each side of a pair keeps one receive posted under a tag of its own (:data:`WATCH_TAG`; updates
use tag 0, and gloo matches sends to receives per tag, so the two never meet), waited for by a
thread: when it fails with the connection closed or reset, the peer is gone.

gloo has no way to cancel a receive (its ``abort`` is not exposed, and a wait that times out closes
the whole pair), so the watch ends by a message: each side sends the other one *notice* on the
same tag, at most once, which completes the other side's watch. :data:`CLOSING` says "my
transport is closing" (sent by ``close``); :data:`FORGOT` says "I wrote you off" (sent by
``forget_peer`` after a ``bye`` or a death, and in answer to the peer's notice), so that the
peer's ``close`` need not wait for its watch. Threads still inside a torch call when the
interpreter tears down end the process with ``std::terminate``: ``close`` joins them.

NCCL matches point-to-point ops in issue order and has no tags, so a posted receive would take
the next payload: pairs on NCCL (CUDA tensors) have no watch.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

WATCH_TAG = 1
"""The tag of the watch's receive and of the notices; the payloads go with tag 0."""

CLOSING = 1.0
"""A notice: the sender's transport is closing (a close that no ``bye`` came before is a death)."""

FORGOT = 2.0
"""A notice: the sender wrote the receiver off, or answers its notice; nothing to report."""

_WAIT = timedelta(days=30)
"""gloo closes the pair when a wait times out: the watch's wait never does, in practice."""

_PEER_GONE = ("closed by peer", "reset by peer", "broken pipe")
"""How gloo words a pair whose peer's end went away (its process ended); any other failure of
an op (a timeout, which closes the pair on this side) says nothing of the peer's life."""

WatchEnded = Callable[[int, "float | None", "BaseException | None"], None]
"""Called on the event loop with (peer, the notice it sent or None, the error or None)."""


def peer_gone(error: BaseException) -> bool:
    """Whether ``error``, from an op on a gloo pair, says the peer's end of the connection went away."""
    text = str(error).lower()
    return any(words in text for words in _PEER_GONE)


class PairWatch:
    """The watch on one gloo pair, from this side: a posted receive, its thread, and our notice."""

    def __init__(self, pg: Any, peer: int, other: int, loop: asyncio.AbstractEventLoop, ended: WatchEnded) -> None:
        """``other``: the peer's rank inside the pair's group; ``ended``: told once the receive completes."""
        self.peer = peer
        self._pg = pg
        self._other = other
        self._loop = loop
        self._ended = ended
        self._landing = torch.zeros(1)
        self._work = pg.recv([self._landing], other, WATCH_TAG)
        self._notice: tuple[torch.Tensor, Any] | None = None  # kept alive until the send is done
        self.told = False
        self._thread = threading.Thread(target=self._run, name=f"hopnet-watch-{peer}", daemon=True)
        self._thread.start()

    def tell(self, notice: float) -> None:
        """Send the peer our notice, once (later calls do nothing): it completes the peer's watch."""
        if self.told:
            return
        self.told = True
        tensor = torch.full((1,), notice)
        try:
            self._notice = (tensor, self._pg.send([tensor], self._other, WATCH_TAG))
        except Exception:  # the pair is broken: the peer's watch has failed already
            self._notice = None

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the watch's thread; whether it has ended."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        error: BaseException | None = None
        try:
            self._work.wait(_WAIT)
        except BaseException as exc:  # torch raises RuntimeError / DistError
            error = exc
        notice = None if error is not None else float(self._landing[0])
        try:
            self._loop.call_soon_threadsafe(self._ended, self.peer, notice, error)
        except RuntimeError:  # the loop is closed: nobody listens any more
            pass


__all__ = ["CLOSING", "FORGOT", "PairWatch", "WATCH_TAG", "peer_gone"]

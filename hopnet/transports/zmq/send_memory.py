"""The memory zero-copy and staged sends hand to libzmq: when libzmq is done with it, and a pool of
staging buffers to copy small messages into."""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any

import numpy as np


class SendDone:
    """Completion of one zero-copy send: set once libzmq released every tracked frame.

    Each zero-copy frame is handed to pyzmq as a fresh memoryview made for it alone.
    pyzmq keeps exactly that object alive until libzmq frees the frame (its
    garbage-collector thread drops the reference then), so the memoryview dies when
    libzmq no longer reads those bytes. A weakref callback on each one (run in whichever
    thread drops the last reference) counts down; the last one wakes the event loop.
    This is MessageTracker's information without a thread blocked in ``wait()`` or
    polling.
    """

    __slots__ = ("__weakref__", "_left", "_lock", "_refs", "future", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future = loop.create_future()
        self._left = 0
        self._lock = threading.Lock()
        self._refs: list[weakref.ref] = []

    def track(self, frame: memoryview) -> None:
        with self._lock:
            self._left += 1
        self._refs.append(weakref.ref(frame, self._released))

    def _released(self, _ref: Any) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            try:
                self.loop.call_soon_threadsafe(self._finish)
            except RuntimeError:  # loop closed: nobody is waiting any more
                pass

    def _finish(self) -> None:
        self._refs.clear()  # all dead by now; breaks the done <-> callback cycle
        if not self.future.done():
            self.future.set_result(None)


class BufferPool:
    """Reusable uint8 buffers by size (rounded up to 64 KiB), so staging copies land in
    memory that is already mapped and warm instead of fresh pages."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held = 0
        self._free: dict[int, list[np.ndarray]] = {}

    @staticmethod
    def _round(n: int) -> int:
        return -(-n // (64 << 10)) * (64 << 10)

    def take(self, n: int) -> np.ndarray:
        size = self._round(n)
        free = self._free.get(size)
        if free:
            self.held -= size
            return free.pop()
        return np.empty(size, dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        size = buf.nbytes
        if self.held + size > self.max_bytes:
            return
        self.held += size
        self._free.setdefault(size, []).append(buf)

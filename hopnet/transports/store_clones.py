"""One c10d store connection per thread at a time.

A ``TCPStore`` client holds its lock for the whole of a blocking ``get``/``wait``. Threads
that share one client therefore queue behind each other's waits: a thread forming the pair
group with a peer that is still starting blocks the ``set`` of another thread forming a
group with a peer that is ready, and a ring of ranks doing this deadlocks until the store
times out. Every thread that talks to the store leases its own connection (``clone``)
from here.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


class StoreClones:
    """A pool of connections to one store, for threads that block on it concurrently."""

    def __init__(self, store: dist.Store) -> None:
        self.origin = store
        self._idle: list[dist.Store] = []
        self._lock = threading.Lock()

    @contextmanager
    def lease(self) -> Iterator[dist.Store]:
        """A connection no other thread uses until the block ends.

        A connection whose operation failed (a timed-out wait leaves a reply in flight on
        its socket) is dropped rather than handed to the next thread."""
        with self._lock:
            store = self._idle.pop() if self._idle else None
        if store is None:
            # every c10d store type clones (TCP, prefix, file, hash); torch's stubs lack the method
            store = self.origin.clone()  # type: ignore[attr-defined]
        yield store
        with self._lock:
            self._idle.append(store)


__all__ = ["StoreClones"]

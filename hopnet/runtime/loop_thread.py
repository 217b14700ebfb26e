"""The node's event loop, running in its own thread so communication progresses while
the trainer's thread computes (PyTorch releases the GIL inside its kernels)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when it is installed, else the standard loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class EventLoopThread:
    def __init__(self, name: str = "hopnet-loop") -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def native_id(self) -> int | None:
        """The loop thread's id in the kernel (its scheduler counters: :mod:`hopnet.runtime.cpu_time`)."""
        return self._thread.native_id

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        # Let cancelled tasks finish their clean-up before the loop closes.
        pending = asyncio.all_tasks(self.loop)
        for task in pending:
            task.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the loop and block the calling thread for its result.

        If the wait is interrupted (a signal handler raised in this thread, or
        ``timeout_s`` passed) the coroutine is cancelled, so nothing keeps running on the
        loop behind the caller's back.
        """
        if threading.current_thread() is self._thread:
            raise RuntimeError("EventLoopThread.run() called from the loop's own thread")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except BaseException as exc:
            if future.done():
                raise  # the coroutine's own exception (a WaitTimeout is a TimeoutError too)
            future.cancel()
            if isinstance(exc, concurrent.futures.TimeoutError):
                raise TimeoutError(f"the event loop did not finish {getattr(coro, '__qualname__', coro)} "
                                   f"within {timeout_s}s") from None
            raise

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loop (its pending tasks are cancelled and awaited) and join the thread."""
        if self.loop.is_closed() or not self._thread.is_alive():
            return
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:
            return  # closed in between
        self._thread.join(timeout=timeout_s)

"""The one place every wait goes through.

A :class:`Clock` reads time from the event loop it runs on, so the same protocol code
runs in real time (an ordinary or uvloop loop) and in virtual time (the simulator's
loop, whose ``time()`` only moves when every worker is waiting). Every wait has a
timeout and, when it expires, raises :class:`WaitTimeout` naming what it waited for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from hopnet.errors import WaitTimeout

T = TypeVar("T")


class Clock:
    def __init__(self, default_timeout_s: float) -> None:
        self.default_timeout_s = default_timeout_s

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds)

    async def wait(self, awaitable: Awaitable[T], what: str, *, peer: int | None = None,
                   iteration: int | None = None, timeout_s: float | None = None) -> T:
        """Await ``awaitable`` for at most ``timeout_s`` (default: the configured timeout)."""
        limit = self.default_timeout_s if timeout_s is None else timeout_s
        try:
            # asyncio.timeout arms one timer; wait_for would wrap the awaitable in a new task.
            async with asyncio.timeout(limit):
                return await awaitable
        except TimeoutError:
            raise WaitTimeout(what, peer=peer, iteration=iteration, waited_s=limit) from None

"""The virtual-time loop's shortcuts (a timer heap of floats, one handle per burst of
deliveries, its own sleep) run every callback in the order plain asyncio would."""

from __future__ import annotations

import asyncio
import random
from asyncio import base_events
from typing import Any

import pytest

from hopnet.sim.vloop import Deadlock, VirtualTimeLoop


class _PlainLoop(VirtualTimeLoop):
    """The same virtual clock with asyncio's own timer heap, run loop, sleep and call_soon."""

    call_at = base_events.BaseEventLoop.call_at
    _run_once = base_events.BaseEventLoop._run_once

    async def sleep(self, delay: float) -> None:
        await asyncio.sleep(delay)

    def call_soon_in_turn(self, callback: Any, *args: Any, context: Any = None) -> None:
        self.call_soon(callback, *args, context=context)


def _trace(loop_class: type[VirtualTimeLoop], seed: int) -> list[tuple[Any, ...]]:
    """What a random mix of workers, timers (many due at the same instant, some cancelled),
    bursts of deliveries and a failing callback does, in order, with the time of each step."""
    loop = loop_class()
    rng = random.Random(seed)
    seen: list[tuple[Any, ...]] = []

    def note(*what: Any) -> None:
        seen.append((round(loop.time(), 9), *what))

    def deliver(worker: int, n: int) -> None:
        note("deliver", worker, n)
        if n % 7 == 0:
            raise RuntimeError("a failing delivery")  # reported, and the burst goes on
        if n % 3 == 0:  # a delivery that sends on: lands behind everything ready now
            loop.call_soon_in_turn(deliver, worker, n + 1)

    async def worker(w: int) -> None:
        for step in range(12):
            await loop.sleep(rng.choice((0.0, 0.01, 0.01, 0.02, 0.03)))
            note("woke", w, step)
            for _ in range(rng.randrange(4)):
                loop.call_soon_in_turn(deliver, w, rng.randrange(30))
            if rng.random() < 0.3:
                loop.call_soon(note, "soon", w)
            if rng.random() < 0.3:
                timer = loop.call_later(rng.choice((0.01, 0.02)), note, "timer", w)
                if rng.random() < 0.5:
                    timer.cancel()

    async def main() -> None:
        await asyncio.gather(*(worker(w) for w in range(40)))

    loop.set_exception_handler(lambda _loop, context: note("error", str(context["exception"])))
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    return seen


@pytest.mark.parametrize("seed", range(5))
def test_the_shortcuts_keep_asyncio_order(seed: int) -> None:
    fast = _trace(VirtualTimeLoop, seed)
    assert any(event[1] == "error" for event in fast) and any(event[1] == "timer" for event in fast)
    assert fast == _trace(_PlainLoop, seed)


def test_a_burst_shares_one_handle_and_stops_at_the_next_call_soon() -> None:
    loop = VirtualTimeLoop()
    order: list[str] = []
    loop.call_soon_in_turn(order.append, "a")
    loop.call_soon_in_turn(order.append, "b")
    loop.call_soon(order.append, "c")
    loop.call_soon_in_turn(order.append, "d")
    assert len(loop._ready) == 3  # type: ignore[attr-defined]
    loop.run_until_complete(asyncio.sleep(0))
    assert order == ["a", "b", "c", "d"]
    loop.close()


def test_a_cancelled_sleep_leaves_no_timer_behind() -> None:
    loop = VirtualTimeLoop()

    async def main() -> float:
        sleeper = asyncio.ensure_future(loop.sleep(5.0))
        await loop.sleep(1.0)
        sleeper.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sleeper
        await loop.sleep(0.5)
        return loop.time()

    assert loop.run_until_complete(main()) == 1.5  # the clock never jumped to the cancelled 5 s
    loop.close()


def test_nothing_left_to_wake_is_a_deadlock() -> None:
    loop = VirtualTimeLoop()
    with pytest.raises(Deadlock):
        loop.run_until_complete(loop.create_future())
    loop.close()

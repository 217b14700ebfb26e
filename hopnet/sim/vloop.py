"""An asyncio event loop whose clock is virtual.

Nothing here performs I/O: the "selector" never waits. When every task is blocked,
the loop jumps its clock straight to the next scheduled timer (a compute phase
ending, a message arriving over a modelled link). Protocol code written for asyncio
therefore runs unchanged, as fast as the CPU allows, and, because asyncio runs ready
callbacks in FIFO order, identically for the same inputs.

A state in which nothing is ready and no timer is pending is a deadlock; the loop
raises :class:`Deadlock` instead of hanging.

Two things make it cheaper per event than the loop it derives from, without changing
which callback runs when: its timer heap orders plain floats (:class:`_Due`) rather than
timer handles, whose comparison is a Python method (a heap of 10,000 sleeping workers
compares ~15 times per timer), and a burst of in-process deliveries shares one handle
(:meth:`VirtualTimeLoop.call_soon_in_turn`).
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import selectors
from asyncio import base_events
from collections.abc import Callable
from typing import Any, TypeVarTuple, Unpack

from hopnet.errors import HopnetError


_Ts = TypeVarTuple("_Ts")


class Deadlock(HopnetError):
    """Every simulated worker is waiting and nothing is scheduled to wake any of them."""


class _Due(float):
    """A timer's due time, as its heap entry: a float, so the heap compares in C. Floats that
    are equal compare as their timers do (neither is less), so the heap keeps the very order
    a heap of the timer handles would have, ties included."""

    __slots__ = ("timer",)
    timer: asyncio.TimerHandle


def _wake(sleeper: asyncio.Future[None]) -> None:
    if not sleeper.cancelled():
        sleeper.set_result(None)


class _VirtualSelector(selectors.BaseSelector):
    """A selector with nothing to select: ``select(timeout)`` advances virtual time instead."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._loop = loop
        self._map: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, id(fileobj), events, data)
        self._map[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._map.pop(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise Deadlock("simulation deadlocked: every worker is waiting and no event is scheduled")
        if timeout > 0:
            self._loop._now += timeout
        return []

    def close(self) -> None:
        self._map.clear()

    def get_map(self) -> Any:
        return self._map


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """Run with ``loop.run_until_complete(main())``; ``loop.time()`` starts at 0."""

    def __init__(self) -> None:
        self._now = 0.0
        super().__init__(selector=_VirtualSelector(self))
        # asyncio treats timers within clock_resolution of now as due; keep that exact.
        self._clock_resolution = 1e-9
        self._batch: list[tuple[Callable[..., object], tuple[Any, ...]]] = []
        self._batch_handle: asyncio.Handle | None = None
        self._batch_context: contextvars.Context | None = None

    def time(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[[Unpack[_Ts]], object], *args: Unpack[_Ts],
                context: contextvars.Context | None = None) -> asyncio.TimerHandle:
        if when is None:
            raise TypeError("when cannot be None")
        self._check_closed()  # type: ignore[attr-defined]
        if self._debug:  # type: ignore[attr-defined]
            self._check_thread()  # type: ignore[attr-defined]
            self._check_callback(callback, "call_at")  # type: ignore[attr-defined]
        timer = asyncio.TimerHandle(when, callback, args, self, context)
        if timer._source_traceback:  # type: ignore[attr-defined]
            del timer._source_traceback[-1]  # type: ignore[attr-defined]
        due = _Due(when)
        due.timer = timer
        heapq.heappush(self._scheduled, due)  # type: ignore[attr-defined]
        timer._scheduled = True  # type: ignore[attr-defined]
        return timer

    def _run_once(self) -> None:
        """asyncio's ``BaseEventLoop._run_once`` (3.11-3.13) on the heap of :class:`_Due`, with the
        selector's wait inlined: time jumps to the next timer, by the same arithmetic."""
        scheduled: list[_Due] = self._scheduled  # type: ignore[has-type]
        sched_count = len(scheduled)
        if (sched_count > base_events._MIN_SCHEDULED_TIMER_HANDLES  # type: ignore[attr-defined]
                and self._timer_cancelled_count / sched_count  # type: ignore[has-type]
                > base_events._MIN_CANCELLED_TIMER_HANDLES_FRACTION):  # type: ignore[attr-defined]
            kept = []
            for due in scheduled:
                if due.timer._cancelled:  # type: ignore[attr-defined]
                    due.timer._scheduled = False  # type: ignore[attr-defined]
                else:
                    kept.append(due)
            heapq.heapify(kept)
            self._scheduled = scheduled = kept
            self._timer_cancelled_count = 0
        else:
            while scheduled and scheduled[0].timer._cancelled:  # type: ignore[attr-defined]
                self._timer_cancelled_count -= 1
                heapq.heappop(scheduled).timer._scheduled = False  # type: ignore[attr-defined]

        ready = self._ready  # type: ignore[attr-defined]
        if not (ready or self._stopping):  # type: ignore[attr-defined]
            if not scheduled:
                raise Deadlock("simulation deadlocked: every worker is waiting and no event is scheduled")
            longest: float = base_events.MAXIMUM_SELECT_TIMEOUT  # type: ignore[attr-defined]
            timeout = min(max(0, scheduled[0] - self._now), longest)
            if timeout > 0:
                self._now += timeout

        end_time = self._now + self._clock_resolution
        while scheduled:
            if scheduled[0] >= end_time:
                break
            timer = heapq.heappop(scheduled).timer
            timer._scheduled = False  # type: ignore[attr-defined]
            ready.append(timer)

        popleft = ready.popleft
        for _ in range(len(ready)):
            handle = popleft()
            if handle._cancelled:
                continue
            if self._debug:  # type: ignore[attr-defined]
                try:
                    self._current_handle = handle
                    handle._run()
                finally:
                    self._current_handle = None
            else:
                handle._run()

    async def sleep(self, delay: float) -> None:
        """``asyncio.sleep(delay)`` on this loop: the same timer at the same time, so the same order
        of events, with less of asyncio's bookkeeping around it (a simulated compute phase is
        one sleep per worker and iteration)."""
        if delay <= 0:
            await asyncio.sleep(0)
            return
        woken = self.create_future()
        timer = self.call_at(self._now + delay, _wake, woken)
        try:
            await woken
        except BaseException:  # cancelled while asleep: the timer must not fire (asyncio.sleep's finally)
            timer.cancel()
            raise

    def call_soon_in_turn(self, callback: Callable[..., object], *args: Any,
                          context: contextvars.Context | None = None) -> None:
        """Like ``call_soon``, without a handle of its own while the previous call's is still
        last in line: the calls then share one handle, which runs them in order.

        Nothing can run between two handles that are consecutive in the ready queue, and
        what either schedules goes behind both, so the order in which every callback runs
        is that of ``call_soon``; a simulation saves a handle, a loop turn and a context
        switch per message (most messages leave in bursts: a worker's updates to all its
        out-neighbours, every worker entering an iteration at the same virtual instant).
        """
        ready = self._ready  # type: ignore[attr-defined]
        if ready and ready[-1] is self._batch_handle and context is self._batch_context:
            self._batch.append((callback, args))
            return
        self._batch = [(callback, args)]
        self._batch_context = context
        self._batch_handle = self.call_soon(self._run_batch, self._batch, context=context)

    def _run_batch(self, batch: list[tuple[Callable[..., object], tuple[Any, ...]]]) -> None:
        for callback, args in batch:
            try:
                callback(*args)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:  # as asyncio reports an exception in a callback, and goes on
                self.call_exception_handler({"message": f"Exception in callback {callback!r}",
                                             "exception": exc})

    def _make_self_pipe(self) -> None:  # no wake-up pipe: nothing outside can wake this loop
        self._ssock = None
        self._csock = None
        self._internal_fds = 0

    def _close_self_pipe(self) -> None:
        pass

    def _write_to_self(self) -> None:
        pass

    def _process_events(self, event_list: Any) -> None:
        pass

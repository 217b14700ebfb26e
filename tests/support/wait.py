"""Waiting in tests: poll a condition until it holds, or fail saying what never came.

:func:`wait_until` (and :func:`wait_until_async`, for a coroutine test, which sleeps on its event
loop) calls ``condition`` every ``interval`` seconds until it returns something truthy, and
returns that. After ``timeout`` seconds it fails with :class:`WaitTimedOut`, an AssertionError
naming what it waited for, how long, and the condition's last value, or the last exception it
was told to tolerate. A call site that goes on after a timeout catches :class:`WaitTimedOut`.

``while_running`` names the processes that should bring the condition about: once one of them
has ended (and the condition still does not hold), the wait fails at once with its exit code
and whatever it wrote to its pipes.

Time is the wall clock (:func:`time.monotonic`), also in a coroutine test: the conditions watch
sockets, files and processes, which a virtual-time event loop does not speed up.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")

Processes = subprocess.Popen[Any] | Sequence[subprocess.Popen[Any]]
Description = str | Callable[[], str]
"""What is awaited, as a phrase ("rank 1's iteration 5"); a callable is asked when the wait
fails, for a description of the state at that moment."""

DEFAULT_INTERVAL_S = 0.05
SHOWN_CHARS = 2000
"""The last value is shown in a failure up to this many characters."""


class WaitTimedOut(AssertionError):
    """The condition did not hold within the timeout. ``last`` is its last value; ``error`` the
    last exception it raised of those tolerated, when its last call raised one."""

    def __init__(self, message: str, last: object, error: BaseException | None) -> None:
        super().__init__(message)
        self.last = last
        self.error = error


def wait_until(condition: Callable[[], T], timeout: float, *, interval: float = DEFAULT_INTERVAL_S,
               what: Description | None = None, tolerate: tuple[type[Exception], ...] = (),
               while_running: Processes = ()) -> T:
    """Call ``condition`` every ``interval`` s until its value is truthy, and return that value;
    fail with :class:`WaitTimedOut` after ``timeout`` s. An exception of ``tolerate`` that the
    condition raises counts as "not yet"; any other ends the wait."""
    poll = _Poll(condition, timeout, what, tolerate, while_running)
    while not poll.done():
        time.sleep(interval)
    return poll.value


async def wait_until_async(condition: Callable[[], T], timeout: float, *, interval: float = DEFAULT_INTERVAL_S,
                           what: Description | None = None, tolerate: tuple[type[Exception], ...] = (),
                           while_running: Processes = ()) -> T:
    """:func:`wait_until` for a coroutine: the event loop runs between the calls of ``condition``."""
    poll = _Poll(condition, timeout, what, tolerate, while_running)
    while not poll.done():
        await asyncio.sleep(interval)
    return poll.value


class _Poll(Generic[T]):
    """One wait: each :meth:`done` calls the condition once and fails the wait when it is over."""

    def __init__(self, condition: Callable[[], T], timeout: float, what: Description | None,
                 tolerate: tuple[type[Exception], ...], while_running: Processes) -> None:
        self.condition = condition
        self.timeout = timeout
        self.what = what
        self.tolerate = tolerate
        self.procs = [while_running] if isinstance(while_running, subprocess.Popen) else list(while_running)
        self.started = time.monotonic()
        self.last: object = None
        self.error: Exception | None = None
        self.value: T  # once the condition holds

    def done(self) -> bool:
        try:
            value = self.condition()
        except self.tolerate as exc:
            self.error = exc
        else:
            self.last, self.error = value, None
            if value:
                self.value = value
                return True
        self._fail_if_a_process_ended()
        if time.monotonic() - self.started > self.timeout:
            self._time_out()
        return False

    def _fail_if_a_process_ended(self) -> None:
        for proc in self.procs:
            if proc.poll() is not None:
                out, err = proc.communicate()
                streams = "".join(f"\n--- its {name}:\n{text}" for name, text in (("stdout", out), ("stderr", err))
                                  if text is not None)
                raise AssertionError(f"process {proc.pid} ended (exit code {proc.returncode}) before "
                                     f"{self._description()}{streams}")

    def _time_out(self) -> None:
        seen = (f"its last error: {self.error!r}" if self.error is not None
                else f"its last value: {_shown(self.last)}")
        raise WaitTimedOut(f"timed out after {self.timeout:g}s waiting for {self._description()}; {seen}",
                           self.last, self.error) from self.error

    def _description(self) -> str:
        if callable(self.what):
            return self.what()
        if self.what is not None:
            return self.what
        name = getattr(self.condition, "__name__", "<lambda>")
        return "the condition" if name == "<lambda>" else f"{name}()"


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + f"... ({len(text)} characters)"

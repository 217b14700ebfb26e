"""support.wait: the tests' one way to wait for a condition."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from support.wait import WaitTimedOut, wait_until, wait_until_async


def _true_after(calls: int):
    """A condition whose value is falsy for its first ``calls - 1`` calls, then ``"ready"``."""
    made = []

    def condition() -> str:
        made.append(None)
        return "ready" if len(made) >= calls else ""
    condition.calls = made  # type: ignore[attr-defined]
    return condition


def test_it_waits_for_the_condition_and_returns_its_value() -> None:
    condition = _true_after(4)
    assert wait_until(condition, 10, interval=0.001, what="the fourth call") == "ready"
    assert len(condition.calls) == 4


def test_a_condition_that_holds_at_once_is_called_once_and_not_slept_on() -> None:
    started = time.monotonic()
    assert wait_until(lambda: [1], 10, interval=5) == [1]
    assert time.monotonic() - started < 1


def test_a_timeout_names_what_was_awaited_how_long_and_the_last_value() -> None:
    started = time.monotonic()
    with pytest.raises(WaitTimedOut, match=r"timed out after 0.2s waiting for rank 3's iteration 7; "
                                           r"its last value: \[\]") as info:
        wait_until(lambda: [], 0.2, interval=0.01, what="rank 3's iteration 7")
    assert time.monotonic() - started >= 0.2
    assert isinstance(info.value, AssertionError) and info.value.last == []


def test_a_described_wait_is_described_when_it_fails() -> None:
    seen = [0]

    def condition() -> bool:
        seen[0] += 1
        return False
    with pytest.raises(WaitTimedOut, match=r"waiting for all of 10 after \d+ calls"):
        wait_until(condition, 0.05, interval=0.01, what=lambda: f"all of 10 after {seen[0]} calls")


def test_a_tolerated_exception_means_not_yet_and_is_shown_if_it_was_the_last() -> None:
    calls = []

    def flaky() -> int:
        calls.append(None)
        if len(calls) < 3:
            raise ValueError("torn line")
        return len(calls)
    assert wait_until(flaky, 10, interval=0.001, tolerate=(ValueError,)) == 3

    def broken() -> int:
        raise ValueError("torn line")
    expected = r"waiting for broken\(\); its last error: ValueError\('torn line'\)"
    with pytest.raises(WaitTimedOut, match=expected) as info:
        wait_until(broken, 0.05, interval=0.01, tolerate=(ValueError,))
    assert isinstance(info.value.__cause__, ValueError)


def test_an_exception_not_tolerated_ends_the_wait() -> None:
    def broken() -> int:
        raise KeyError("no")
    with pytest.raises(KeyError):
        wait_until(broken, 10, tolerate=(ValueError,))


def test_a_process_that_ends_before_the_condition_fails_the_wait_at_once_with_its_output() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import sys; print('bye'); sys.exit(3)"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)ended \(exit code 3\) before the file.*stdout:\nbye") as info:
        wait_until(lambda: False, 60, what="the file", while_running=proc)
    assert not isinstance(info.value, WaitTimedOut)
    assert time.monotonic() - started < 30


def test_a_condition_that_holds_when_the_process_ended_still_counts() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert wait_until(lambda: "done", 1, while_running=[proc]) == "done"


async def test_the_async_twin_lets_the_loop_run_between_calls() -> None:
    import asyncio

    flag = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, flag.set)
    assert await wait_until_async(flag.is_set, 10, interval=0.01, what="the flag") is True
    with pytest.raises(WaitTimedOut, match="waiting for the other flag; its last value: False"):
        await wait_until_async(asyncio.Event().is_set, 0.05, interval=0.01, what="the other flag")


def test_wait_gone_names_the_processes_still_running() -> None:
    from support.processes import wait_gone

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ended.wait()
        wait_gone([ended.pid], 1)
        with pytest.raises(WaitTimedOut, match=rf"processes \[{ended.pid}, {sleeper.pid}\] to end "
                                               rf"\(\[{sleeper.pid}\] still running\)"):
            wait_gone([ended.pid, sleeper.pid], 0.1)
    finally:
        sleeper.kill()
        sleeper.wait()

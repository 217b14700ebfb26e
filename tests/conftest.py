"""Fixtures shared by the test modules; the helpers themselves live in tests/support/."""

from __future__ import annotations

import compileall
import contextlib
import os

import pytest
import torch

from support.launch import run_launch
from support.paths import ROOT
from support.template import TEMPLATE_VAR, forkserver_template, session_template_env, use_template, wait_for_template

# Tests run several ranks as threads of one process (support/threaded.py); intra-op threads would
# only spin against them for the cores (the launcher gives its workers one thread each when they
# outnumber the cores, for the same reason). Processes that a test starts choose their own.
torch.set_num_threads(1)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: two test processes per core. Most of a multi-process test is spent waiting (on
    timeouts, on peers, on a sleep standing in for compute: 41% of the test processes' time), so
    fewer left the cores idle: on 2 cores the whole suite took 480 s with 3 processes, 463 s with 4
    (826 and 849 CPU-s)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores * 2)


def pytest_configure(config: pytest.Config) -> None:
    """The session's template, started once by the process that runs the session (xdist's
    controller, or the only test process) before the test processes start: they inherit its path
    in their environment (:func:`support.template.use_template`)."""
    if hasattr(config, "workerinput"):
        return
    _compile_sources()
    stack = contextlib.ExitStack()
    use_template(stack.enter_context(forkserver_template(session_template_env(config), wait=False)))
    config.stash[_TEMPLATE] = stack


def _compile_sources() -> None:
    """Byte-compile what the suite's processes import, once (where ``PYTHONDONTWRITEBYTECODE`` is set,
    as on this project's machines, nothing else writes it): each of the few hundred launchers,
    workers and scripts the suite starts with ``exec`` would compile hopnet again, about 0.2 CPU-s
    apiece. What is already compiled and unchanged is only looked at."""
    for directory in ("hopnet", "examples", "bench", "tests/support", "tests/workers", "tests/scripts"):
        compileall.compile_dir(ROOT / directory, quiet=1)


def pytest_unconfigure(config: pytest.Config) -> None:
    stack = config.stash.get(_TEMPLATE, None)
    if stack is not None:
        stack.close()


_TEMPLATE = pytest.StashKey[contextlib.ExitStack]()


@pytest.fixture(scope="session", autouse=True)
def warm_fork_servers() -> None:
    """A test process's first test waits until the session's template listens (its imports
    overlap the test processes' start and collection)."""
    path = os.environ.get(TEMPLATE_VAR)
    if path:
        wait_for_template(path)


@pytest.fixture
def launch():
    """`hopnet launch ARGS` run to its end as a user runs it (:func:`support.launch.run_launch`)."""
    return run_launch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow tests first (in their order), the quick ones after: the two test processes then end
    on quick tests, and neither waits alone for a long one started last."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)

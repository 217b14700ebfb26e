"""Fixtures shared by the test modules; the helpers themselves live in tests/support/."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from support.env import clean_env
from support.launch import run_launch
from support.template import forkserver_template, use_template

# Tests run several ranks as threads of one process (support/threaded.py); intra-op threads would
# only spin against them for the cores (the launcher gives its workers one thread each when they
# outnumber the cores, for the same reason). Processes that a test starts choose their own.
torch.set_num_threads(1)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one and a half test processes per core. Most of a multi-process test is spent
    waiting (on timeouts, on peers, on a sleep standing in for compute), so one per core left the
    cores a third idle: on 2 cores the suite took 444 s with 2 processes, 373 s with 3."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores * 3 // 2)


TEMPLATE_FRAMEWORKS = "lightning,transformers,accelerate"
"""What the template imports besides torch and hopnet (one that is not installed is skipped): a
launch of a script that imports Lightning then costs 0.9 CPU-s instead of 3.1 (2 workers, 5 steps),
because its fork server no longer imports Lightning itself. The launcher's own preload of what a
script imports is tested without a template (test_preload.py)."""


@pytest.fixture(scope="session", autouse=True)
def warm_fork_servers(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every launch of this test process forks its fork server from one warm template (with the
    frameworks only where slow tests, which launch the adapters' scripts, were selected: the quick
    tier would wait for their imports for nothing)."""
    slow = any(item.get_closest_marker("slow") for item in request.session.items)
    with forkserver_template(clean_env(HOPNET_PRELOAD=TEMPLATE_FRAMEWORKS if slow else "none")) as path:
        use_template(path)
        yield


@pytest.fixture
def launch():
    """`hopnet launch ARGS` run to its end as a user runs it (:func:`support.launch.run_launch`)."""
    return run_launch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow tests first (in their order), the quick ones after: the two test processes then end
    on quick tests, and neither waits alone for a long one started last."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)

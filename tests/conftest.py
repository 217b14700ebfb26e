"""Fixtures shared by the test modules; the helpers themselves live in tests/support/."""

from __future__ import annotations

import pytest

from support.launch import run_launch


@pytest.fixture
def launch():
    """`hopnet launch ARGS` run to its end as a user runs it (:func:`support.launch.run_launch`)."""
    return run_launch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow tests first (in their order), the quick ones after: the two test processes then end
    on quick tests, and neither waits alone for a long one started last."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)

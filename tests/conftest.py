"""Fixtures shared by the test modules; the helpers themselves live in tests/support/."""

from __future__ import annotations

import pytest

from support.launch import run_launch


@pytest.fixture
def launch():
    """`hopnet launch ARGS` run to its end as a user runs it (:func:`support.launch.run_launch`)."""
    return run_launch

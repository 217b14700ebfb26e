"""The transport conformance checks (tests/support/transport_checks.py), on every transport."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from support.transport_checks import CHECKS, KINDS, Ends, connected


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
async def test_transport_conformance(kind: str, check: Callable[[Ends], Awaitable[None]]) -> None:
    async with connected(kind) as ends:
        await check(ends)

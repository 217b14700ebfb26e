"""A gate for the elastic adapter tests: the first workers of a run wait at one step until the
worker that `hopnet join` starts has reached ``hopnet.init`` (its event log exists), so that a
cold joiner (a fresh interpreter, torch and the framework to import) gets in while the run
trains, however fast the first workers go. Only the test scripts use it; it changes nothing else.

The gate step and the joiner's rank come from ``GATE_AT_STEP`` and ``GATE_FOR_RANK``; without
them, no worker waits."""

from __future__ import annotations

import os
import time
from pathlib import Path

GATE_TIMEOUT_S = 120.0


def wait_for_the_joiner(step: int) -> None:
    """At ``step``, in a worker of the first view: wait until the joiner's event log exists."""
    at, joiner = os.environ.get("GATE_AT_STEP"), os.environ.get("GATE_FOR_RANK")
    rank = int(os.environ.get("HOPNET_RANK", "0"))
    if at is None or joiner is None or step != int(at) or rank >= int(joiner):
        return
    log = Path(os.environ["HOPNET_RUN_DIR"]) / f"rank{joiner}.jsonl"
    deadline = time.monotonic() + GATE_TIMEOUT_S
    while not log.exists() and time.monotonic() < deadline:
        time.sleep(0.05)

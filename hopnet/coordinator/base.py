"""The contract every coordinator state machine meets."""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hopnet.errors import HopnetError


class BadCoordinatorMessage(HopnetError):
    """A message a coordinator cannot act on (unknown kind, missing or ill-typed field).

    The host drops it and counts it; the state machine's state is unchanged."""


@dataclass(frozen=True)
class Send:
    """One message for one worker.

    ``message`` is a small dict of plain values (ints, floats, strings, lists of them),
    so it packs with msgpack in a few bytes; its ``"t"`` key names the kind."""

    to: int
    message: dict[str, Any]


class Coordinator(abc.ABC):
    """A sans-IO state machine serving the workers ``0 .. world_size - 1``.

    Its host (a ZeroMQ service process, or the simulator) calls :meth:`on_message` for each
    message in arrival order, sends what it returns in list order, and never calls it from
    two threads at once. The machine keeps no socket, no clock and no randomness beyond a
    ``random.Random`` seeded from the run's seed, so a run is reproducible in the simulator.
    """

    name: str = "coordinator"

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"a coordinator needs at least one worker (got {world_size})")
        self.world_size = world_size

    @abc.abstractmethod
    def on_message(self, sender: int, message: Mapping[str, Any]) -> list[Send]:
        """React to ``message`` from worker ``sender``; the messages to send now.

        Raises :class:`BadCoordinatorMessage` for a message it cannot act on."""

    def on_worker_gone(self, rank: int) -> list[Send]:
        """Worker ``rank`` left or died: forget its pending requests; the messages to send now."""
        return []

    def on_worker_rejoined(self, rank: int) -> list[Send]:
        """A new process replaced worker ``rank``, which was gone (``--max-restarts``): count it in
        again; the messages to send now."""
        return []

    def summary(self) -> dict[str, Any]:
        """End-of-run counters for the coordinator's record (groups formed, waits, repairs...)."""
        return {}

    def check_sender(self, sender: int) -> None:
        if not isinstance(sender, int) or isinstance(sender, bool) or not 0 <= sender < self.world_size:
            raise BadCoordinatorMessage(f"{self.name}: sender {sender!r} is not a worker rank "
                                        f"(0..{self.world_size - 1})")

"""The coordinator on the simulator's virtual loop: same state machine, same host, same client.

:class:`SimCoordinator` runs a :class:`~hopnet.coordinator.host.CoordinatorHost` inside the
simulated run; each worker's :class:`~hopnet.coordinator.client.CoordinatorClient` talks to
it through a :class:`SimLink`. A message takes the link model's latency (and its encoded
size over the bandwidth) each way, charged on the link between the worker and a
pseudo-rank for the coordinator (:data:`COORDINATOR_RANK`, so ``LinkModel.overrides`` may
name it). Messages on one direction of one link keep their order, and everything is
driven by the virtual loop's timers, so a run is as deterministic as the rest of the
simulator. Messages go through the wire encoding both ways, so a state machine that
returns something msgpack cannot carry fails here as it would under ``hopnet launch``.
Simulated workers never die unannounced (they leave with ``bye``): no heartbeats.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping
from typing import Any

from hopnet.coordinator.base import Coordinator, Send
from hopnet.coordinator.client import CoordinatorClient, CoordinatorLink, Deliver
from hopnet.coordinator.host import CoordinatorHost
from hopnet.coordinator.wire import decode, encode
from hopnet.transports.inproc import LinkModel

COORDINATOR_RANK = -1
"""The coordinator's end of its links in :class:`LinkModel` (``overrides[(rank, -1)]``)."""


class SimCoordinator:
    """One coordinator for one simulated run; :meth:`client` for each worker."""

    def __init__(self, machine: Coordinator, link: LinkModel | None = None, *, keep_events: bool = False) -> None:
        self.link_model = link if link is not None else LinkModel()
        self.records: list[dict[str, Any]] = []
        self._keep = keep_events
        self.host = CoordinatorHost(machine, now=0.0, record=self._record)
        self._links: dict[int, SimLink] = {}
        self._queues: dict[tuple[int, int], deque[tuple[int, bytes]]] = {}

    def client(self, rank: int, name: str | None = None) -> CoordinatorClient:
        link = SimLink(self, rank)
        self._links[rank] = link
        return CoordinatorClient(link, name=name or self.host.machine.name)

    # ------------------------------------------------------------------ moving messages
    def _post(self, src: int, dst: int, payload: bytes) -> None:
        loop = asyncio.get_running_loop()
        latency, bandwidth = self.link_model.params(src, dst)
        delay = latency + (len(payload) / bandwidth if bandwidth > 0 else 0.0)
        queue = self._queues.setdefault((src, dst), deque())
        queue.append((src, payload))
        loop.call_later(delay, self._arrive, (src, dst))

    def _arrive(self, key: tuple[int, int]) -> None:
        src, payload = self._queues[key].popleft()  # the oldest on this link: FIFO whatever the timer order
        dst = key[1]
        message = decode(payload)
        if dst == COORDINATOR_RANK:
            now = asyncio.get_running_loop().time()
            self._send(self.host.handle(src, message, now))
        else:
            link = self._links.get(dst)
            if link is not None:
                link.arrive(message)

    def _send(self, sends: list[Send]) -> None:
        for send in sends:
            self._post(COORDINATOR_RANK, send.to, encode(send.message))

    def _record(self, event: str, **fields: Any) -> None:
        if self._keep:
            loop = asyncio.get_running_loop()
            self.records.append({"event": event, "rank": None, "role": "coordinator", "t": loop.time(), **fields})

    def summary(self) -> dict[str, Any]:
        return self.host.summary()


class SimLink(CoordinatorLink):
    can_die = False
    address = "in-process (simulated)"

    def __init__(self, coordinator: SimCoordinator, rank: int) -> None:
        self.coordinator = coordinator
        self.rank = rank
        self._deliver: Deliver | None = None
        self._closed = False

    def start(self, deliver: Deliver) -> None:
        self._deliver = deliver

    def send(self, message: Mapping[str, Any]) -> None:
        if not self._closed:
            self.coordinator._post(self.rank, COORDINATOR_RANK, encode(message))

    def arrive(self, message: dict[str, Any]) -> None:
        if self._deliver is not None and not self._closed:
            self._deliver(message)

    def close(self) -> None:
        self._closed = True

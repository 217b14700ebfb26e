"""One replica, one voice to the coordinator: member 0 speaks, the other members hear what it hears.

A coordinator protocol (Prague's Group Generators, Partial Reduce's controller) decides for a
worker: which group it joins, with what weights, when. Between replica groups the coordinator's
workers are the replicas, and each replica must act on one decision in all its lanes. So only
member 0's lane talks to the coordinator (:class:`LeaderLink` around its ZeroMQ link); every
message the coordinator sends it is passed on, in order, to the replica's other members over
their gloo agreement group (two point-to-point sends: the length, then the msgpack bytes).
Their lanes' clients read from a :class:`FollowerLink`, which sends nothing: their ``ready``, acks
and goodbyes would be member 0's again. Each lane then runs the group it was given among the same
member of the other replicas, on its own shard.

The coordinator's notices travel the same way (``peer_dead``, ``peer_failed``), so every lane
learns of a lost replica at once. A member 0 that dies ends its followers' wait with
:class:`~hopnet.coordinator.client.CoordinatorLost`; under ``hopnet launch`` its replica is
stopped as a unit first.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch

from hopnet.coordinator.client import CoordinatorClient, CoordinatorLink, CoordinatorLost, Deliver
from hopnet.coordinator.wire import PONG, BadFrame, decode, encode

LENGTH_TAG = 7301
PAYLOAD_TAG = 7302
END = -1
"""In place of a length: member 0 closed, nothing more comes (the follower's thread ends)."""
CLOSE_WAIT_S = 10.0
"""How long member 0 waits, when it closes, for its last messages to reach its followers, and a
follower for member 0's end."""


class LeaderLink(CoordinatorLink):
    """Member 0's link: ``inner`` (its ZeroMQ link), each message it delivers passed on to the followers."""

    def __init__(self, inner: CoordinatorLink, group: Any, followers: range) -> None:
        self.inner = inner
        self.group = group
        self.followers = followers
        self.can_die = inner.can_die
        self.address = inner.address
        self.relayed = 0
        self._pending: list[tuple[Any, torch.Tensor]] = []

    def start(self, deliver: Deliver) -> None:
        def relay_then_deliver(message: dict[str, Any]) -> None:
            if message.get("t") != PONG:
                self._relay(message)
            deliver(message)

        self.inner.start(relay_then_deliver)

    def _relay(self, message: Mapping[str, Any]) -> None:
        payload = encode(message)
        length = torch.tensor([len(payload)], dtype=torch.int64)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self._pending = [(work, kept) for work, kept in self._pending if not work.is_completed()]
        for follower in self.followers:
            self._pending.append((self.group.send([length], follower, LENGTH_TAG), length))
            self._pending.append((self.group.send([data], follower, PAYLOAD_TAG), data))
        self.relayed += 1

    def send(self, message: Mapping[str, Any]) -> None:
        self.inner.send(message)

    def close(self) -> None:
        self.inner.close()
        end = torch.tensor([END], dtype=torch.int64)
        for follower in self.followers:
            self._pending.append((self.group.send([end], follower, LENGTH_TAG), end))
        for work, _ in self._pending:
            try:
                work.wait(timedelta(seconds=CLOSE_WAIT_S))
            except RuntimeError:
                break  # a follower already gone: its replica is ending
        self._pending.clear()


class FollowerLink(CoordinatorLink):
    """A follower's link: what member 0 heard, received on a thread of its own; sends go nowhere."""

    can_die = False  # member 0 is watched as the replica's member, not as a coordinator

    def __init__(self, group: Any, address: str, replica: int) -> None:
        self.group = group
        self.address = f"{address}, through member 0 of replica {replica}"
        self.replica = replica
        self.lost: Any = None
        """Called on the loop with the error when member 0 can no longer pass messages on."""
        self._closed = False
        self._thread: threading.Thread | None = None

    def start(self, deliver: Deliver) -> None:
        loop = asyncio.get_running_loop()

        def receive() -> None:
            while True:
                try:
                    length = torch.zeros(1, dtype=torch.int64)
                    self.group.recv([length], 0, LENGTH_TAG).wait()
                    if int(length[0]) == END:
                        return
                    data = torch.empty(int(length[0]), dtype=torch.uint8)
                    self.group.recv([data], 0, PAYLOAD_TAG).wait()
                    message = decode(data.numpy().tobytes())
                except (RuntimeError, BadFrame) as exc:
                    if not self._closed:
                        loop.call_soon_threadsafe(self._lose, exc)
                    return
                if not self._closed:  # (once closed it only drains what member 0 still sends, up to the end)
                    loop.call_soon_threadsafe(deliver, message)

        # A daemon: a receive still blocked when the process ends (member 0 died) must not hold its exit.
        self._thread = threading.Thread(target=receive, name=f"hopnet-replica{self.replica}-coordinator",
                                        daemon=True)
        self._thread.start()

    def _lose(self, exc: BaseException) -> None:
        if self.lost is not None and not self._closed:
            self.lost(CoordinatorLost(f"member 0 of replica {self.replica}, which speaks to the coordinator "
                                      f"for it, is gone: {str(exc).splitlines()[0] if str(exc) else exc!r}"))

    def send(self, message: Mapping[str, Any]) -> None:
        pass

    def close(self) -> None:
        """Wait (a bounded time) for member 0's end: a thread still blocked in gloo's receive when the
        interpreter exits (a script under torchrun ends that way) aborts the process with
        std::terminate."""
        self._closed = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(CLOSE_WAIT_S)


def relayed_client(client: CoordinatorClient | None, group: Any, member: int, size: int,
                   replica: int) -> CoordinatorClient | None:
    """This member's coordinator client in a replica of ``size``: member 0's relays, the others follow."""
    if client is None or size == 1:
        return client
    if member == 0:
        client.link = LeaderLink(client.link, group, range(1, size))
        return client
    link = FollowerLink(group, client.link.address, replica)
    follower = CoordinatorClient(link, name=client.name)
    link.lost = follower.fail
    return follower


__all__ = ["FollowerLink", "LeaderLink", "relayed_client"]

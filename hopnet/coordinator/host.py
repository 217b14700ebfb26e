"""What every coordinator host does around its state machine, written once.

:class:`CoordinatorHost` is still sans-IO: the ZeroMQ service (:mod:`.server`) and the
simulator (:mod:`.sim`) feed it decoded messages and the time, and send what it returns.
Around the :class:`~hopnet.coordinator.base.Coordinator` it

* answers the host kinds (:data:`hopnet.coordinator.wire.HOST_KINDS`): ``ping`` with
  ``pong``; ``bye`` by calling ``on_worker_gone`` and then answering ``bye_ok``, so the
  leaving worker knows that every group it was put in has reached it (a ``bye`` marked
  ``failed`` also sends every other worker ``peer_failed``); a message carrying
  ``"sync": ID`` is passed on without that key and answered, after everything the machine
  sent in reply to it, by ``{"t": "synced", "id": ID}``;
* drops and counts what it cannot act on: bad frames (counted by the caller),
  :class:`~hopnet.coordinator.base.BadCoordinatorMessage` from the machine, messages
  from workers that left or were declared dead;
* watches the workers that said ``hello`` (with heartbeats, when ``peer_timeout_s`` is
  given): one silent for ``peer_timeout_s`` is declared dead, the machine is told
  (``on_worker_gone``) and every other worker gets ``peer_dead`` so that a group waiting
  on it fails at once, naming it;
* writes its event log: ``start``, ``group`` (each group the machine formed, once),
  ``worker_joined``, ``worker_left``, ``worker_dead``, and ``stop`` with the machine's
  summary and the host's counters.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from hopnet.coordinator.base import BadCoordinatorMessage, Coordinator, Send
from hopnet.coordinator.wire import (BYE, BYE_OK, EXPELLED, HELLO, HOST_KINDS, PEER_DEAD, PEER_FAILED, PING, PONG,
                                     REJOIN, SYNC,
                                     SYNCED)
from hopnet.runtime.liveness import Liveness

Recorder = Callable[..., None]
"""``record(event, **fields)``: writes one record of the coordinator's event log."""


def _no_record(event: str, **fields: Any) -> None:
    pass


class CoordinatorHost:
    """One coordinator state machine, its liveness watch and its bookkeeping."""

    def __init__(self, machine: Coordinator, *, now: float, peer_timeout_s: float | None = None,
                 record: Recorder = _no_record) -> None:
        self.machine = machine
        self.world_size = machine.world_size
        self.record = record
        self.dropped: Counter[str] = Counter()
        self.joined: set[int] = set()
        self.left: set[int] = set()
        self.dead: set[int] = set()
        self.messages_in = 0
        self.messages_out = 0
        self.groups_logged = 0
        self._logged_gids: set[Any] = set()
        self._dead_why: dict[int, str] = {}
        self.restarts: dict[int, int] = {}  # rank -> the restart number of its worker now (0: the first)
        self.liveness = (Liveness((), timeout_s=peer_timeout_s, now=now)
                         if peer_timeout_s is not None else None)

    # ------------------------------------------------------------------ inbound
    def drop(self, reason: str) -> None:
        self.dropped[reason] += 1

    def handle(self, sender: int, message: Mapping[str, Any], now: float) -> list[Send]:
        """React to one decoded message from worker ``sender``; the messages to send now."""
        self.messages_in += 1
        restart = message.get("restart") if message.get("t") == HELLO else None
        readmitted: list[Send] = []
        if isinstance(restart, int) and restart > self.restarts.get(sender, 0):
            readmitted = self._readmit(sender, restart, now)
        if sender in self.left or sender in self.dead:
            self.drop("from_gone_worker")
            if sender in self.dead and message.get("t") != BYE:  # it was silent, not gone: say so
                self.messages_out += 1
                return [Send(sender, {"t": EXPELLED, "why": self._dead_why.get(sender, "")})]
            return []
        if self.liveness is not None:
            self.liveness.heard(sender, now)
        kind = message.get("t")
        if sender not in self.joined:
            self.joined.add(sender)
            if self.liveness is not None:
                self.liveness.watch(sender, now)
            self.record("worker_joined", worker=sender)
        if kind in HOST_KINDS:
            if readmitted:
                return self._out(readmitted)
            if kind == REJOIN:
                self.record("worker_rejoined", worker=sender, restart=self.restarts.get(sender, 0))
                return self._out(list(self.machine.on_worker_rejoined(sender)))
            if kind == PING:
                return self._out([Send(sender, {"t": PONG})])
            if kind == BYE:
                how = "failed" if message.get("failed") is True else "left"
                sends = self._out(self._gone(sender, how))
                self.messages_out += 1
                return sends + [Send(sender, {"t": BYE_OK})]  # after every group sent to it before
            return []  # hello, beat: signs of life only
        synced = message.get(SYNC)
        if synced is not None:  # the host's part: answer after what the machine sends for this message
            message = {k: v for k, v in message.items() if k != SYNC}
        try:
            sends = self.machine.on_message(sender, message)
        except BadCoordinatorMessage as exc:
            self.drop("bad_message")
            if self.dropped["bad_message"] <= 20:  # enough to debug, not a log flood
                self.record("bad_message", worker=sender, kind=str(kind)[:40], why=str(exc)[:200])
            return []
        sends = self._out(sends)
        if synced is not None:
            self.messages_out += 1
            sends.append(Send(sender, {"t": SYNCED, "id": synced}))
        return sends

    def _readmit(self, rank: int, restart: int, now: float) -> list[Send]:
        """A replacement of worker ``rank`` said hello (``--max-restarts``): end its predecessor here if
        that had not happened yet, and watch the new process. The machine takes the rank back at its
        ``rejoin``, once it holds a neighbour's state (until then it could only hold up groups)."""
        sends: list[Send] = []
        if rank in self.joined and rank not in self.left and rank not in self.dead:
            sends += self._gone(rank, "dead", self.liveness.silence(rank, now) if self.liveness is not None else 0.0)
        self.restarts[rank] = restart
        self.left.discard(rank)
        self.dead.discard(rank)
        self._dead_why.pop(rank, None)
        self.joined.add(rank)
        if self.liveness is not None:
            self.liveness.watch(rank, now)
        self.record("worker_replaced", worker=rank, restart=restart)
        return sends

    # ------------------------------------------------------------------ liveness
    def check(self, now: float) -> list[Send]:
        """Declare silent workers dead; the messages to send now."""
        if self.liveness is None:
            return []
        sends: list[Send] = []
        for rank, silent_s in self.liveness.silent_peers(now):
            sends += self._gone(rank, "dead", silent_s)
        return self._out(sends)

    def next_check(self, now: float) -> float:
        """When :meth:`check` next has something to do (``inf``: never)."""
        return math.inf if self.liveness is None else self.liveness.next_silence(now)

    def _gone(self, rank: int, how: str, silent_s: float | None = None) -> list[Send]:
        if rank in self.left or rank in self.dead:
            return []
        if self.liveness is not None:
            self.liveness.forget(rank)
        if how in ("left", "failed"):
            self.left.add(rank)
            self.record("worker_left", worker=rank, failed=how == "failed")
        else:
            self.dead.add(rank)
            self._dead_why[rank] = f"it was silent for {silent_s or 0.0:.1f}s and was declared dead"
            self.record("worker_dead", worker=rank, silent_s=round(silent_s or 0.0, 3))
        sends = list(self.machine.on_worker_gone(rank))
        # A worker that left cleanly is waited on by no one (it ran its groups before its bye);
        # telling the others could overtake its last messages to them. One that died or is
        # failing may be waited on: whatever waits on it must fail now, naming it.
        notice = ({"t": PEER_DEAD, "rank": rank, "silent_s": round(silent_s or 0.0, 3)} if how == "dead"
                  else {"t": PEER_FAILED, "rank": rank} if how == "failed" else None)
        if notice is not None and self.restarts.get(rank):
            # which process of the rank it is about: a worker that took a later one back ignores it
            notice["restart"] = self.restarts[rank]
        if notice is not None:
            sends += [Send(r, dict(notice)) for r in sorted(self.joined - self.left - self.dead)]
        return sends

    # ------------------------------------------------------------------ outbound
    def _out(self, sends: list[Send]) -> list[Send]:
        kept = []
        for send in sends:
            if send.to in self.left or send.to in self.dead:
                self.drop("to_gone_worker")
                continue
            kept.append(send)
            message = send.message
            gid = message.get("gid")
            members = message.get("members")
            if gid is not None and isinstance(members, list) and any(self.restarts.get(m, 0) for m in members):
                # which process of each member the group is for: a worker that has taken a later one
                # back runs none of it (the earlier process is gone, the later one was never told)
                message["restarts"] = [self.restarts.get(m, 0) for m in members]
            if gid is not None and members is not None and gid not in self._logged_gids:
                self._logged_gids.add(gid)
                self.groups_logged += 1
                self.record("group", gid=gid, members=list(members),
                            **{k: v for k, v in message.items() if k not in ("t", "gid", "members", "reply", "restarts")})
        self.messages_out += len(kept)
        return kept

    def summary(self) -> dict[str, Any]:
        return {"coordinator": self.machine.name, "groups_formed": self.groups_logged, "messages_in": self.messages_in,
                "messages_out": self.messages_out, "dropped": dict(self.dropped),
                "workers_joined": len(self.joined), "workers_left": sorted(self.left),
                "workers_dead": sorted(self.dead), "workers_restarted": {str(r): n for r, n in sorted(self.restarts.items())},
                **self.machine.summary()}

"""One worker's part in an elastic run, on its event loop: its membership, the control channel it
talks over, and what the members tell each other around a view change (reports, the next
view's addresses, a joiner's state). The worker's thread waits here at its step boundaries
(:mod:`hopnet.elastic.changeover`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hopnet.elastic import codec
from hopnet.elastic.control import ControlChannel
from hopnet.elastic.switch import first_iteration
from hopnet.errors import HopnetError, MembershipStopped, PeerFailure
from hopnet.membership import Commit, Membership, MembershipConfig, Send, View

Recorder = Callable[..., None]


class LeftRun(HopnetError):
    """This worker's leave was committed while it waited (its process then exits 0 with the line)."""


class RunEnded(HopnetError):
    """A joiner's: the run finished before it could enter (its process then exits 0 with the line)."""

TICK_S = 0.02
"""How often the membership looks at the time (it sends only what is due)."""


@dataclass
class ViewEntry:
    """What a member needs to enter a committed view."""

    commit: Commit
    old_members: tuple[int, ...]
    reports: dict[int, int] = field(default_factory=dict)
    segments: dict[int, dict[str, Any]] = field(default_factory=dict)
    cursors: dict[int, dict[str, int]] = field(default_factory=dict)
    coordinator: dict[str, str] | None = None
    """The view's coordinator's ``HOPNET_COORDINATOR*`` variables (protocols that have one)."""
    """Each old member's samplers' cursors at the end of the old view (rank -> name -> cursor)."""
    state: bytes | None = None

    @property
    def number(self) -> int:
        return self.commit.change.view.number

    @property
    def members(self) -> tuple[int, ...]:
        return self.commit.change.view.members

    @property
    def reporters(self) -> list[int]:
        """The old members that go on to the switch (those taken for dead do not)."""
        return [m for m in self.old_members if m not in self.commit.change.died]


def old_members_of(commit: Commit) -> tuple[int, ...]:
    change = commit.change
    old = (set(change.view.members) - set(change.joined)) | set(change.left) | set(change.died)
    return tuple(sorted(old))


class ElasticRun:
    """Membership and view changes of one worker (rank ``rank``), driven on the running loop."""

    def __init__(self, rank: int, channel: ControlChannel, config: MembershipConfig, *,
                 first_view: View | None, contacts: Iterable[int] = (), record: Recorder,
                 iteration: Callable[[], int], timeout_s: float) -> None:
        self.rank = rank
        self.channel = channel
        self.record = record
        self.iteration = iteration
        self.timeout_s = timeout_s
        self.membership = Membership(rank, first_view, config, time.monotonic(), contacts)
        self.who = f"{config.unit} {rank}"
        """How this worker's lines name it (``replica R`` in a run of replica groups)."""
        self.segment_view = first_view.number if first_view is not None else -1
        """The view whose training segment this worker runs (-1: a joiner not yet in one)."""
        self.queue: list[ViewEntry] = []
        """Committed views this worker has not entered yet, oldest first."""
        self._early: dict[int, ViewEntry] = {}
        self._pending_reports: dict[int, dict[int, int]] = {}
        self._pending_segments: dict[int, dict[int, dict[str, Any]]] = {}
        self._pending_cursors: dict[int, dict[int, dict[str, int]]] = {}
        self._pending_coordinators: dict[int, dict[str, str]] = {}
        self._pending_states: dict[int, bytes] = {}
        self._installed = 0
        self._changed = asyncio.Event()
        self._ticker: asyncio.Task[None] | None = None
        self.ended_line: str | None = None
        """A joiner's: the run ended before the view that admitted it began."""
        self.stopped_line: str | None = None
        """Why the membership stopped this worker (cut off, too few members, refused...)."""
        self.left_line: str | None = None
        """Set when this worker asked to leave and the membership then stopped (the run went below --min-nproc)."""
        self.leaving = False
        self._leave_asked = False
        self._over: asyncio.Future[None] | None = None
        """Done once the membership has stopped this worker, or let it leave as the run stopped."""

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._over = asyncio.get_running_loop().create_future()
        self.channel.serve(self._on_control)
        self._ticker = asyncio.get_running_loop().create_task(self._tick(), name=f"rank{self.rank}-membership")

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            try:
                await self._ticker
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        await self.channel.close()

    async def _tick(self) -> None:
        # Often: a tick only sends what is due (a beat, a retry, a proposal whose joiners are gathered).
        period = min(self.membership.config.beat, TICK_S)
        while True:
            self._send(self.membership.tick(time.monotonic()))
            self._after_event()
            await asyncio.sleep(period)

    def leave(self) -> None:
        """A SIGTERM: leave with the next view (on the loop); a joiner not yet admitted asks as
        soon as it is (it enters the view that admits it, then leaves with the next one)."""
        if self.leaving or self.membership.state not in ("member", "joining"):
            return
        self.leaving = True
        self.record("leave_requested", iter=self.iteration())
        self._ask_to_leave()

    def _ask_to_leave(self) -> None:
        if self.leaving and not self._leave_asked and self.membership.state == "member":
            self._leave_asked = True
            self._send(self.membership.leave(time.monotonic()))
            self._after_event()

    # ------------------------------------------------------------------ messages
    def _send(self, sends: list[Send]) -> None:
        for send in sends:
            self.channel.send(send.to, {"t": "m", "body": codec.encode(send.message)})

    def _on_control(self, sender: int, header: dict[str, Any], payload: bytes | None) -> None:
        kind = header.get("t")
        now = time.monotonic()
        if kind == "m":
            message = codec.decode(header.get("body"))
            self._send(self.membership.on_message(sender, message, now))
        else:
            self.membership.heard_from(sender, now)
            view = header.get("view")
            if not isinstance(view, int):
                return
            if kind == "rep" and isinstance(header.get("iter"), int):
                self._pending_reports.setdefault(view, {})[sender] = header["iter"]
            elif kind == "seg":
                self._pending_segments.setdefault(view, {})[sender] = header
            elif kind == "cur" and isinstance(header.get("cursors"), dict):
                self._pending_cursors.setdefault(view, {})[sender] = {str(k): int(v) for k, v
                                                                      in header["cursors"].items()}
            elif kind == "coord" and isinstance(header.get("env"), dict):
                self._pending_coordinators[view] = {str(k): str(v) for k, v in header["env"].items()}
            elif kind == "state" and payload is not None:
                self._pending_states[view] = bytes(payload)
            elif kind == "ended" and self.segment_view < view and self.ended_line is None:
                when = f"the run ended (at iteration {header.get('iter')})"
                self.ended_line = (f"{self.who}: {when} before it was admitted"
                                   if self.membership.state == "joining" else
                                   f"{self.who}: {when} before view {view}, which admitted it, began")
        self._after_event()

    def _after_event(self) -> None:
        """Take in newly installed commits, file what arrived early, wake the waiters."""
        history = self.membership.history
        while self._installed < len(history):
            commit = history[self._installed]
            self._installed += 1
            entry = ViewEntry(commit, old_members_of(commit))
            self.queue.append(entry)
            change = commit.change
            minimum = self.membership.config.min_members
            if self.rank in change.left and len(change.view.members) < minimum and self.left_line is None:
                self.left_line = (f"{self.who} left; view {change.view.number} has {len(change.view.members)} "
                                  f"members, fewer than the minimum {minimum}: the run stops")
            self.record("view_committed", view=change.view.number, members=list(change.view.members),
                        joined=list(change.joined), left=list(change.left), died=list(change.died),
                        refused=list(change.refused), iter=self.iteration(), mono=time.monotonic())
            self._report_if_due()
        for entry in self.queue:
            n = entry.number
            entry.reports.update(self._pending_reports.pop(n, {}))
            entry.segments.update(self._pending_segments.pop(n, {}))
            entry.cursors.update(self._pending_cursors.pop(n, {}))
            if n in self._pending_coordinators:
                entry.coordinator = self._pending_coordinators.pop(n)
            if n in self._pending_states:
                entry.state = self._pending_states.pop(n)
        state = self.membership.state
        if self.leaving and not self._leave_asked and state == "member":  # a joiner SIGTERMed, now admitted
            self._ask_to_leave()
            return
        if state == "stopped" and self.leaving and self.left_line is None:
            # it asked to leave, and the view without it stopped the run (too few members): it left all the same
            self.left_line = self.membership.line or f"{self.who} left"
        elif state == "stopped" and self.stopped_line is None and not self.leaving:
            self.stopped_line = self.membership.line or f"{self.who} was stopped by the membership"
            self.record("membership_stopped", line=self.stopped_line, iter=self.iteration())
        if (self.left_line is not None or self.stopped_line is not None) and self._over is not None \
                and not self._over.done():
            self._over.set_result(None)
        self._changed.set()

    def _report_if_due(self) -> None:
        """Report this member's iteration for the next view it must enter, once it runs the view before."""
        if not self.queue:
            return
        head = self.queue[0]
        if head.commit.view != self.segment_view or self.rank not in head.reporters or self.rank in head.reports:
            return
        here = self.iteration()
        head.reports[self.rank] = here
        for rank in set(head.old_members) | set(head.members):
            if rank != self.rank:
                self.channel.send(rank, {"t": "rep", "view": head.number, "iter": here})

    # ------------------------------------------------------------------ what the worker's thread waits for
    def head(self) -> ViewEntry | None:
        return self.queue[0] if self.queue else None

    async def _wait(self, ready: Callable[[], bool], what: Callable[[], str]) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            if self.left_line is not None:
                raise LeftRun(self.left_line)
            if self.stopped_line is not None:
                raise MembershipStopped(self.stopped_line)
            if self.ended_line is not None:
                raise RunEnded(self.ended_line)
            left = deadline - time.monotonic()
            if left <= 0:
                raise HopnetError(f"{self.who}: {what()} within {self.timeout_s:g}s (--timeout)")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=min(left, 1.0))
            except TimeoutError:
                pass

    async def unless_over(self, step: Coroutine[Any, Any, None]) -> None:
        """Run ``step`` (the node's) unless the membership stops this worker, or lets it leave as the
        run stops, first: then the step is cancelled, and its peers, which stopped too, are not waited
        for until a timeout. Raises :class:`LeftRun` or :class:`~hopnet.errors.MembershipStopped`."""
        running = asyncio.ensure_future(step)
        if self._over is None:
            return await running
        await asyncio.wait((running, self._over), return_when=asyncio.FIRST_COMPLETED)
        if running.done():
            return running.result()
        running.cancel()
        try:
            await running
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - it is over: the line says why
            pass
        if self.left_line is not None:
            raise LeftRun(self.left_line)
        assert self.stopped_line is not None
        raise MembershipStopped(self.stopped_line)

    async def verdict(self, failure: Exception, blamed: int | None = None) -> Exception:
        """A step failed with ``failure``. When the membership stops this worker (cut off from a
        majority, dropped, too few members), that is why: its line, not the segment's. A peer's
        silence fails the step at the segment's peer timeout, before the membership, which takes
        half a peer timeout more to say a member is cut off: so this waits until the membership
        stops this worker or commits a view without that peer, 2 peer timeouts at most (the cut
        off comes 1.5 peer timeouts after the last message heard). ``blamed``: the rank of the
        peer the failure names (a segment names its position)."""
        if self.stopped_line is None and isinstance(failure, PeerFailure) and blamed is not None:
            peer = blamed
            deadline = time.monotonic() + 2 * self.membership.config.peer_timeout
            while (self.stopped_line is None and time.monotonic() < deadline
                   and not any(peer in commit.change.died for commit in self.membership.history)):
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    pass
        if self.stopped_line is None:
            return failure
        return MembershipStopped(self.stopped_line)

    async def first_iteration(self, entry: ViewEntry, safe_point: Callable[[int], int]) -> int:
        """Wait for every report of ``entry`` and return its first iteration."""
        self._report_if_due()

        def missing() -> list[int]:
            return [r for r in entry.reporters if r not in entry.reports]

        await self._wait(lambda: not missing(),
                         lambda: f"view {entry.number}: no report from rank(s) {missing()}")
        return first_iteration(entry.reports, safe_point)

    def announce(self, entry: ViewEntry, header: Mapping[str, Any]) -> None:
        """Tell every member of ``entry``'s view this worker's part of it (its address...)."""
        mine = {**header, "t": "seg", "view": entry.number}
        entry.segments[self.rank] = {**mine, "f": self.rank}
        for rank in set(entry.members) | set(entry.commit.change.left):  # a leaver learns the old view is over
            if rank != self.rank:
                self.channel.send(rank, mine)

    def send_coordinator(self, entry: ViewEntry, env: Mapping[str, str]) -> None:
        """The view's coordinator, which this member hosts, for every member of the view."""
        entry.coordinator = dict(env)
        for rank in entry.members:
            if rank != self.rank:
                self.channel.send(rank, {"t": "coord", "view": entry.number, "env": dict(env)})

    async def coordinator_env(self, entry: ViewEntry) -> dict[str, str]:
        await self._wait(lambda: entry.coordinator is not None,
                         lambda: f"view {entry.number}: no coordinator from rank {entry.members[0]}")
        assert entry.coordinator is not None
        return entry.coordinator

    def send_cursors(self, entry: ViewEntry, cursors: Mapping[str, int]) -> None:
        """An old member's samplers' cursors at the end of its last iteration in the old view, for
        every member of the new one (a member that leaves sends them too)."""
        entry.cursors[self.rank] = dict(cursors)
        for rank in entry.members:
            if rank != self.rank:
                self.channel.send(rank, {"t": "cur", "view": entry.number, "cursors": dict(cursors)})

    async def cursors(self, entry: ViewEntry) -> dict[int, dict[str, int]]:
        """Wait for the cursors of every old member that reported."""
        def missing() -> list[int]:
            return [r for r in entry.reporters if r not in entry.cursors]

        await self._wait(lambda: not missing(),
                         lambda: f"view {entry.number}: no sampler cursors from rank(s) {missing()}")
        return entry.cursors

    async def segments(self, entry: ViewEntry) -> dict[int, dict[str, Any]]:
        """Wait for every member's announcement of ``entry``'s view."""
        def missing() -> list[int]:
            return [r for r in entry.members if r not in entry.segments]

        await self._wait(lambda: not missing(),
                         lambda: f"view {entry.number}: no address from rank(s) {missing()}")
        return entry.segments

    def send_state(self, entry: ViewEntry, joiner: int, payload: bytes) -> None:
        self.channel.send(joiner, {"t": "state", "view": entry.number}, payload)

    async def state(self, entry: ViewEntry, donor: int) -> bytes:
        await self._wait(lambda: entry.state is not None,
                         lambda: f"view {entry.number}: no state from rank {donor}")
        assert entry.state is not None
        return entry.state

    async def admitted(self) -> ViewEntry:
        """A joiner: wait until a view admits it."""
        await self._wait(lambda: bool(self.queue), lambda: f"{self.who} was not admitted to the run")
        return self.queue[0]

    def tell_joiners_the_run_ended(self, iteration: int) -> None:
        """This member finished training: the joiners of views it has not entered, and those whose
        requests no view took in yet, will not get in."""
        told: set[int] = set()
        for entry in self.queue:
            for joiner in entry.commit.change.joined:
                if joiner != self.rank and joiner not in told:
                    told.add(joiner)
                    self.channel.send(joiner, {"t": "ended", "view": entry.number, "iter": iteration})
        view = self.membership.view
        for joiner in self.membership.pending.joins:
            if joiner not in told and view is not None:
                self.channel.send(joiner, {"t": "ended", "view": view.number + 1, "iter": iteration})

    def entered(self, entry: ViewEntry) -> None:
        """This worker now runs ``entry``'s view."""
        if self.queue and self.queue[0] is entry:
            self.queue.pop(0)
        self.segment_view = entry.number
        self._report_if_due()

"""An elastic run of replica groups: the views' members are replicas, and a replica changes views as one.

Member 0 of each replica runs the membership for it (its control channel is registered under the
replica's number, and the views name replicas). The other members run none: at every step
boundary the replica's processes issue one all-reduce over the replica's own group, where member 0
says whether a change is fixed and from which iteration, and any member says that a SIGTERM asked
it to leave (member 0 then asks the membership for the whole replica). It runs during the next
step, and every member reads it at the next boundary; a view of a run of replica groups therefore
begins one iteration later than a single worker's would. When a change is fixed, member 0 hands
the committed view to the others (one ``broadcast_object_list``), so every process ends its lane's
segment after the same iteration and enters the same view.

Each lane then changes segments as a single worker does (:mod:`hopnet.elastic.changeover`), over
the run's c10d store instead of the control channel: member ``m`` of every replica exchanges the
new segment's addresses with member ``m`` of the others, every process publishes its samplers'
cursors (the samplers divide the data among processes), and member ``m`` of a donor replica hands
member ``m`` of a joining replica its state (under fsdp, its shards). See docs/design/replicas.md.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import torch

from hopnet.elastic import codec
from hopnet.elastic.changeover import Changeover, Left
from hopnet.elastic.run import ElasticRun, LeftRun, RunEnded, ViewEntry
from hopnet.errors import HopnetError, MembershipStopped
from hopnet.graph.members import MemberGraph
from hopnet.membership import Commit
from hopnet.rendezvous.store import connect_store, in_namespace
from hopnet.replica.layout import ReplicaLayout

STORE_NAMESPACE = "hopnet/elastic"

NOTHING, FIXED, STOPPED, LEFT, ENDED = range(5)
"""What member 0 tells its replica at a step boundary."""

Decision = tuple[int, "str | None", "ViewEntry | None", "int | None"]
"""What member 0 decided: the code above, its line, the view to enter and the view's first iteration."""
NOTHING_DECIDED: Decision = (NOTHING, None, None, None)


class FollowerRun:
    """A replica member's part in the membership when it is not member 0: none of its own. It holds
    what member 0 handed it, and a SIGTERM's wish to leave (:class:`ReplicaChangeover` passes it on)."""

    def __init__(self, replica: int, record: Callable[..., None], iteration: Callable[[], int]) -> None:
        self.rank = replica
        self.record = record
        self.iteration = iteration
        self.segment_view = 0
        self.leaving = False
        self.left_line: str | None = None
        self.stopped_line: str | None = None

    def start(self) -> None:
        pass

    def leave(self) -> None:
        if not self.leaving:
            self.leaving = True
            self.record("leave_requested", iter=self.iteration())

    async def close(self) -> None:
        pass

    async def unless_over(self, step: Coroutine[Any, Any, None]) -> None:
        await step

    async def verdict(self, failure: Exception, blamed: int | None = None) -> Exception:
        return failure

    def tell_joiners_the_run_ended(self, iteration: int) -> None:
        pass

    def entered(self, entry: ViewEntry) -> None:
        self.segment_view = entry.number


class ViewStore:
    """What a replica's processes exchange around a view change, through the run's c10d store (off
    the event loop: a key another process has not set yet blocks until ``--timeout``). It connects at
    the first view change: a run that never changes opens no connection for it."""

    def __init__(self, endpoint: str, timeout_s: float) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._store: Any = None

    def _client(self) -> Any:
        if self._store is None:
            self._store = connect_store(in_namespace(self.endpoint, STORE_NAMESPACE), self.timeout_s)
        return self._store

    async def put(self, key: str, value: bytes | str) -> None:
        await asyncio.to_thread(lambda: self._client().set(key, value))

    async def get(self, key: str, what: str, *, take: bool = False) -> bytes:
        def fetch() -> bytes:
            store = self._client()
            value = bytes(store.get(key))
            if take:
                store.delete_key(key)
            return value

        try:
            return await asyncio.to_thread(fetch)
        except Exception as exc:  # noqa: BLE001 - torch's store errors vary by version; the line says what
            raise HopnetError(f"{what} did not come within {self.timeout_s:g}s (--timeout): {exc}") from None


class ReplicaChangeover(Changeover):
    """The view changes of one process of a replica group (member ``member`` of replica ``run.rank``)."""

    def __init__(self, worker: Any, run: ElasticRun | FollowerRun, *, layout: ReplicaLayout, member: int,
                 group: Any, views: ViewStore, **kwargs: Any) -> None:
        super().__init__(worker, run, **kwargs)  # type: ignore[arg-type]
        self.layout = layout
        self.member = member
        self.group = group
        self.views = views
        self.process = layout.process(run.rank, member)
        self._inflight: tuple[Any, torch.Tensor, Decision] | None = None
        """The all-reduce issued at the last step boundary, and member 0's decision in it."""
        # Member 0 decides at one boundary and its replica acts on it at the next: a view begins one
        # iteration later than it would for single workers, so every member still learns of the
        # change before the old view's last iteration.
        safe_point = self.safe_point
        self.safe_point = lambda k: safe_point(k + 1)

    # ------------------------------------------------------------------ one decision per replica
    def due(self, finished: int) -> ViewEntry | None:
        if self._entry is None:
            code, line, entry, first = self._step_agreement()
            if code == LEFT:
                raise Left(line or f"{self._who()} left")
            if code == STOPPED:
                raise MembershipStopped(line or f"{self._who()} was stopped by the membership")
            self._fix(entry, first)
        return self._entry_due(finished)

    def _step_agreement(self) -> Decision:
        """At a step boundary: what member 0 decided at the previous one (the all-reduce issued there has
        run during the step in between, so nobody waits for it here), and this boundary's all-reduce
        issued. Member 0 stopped by the membership ends at once; its replica's other members end when
        their collectives with it break."""
        if self._inflight is not None:
            work, vector, decided = self._inflight
            self._inflight = None
            work.wait()
            settled = self._settle(vector, decided)
            if settled[0] != NOTHING:
                return settled
        decided = self._lead_decision() if self.member == 0 else NOTHING_DECIDED
        if decided[0] in (LEFT, STOPPED):
            return decided
        self._inflight = (*self._issue(decided, async_op=True), decided)
        return NOTHING_DECIDED

    def _lead_decision(self) -> Decision:
        run = self.run
        try:
            if run.left_line is not None:
                return LEFT, run.left_line, None, None
            if run.stopped_line is not None:
                return STOPPED, run.stopped_line, None, None
            entry, first = Changeover._decide(self)
        except LeftRun as left:
            return LEFT, str(left), None, None
        except MembershipStopped as stopped:
            return STOPPED, str(stopped), None, None
        return (FIXED if entry is not None else NOTHING), None, entry, first

    def _admission(self) -> tuple[ViewEntry, int]:
        def lead() -> Decision:
            try:
                entry, first = Changeover._admission(self)
            except RunEnded as ended:
                return ENDED, str(ended), None, None
            except LeftRun as left:
                return LEFT, str(left), None, None
            except MembershipStopped as stopped:
                return STOPPED, str(stopped), None, None
            return FIXED, None, entry, first

        decided = lead() if self.member == 0 else NOTHING_DECIDED
        work, vector = self._issue(decided, async_op=False)
        code, line, entry, first = self._settle(vector, decided)
        if code == ENDED:
            raise RunEnded(line or "the run ended before this replica was admitted")
        if code == LEFT:
            raise LeftRun(line or f"{self._who()} left")
        if code == STOPPED:
            raise MembershipStopped(line or f"{self._who()} was stopped by the membership")
        assert entry is not None and first is not None
        return entry, first

    def _issue(self, decided: Decision, *, async_op: bool) -> tuple[Any, torch.Tensor]:
        """One all-reduce (MAX) over the replica: member 0's decision's code and first iteration, and
        whether any member wants to leave. Every member calls this at the same step boundaries."""
        import torch.distributed as dist

        code, _, _, first = decided
        vector = torch.tensor([int(self.run.leaving), code, -1 if first is None else first], dtype=torch.int64)
        return dist.all_reduce(vector, op=dist.ReduceOp.MAX, group=self.group, async_op=async_op), vector

    def _settle(self, vector: torch.Tensor, decided: Decision) -> Decision:
        """What the all-reduce said, and, when member 0 decided something, the view and the line it
        hands every member (``decided``: member 0's decision)."""
        import torch.distributed as dist

        leave, code, first_agreed = (int(v) for v in vector.tolist())
        if leave and not self.run.leaving:  # a member's SIGTERM: the whole replica leaves (member 0 asks)
            if self.member == 0:
                self.worker._thread.loop.call_soon_threadsafe(self.run.leave)
            else:
                self.run.leave()  # (its log says so: the launcher spares a process on its way out)
        if code == NOTHING:
            return NOTHING_DECIDED
        _, line, entry, _ = decided
        shared: list[Any] = [None, None]
        if self.member == 0:
            shared = [None if entry is None else (codec.encode(entry.commit), list(entry.old_members)), line]
        dist.broadcast_object_list(shared, group=self.group, group_src=0)
        if self.member != 0 and shared[0] is not None:
            encoded, old_members = shared[0]
            commit = codec.decode(encoded)
            if not isinstance(commit, Commit):
                raise HopnetError(f"{self._who()}: member 0 of its replica handed it {type(commit).__name__}, "
                                  "not a committed view")
            entry = ViewEntry(commit, tuple(int(m) for m in old_members))
        return code, shared[1], entry, (first_agreed if first_agreed >= 0 else None)

    # ------------------------------------------------------------------ the lanes' exchange, over the store
    def view_members(self, members: tuple[int, ...]) -> tuple[int, ...]:
        """The processes of ``members`` (replicas): the samplers divide the data among processes."""
        return tuple(p for replica in members for p in self.layout.members(replica))

    async def _send_cursors(self, entry: ViewEntry, cursors: dict[str, int]) -> None:
        await self.views.put(f"v{entry.number}/cursors/{self.process}", json.dumps(cursors))

    async def _cursors(self, entry: ViewEntry) -> dict[int, dict[str, int]]:
        reported: dict[int, dict[str, int]] = {}
        for process in self.view_members(tuple(entry.reporters)):
            text = await self.views.get(f"v{entry.number}/cursors/{process}",
                                        f"view {entry.number}: the sampler cursors of rank {process}")
            reported[process] = {str(k): int(v) for k, v in json.loads(text).items()}
        return reported

    async def _send_state(self, entry: ViewEntry, joiner: int, payload: bytes) -> None:
        await self.views.put(f"v{entry.number}/state/{self.layout.process(joiner, self.member)}", payload)

    async def _state(self, entry: ViewEntry, donor: int) -> bytes:
        return await self.views.get(f"v{entry.number}/state/{self.process}",
                                    f"view {entry.number}: the state of rank {self.layout.process(donor, self.member)}",
                                    take=True)

    def _address_exchange(self, entry: ViewEntry, graph: MemberGraph) -> Callable[[str], Awaitable[dict[int, str]]]:
        prefix = f"v{entry.number}/lane{self.member}/"

        async def exchange(address: str) -> dict[int, str]:
            await self.views.put(prefix + str(self.me), address)
            found: dict[int, str] = {}
            for replica in entry.members:
                text = await self.views.get(prefix + str(replica), f"view {entry.number}: the address of rank "
                                            f"{self.layout.process(replica, self.member)}")
                found[graph.position(replica)] = text.decode()
            return found
        return exchange

    def _who(self) -> str:
        return f"rank {self.worker.rank} (replica {self.me})"


__all__ = ["FollowerRun", "ReplicaChangeover", "ViewStore"]

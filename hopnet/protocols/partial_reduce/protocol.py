"""Partial Reduce: average models in groups of the first P ready workers (Miao et al.,
SIGMOD'21, Alg. 2).

Every worker, every iteration:

1. computes its gradients and applies its own step (the trainer, then ``apply``);
2. sends ``{"t": "ready", "iter": k}`` to the controller (:mod:`hopnet.protocols.partial_reduce.controller`),
   where ``k`` is its model's iteration counter: one more than after its last group;
3. blocks until the controller answers with its group
   ``{"t": "group", "gid": g, "members": [...], "weights": [...], "iter": max_k}``;
4. replaces its model with the group's weighted sum ``sum_j beta_j x_j``: it scales its
   flat model by its own ``beta`` and sum-all-reduces it among the members over the
   collective layer, tagged ``preduce/<gid>`` so back-to-back or concurrent groups never
   mix (with constant weights, a plain mean all-reduce: the same result, one rounding less).
   Every member ends with bit-identical parameters, and sets its counter to ``max_k``.

With ``--local-steps H`` steps 2-4 come only at every H-th iteration (and the last): the
worker trains alone in between, and its counter counts rounds of H iterations.

A group of one (the last worker left) is a no-op with weight 1. The trainer's model cannot
change while it computes a gradient: averaging happens only inside ``step()``, between two
computes, which is the consistency the paper finds AD-PSGD lacks.

Leaving: ``stop()`` says ``bye`` to the controller and, until the controller's ``bye_ok``,
still averages in any group formed before the goodbye reached it (a worker stopped by
Ctrl-C while waiting may already have been grouped: the others count on it). A worker
whose step failed says ``{"t": "bye", "failed": true}`` instead and does not wait: the
coordinator tells the others (``peer_failed``), so a group waiting on it fails at once.
It says ``bye`` to its graph neighbours too, so their heartbeat watch records a
departure, not a death.

Failures: a member that dies during a group is declared dead (by the coordinator, which
watches every worker, or by this node's own heartbeats); the all-reduce waiting on it fails
at once and this worker fails with :class:`PeerFailure` naming it. Its model may be
half-way through the weighted sum, so carrying on would silently break the average.
Only the member whose ring predecessor died sees the death in its all-reduce; the others
wait on members that are alive but will send nothing more. So a member whose group fails
(or that is stopped in the middle of one) tells the other members with a small
``preduce_abort`` message naming the culprit, and they fail at once naming it too, instead
of waiting out ``--timeout``. The controller's death is the coordinator client's to report
(``CoordinatorLost``).

Its declaration (options, what it refuses, what it registers) is :mod:`hopnet.protocols.partial_reduce.spec`,
which imports no torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import torch

from hopnet.config import ProtocolConfig
from hopnet.protocols.partial_reduce.mixing import GROUP_RECORD
from hopnet.errors import ConfigError, HopnetError, PeerFailure, ProtocolError
from hopnet.finite import refuse_non_finite_model
from hopnet.model_state import ModelState
from hopnet.protocols.base import ApplyFn, ModelSnapshot, Protocol, allreduce_each, reduce_or_roll_back
from hopnet.protocols.local_steps import mixes_at, round_of
from hopnet.protocols.partial_reduce.options import ABORT, PartialReduceOptions
from hopnet.runtime.services import CoordinatorChannel, NodeServices
from hopnet.wire import Header, Message

TAG_PREFIX = "preduce"
READY = "ready"
GROUP = "group"
BYE = "bye"
BYE_OK = "bye_ok"
ABORTS_REMEMBERED = 64
"""Aborts of groups this worker has not reached yet that it keeps (a member may fail
before this worker even got its group message)."""


class PartialReduceProtocol(Protocol):
    name = "partial-reduce"

    def __init__(self, config: ProtocolConfig, options: PartialReduceOptions,
                 model: ModelState | torch.Tensor | None) -> None:
        super().__init__()
        state = ModelState.wrap(model)
        if state is None:
            raise ConfigError("--protocol partial-reduce averages models: start the worker with hopnet.init(model), "
                              "or give Worker a params buffer")
        if any(f.dim() != 1 or not f.is_contiguous() or not f.is_floating_point() for f in state.flats):
            raise ConfigError("the partial-reduce protocol averages flat, contiguous floating-point tensors")
        self.config = config
        self.options = options
        self.flats = state.flats  # parameters and floating buffers, one tensor per dtype
        self.counter = 0  # the model's round counter k (sent with ready; a group sets it to max k)
        self.groups = 0
        self.groups_alone = 0
        self.groups_while_leaving = 0
        self.last_group: list[int] = []
        self._leaving = False
        self._left_controller = False  # said bye to the controller (quiesce or stop)
        self._broken = False  # a group failed or was cut short here: this model is no longer averaged
        self._failed = False  # a step raised: leave without waiting for the controller, and say so
        self._current: tuple[int, tuple[int, ...], int] | None = None  # (gid, members, iteration) running
        self._abort: asyncio.Future[PeerFailure] | None = None
        self._aborted: dict[int, tuple[int, int, str]] = {}  # gid -> (reporter, peer, state)
        self._last_gid = -1
        self.groups_failed = 0  # groups a dead member took with it (--max-restarts: rolled back)
        self._before = ModelSnapshot()  # the model before the running group (--max-restarts)

    def bind(self, node: NodeServices) -> None:
        super().bind(node)
        self.rank = node.rank

    def _client(self) -> CoordinatorChannel:
        client = self.node.coordinator
        if client is None:
            raise ConfigError("--protocol partial-reduce needs its controller: run it under hopnet launch or "
                              "hopnet simulate, which start one")
        return client

    async def start(self) -> None:
        self._client()
        self.node.entered(self.iteration, self)

    def resume_at(self, iteration: int) -> None:
        super().resume_at(iteration)
        # every rank resumes at the same iteration: equal counters (the rounds done), a fresh controller
        self.counter = round_of(iteration, self.options.local_steps)

    # ------------------------------------------------------------------ one iteration
    async def finish_iteration(self, apply: ApplyFn | None, *, last: bool = False) -> None:
        try:
            await self._finish_iteration(apply, last)
        except Exception:
            self._failed = True  # (a cancelled wait for the group is no failure: stop() still serves it)
            raise

    async def _finish_iteration(self, apply: ApplyFn | None, last: bool) -> None:
        k = self.iteration
        if apply is not None:
            apply()
        if not mixes_at(k, self.options.local_steps, self.final_iteration):  # a local step: no group
            self.node.iteration_done(k, self)
            if not last:
                self.iteration = k + 1
                self.node.entered(k + 1, self)
            return
        refuse_non_finite_model(self.flats, rank=self.rank, iteration=k, to="its group")
        self.counter += 1
        client = self._client()
        client.send({"t": READY, "iter": self.counter})
        loop = asyncio.get_running_loop()
        began = loop.time()
        message = await client.receive(f"the group of rank {self.rank}'s ready signal of iteration {k}")
        self.node.waited("updates", loop.time() - began)
        if message.get("t") != GROUP:
            raise ProtocolError(f"rank {self.rank}: expected its group from the controller in iteration {k}, "
                                f"got a {message.get('t')!r} message")
        await self._average(message, k)
        self.node.iteration_done(k, self)
        if last:
            return
        self.iteration = k + 1
        self.node.entered(k + 1, self)

    async def _average(self, message: Mapping[str, Any], k: int) -> None:
        members, weights, gid, newest = self._check_group(message, k)
        beta = weights[members.index(self.rank)]
        if len(members) == 1:
            self.groups_alone += 1
        elif self.node.survives_losses:
            if not await self._reduce_or_roll_back(members, gid, beta, k):
                return
        else:
            await self._reduce(members, gid, beta, k)
        self.groups += 1
        self._last_gid = max(self._last_gid, gid)
        self.counter = max(self.counter, newest)
        self.last_group = list(members)
        self.node.record(GROUP_RECORD, iter=k, gid=gid, members=list(members), weights=list(weights),
                         counter=self.counter)

    async def _reduce(self, members: tuple[int, ...], gid: int, beta: float, k: int) -> None:
        """The group's weighted sum into the model's flat tensors; fails naming the member to blame, and
        then tells the other members so that none of them waits out ``--timeout``."""
        where = f"rank {self.rank}: group {gid} {list(members)} of iteration {k} failed"
        reported = self._aborted.pop(gid, None)
        if reported is not None:
            self._broken = True
            raise self._reported_failure(where, *reported, k)
        loop = asyncio.get_running_loop()
        tag = f"{TAG_PREFIX}/{gid}"
        if self.options.weights == "const":
            reduction = allreduce_each(self.node.collective, members, self.flats, "mean", tag=tag)
        else:
            for flat in self.flats:
                flat.mul_(beta)
            reduction = allreduce_each(self.node.collective, members, self.flats, "sum", tag=tag)
        task = loop.create_task(reduction)
        abort: asyncio.Future[PeerFailure] = loop.create_future()
        self._current, self._abort = (gid, members, k), abort
        try:
            await asyncio.wait((task, abort), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled (Ctrl-C, the worker stopping) in the middle of the group
            await _cancel(task, self.config.peer_timeout_s)
            self._broken = True
            await self._tell_members(gid, members, self.rank, "departed")
            raise
        finally:
            self._current, self._abort = None, None
        if abort.done():
            await _cancel(task, self.config.peer_timeout_s)
            self._broken = True
            raise abort.result()
        try:
            task.result()
        except PeerFailure as exc:
            self._broken = True
            await self._tell_members(gid, members, exc.peer, exc.peer_state or "dead")
            raise PeerFailure(f"{where}: {exc}", peer=exc.peer, peer_state=exc.peer_state, iteration=k) from None
        except BaseException:
            self._broken = True
            await self._tell_members(gid, members, self.rank, "departed")
            raise

    async def _reduce_or_roll_back(self, members: tuple[int, ...], gid: int, beta: float, k: int) -> bool:
        """With ``--max-restarts`` or ``--max-failures`` a member that dies takes the group with it, not
        the run: the model goes back to what it was before the group and this worker carries on, as
        if it had been grouped alone (the controller groups the others without the dead one, and
        takes its replacement back if one comes). Whether the group ran."""
        failure = await reduce_or_roll_back(self.node, self._before, self.flats, self._reduce(members, gid, beta, k))
        if not isinstance(failure, PeerFailure):
            return True
        self._broken = False
        self.groups_failed += 1
        self.node.record("group_failed", iter=k, gid=gid, members=list(members), peer=failure.peer,
                         peer_state=failure.peer_state)
        return False

    async def _tell_members(self, gid: int, members: tuple[int, ...], peer: int | None, state: str) -> None:
        others = [m for m in members if m != self.rank and m not in self.node.dead and m not in self.node.departed]
        try:
            await self.node.connect_to(others)
        except Exception:  # noqa: BLE001 - best effort: the members still fail, later, on --timeout
            return
        meta = {"gid": gid, "peer": peer if peer is not None else self.rank, "state": state}
        for member in others:
            self.node.post(Message(ABORT, self.rank, member, self.iteration, meta=meta))

    def _reported_failure(self, where: str, reporter: int, peer: int, state: str, k: int) -> PeerFailure:
        why = (f"rank {reporter} left in the middle of it" if peer == reporter
               else f"rank {reporter} reported rank {peer} {state}")
        return PeerFailure(f"{where}: {why}", peer=peer, peer_state=state, iteration=k)

    def _check_group(self, message: Mapping[str, Any], k: int) -> tuple[tuple[int, ...], list[float], int, int]:
        members, weights = message.get("members"), message.get("weights")
        gid, newest = message.get("gid"), message.get("iter")
        if (not isinstance(members, list) or not isinstance(weights, list) or len(members) != len(weights)
                or self.rank not in members or not isinstance(gid, int) or not isinstance(newest, int)
                or not all(isinstance(w, (int, float)) for w in weights)):
            raise ProtocolError(f"rank {self.rank}: malformed group message from the controller in iteration "
                                f"{k}: {dict(message)!r}")
        return tuple(int(m) for m in members), [float(w) for w in weights], gid, newest

    # ------------------------------------------------------------------ leaving
    async def quiesce(self) -> None:
        """Leave the controller now, as :meth:`stop` would: no group is formed with this worker
        after its goodbye (the groups shrink to the workers still training), and it still
        averages in any group formed before."""
        await self._leave_controller()

    async def stop(self) -> None:
        self._leaving = True
        try:
            await self._leave_controller()
        except HopnetError as exc:  # a worker failing anyway: leave without the controller's answer
            self.node.record("leave_incomplete", why=" ".join(str(exc).split())[:300])
        node = self.node
        await self.say_goodbye(peer for peer in node.graph.peers(self.rank)
                               if peer not in node.departed and peer not in node.dead)

    async def _leave_controller(self) -> None:
        """Say bye; until the controller's ``bye_ok``, average in any group formed before the
        goodbye reached it (the other members count on this worker). A failing worker says
        so and does not wait: the coordinator tells the others (``peer_failed``)."""
        client = self.node.coordinator
        if client is None or self._left_controller:
            return
        self._left_controller = True
        if self._failed or self._broken:
            client.send({"t": BYE, "failed": True})
            return
        client.send({"t": BYE})
        while True:
            message = await client.receive(f"the controller's answer to rank {self.rank}'s goodbye")
            kind = message.get("t")
            if kind == BYE_OK:
                return
            if kind != GROUP:
                self.node.count_drop("unexpected_coordinator_message")
                continue
            self.groups_while_leaving += 1
            await self._average(message, self.iteration)

    # ------------------------------------------------------------------ messages (none of its own)
    def buffers_for(self, header: Header) -> Any:
        return None  # the only kind of its own (abort) carries no tensor; the collective's go to the mailbox

    def on_message(self, msg: Message) -> None:
        meta = msg.meta or {}
        gid, peer, state = meta.get("gid"), meta.get("peer"), meta.get("state")
        if (msg.kind != ABORT or not isinstance(gid, int) or not isinstance(peer, int)
                or state not in ("dead", "departed")):
            self.node.count_drop("unexpected_kind")
            return
        current, abort = self._current, self._abort
        if current is not None and current[0] == gid and abort is not None and not abort.done():
            if msg.src not in current[1]:
                self.node.count_drop("abort_from_non_member")
                return
            where = f"rank {self.rank}: group {gid} {list(current[1])} of iteration {current[2]} failed"
            abort.set_result(self._reported_failure(where, msg.src, peer, state, current[2]))
            return
        if gid >= self._next_gid_floor():
            self._aborted[gid] = (msg.src, peer, state)
            while len(self._aborted) > ABORTS_REMEMBERED:
                del self._aborted[min(self._aborted)]

    def _next_gid_floor(self) -> int:
        """Group ids are increasing: an abort for a group older than the last one run is stale."""
        return self._last_gid + 1

    # ------------------------------------------------------------------ replacements
    def handover_state(self) -> dict[str, Any]:
        return {"counter": self.counter}

    def rejoin_at(self, iteration: int, state: Mapping[str, Any]) -> None:
        super().rejoin_at(iteration, state)
        counter = state.get("counter")
        self.counter = counter if isinstance(counter, int) and counter >= 0 else iteration

    # ------------------------------------------------------------------ records
    def snapshot(self) -> dict[str, Any]:
        return {"group": self.last_group, "counter": self.counter}

    def summary(self) -> dict[str, Any]:
        return {"groups": self.groups, "groups_alone": self.groups_alone,
                "groups_while_leaving": self.groups_while_leaving, "groups_failed": self.groups_failed}


async def _cancel(task: asyncio.Task[Any], within_s: float) -> None:
    """Cancel ``task`` and give it ``within_s`` to clean up (the collective drops the round and
    waits for its sends; one to a dead member may never finish, so the wait is bounded)."""
    if not task.done():
        task.cancel()
    await asyncio.wait((task,), timeout=within_s)
    if task.done() and not task.cancelled():
        task.exception()  # retrieved: superseded by the caller's own outcome


__all__ = ["PartialReduceProtocol"]

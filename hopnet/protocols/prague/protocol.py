"""Prague (ASPLOS'20): model averaging by Partial All-Reduce within groups.

Every iteration each worker applies its own optimizer step, then averages its model with
a group: P-Reduce, a mean all-reduce of the flat parameter buffer among the group's
members over the node's collective (``node.collective``), tagged ``prague/<gid>`` so that
groups running at the same time, or back to back, never mix. Models, not gradients;
momentum and weight decay stay local.

Where groups come from (``--group-generator``):

* ``random`` and ``smart``: a Group Generator, a coordinator state machine
  (:mod:`hopnet.protocols.prague.random_gg`, :mod:`hopnet.protocols.prague.smart_gg`) reached through
  ``node.coordinator``. At the *start* of iteration ``k`` the worker sends
  ``{"t": "req", "iter": k}``, so the round trip overlaps its compute. The GG sends
  ``{"t": "go", "gid", "members", "reply"}`` to every member of a group when it may run.
  At its sync point the worker runs the groups GO'd to it, in arrival order, until it has
  run the one that answers its own request (``reply``), acknowledging each with
  ``{"t": "ack", "gid"}`` once its part is done. The ack of its own group asks the host
  for a ``synced`` answer (``"sync": gid``), which comes after the GOs that ack let the GG
  send, and the worker runs those too before computing again. A worker joins other
  workers' groups only at its own sync point, so its model never changes while it
  computes a gradient.
* ``static``: the conflict-free schedule of Sec. 4.2
  (:func:`hopnet.protocols.prague.static_schedule.static_group`), computed locally from the
  rank, the iteration and the graph's ``machine`` labels; no coordinator.

A group of one member is a counted "no sync" (nothing to average).

With ``--local-steps H`` a worker requests and syncs only at every H-th iteration (and the last):
it trains alone in between, the GG's requests count rounds, and the static schedule steps once a
round.

Leaving: after its last iteration a worker says ``{"t": "bye"}`` and keeps running the
groups GO'd to it until the coordinator answers ``bye_ok``. The coordinator puts it in no
group after the ``bye``, and everything it sent before reaches the worker first, so no
other worker is left waiting on a group with it. A worker stopped early (Ctrl-C, a stop in
the simulator) does the same when it closes.

Failures: a member that dies during a P-Reduce fails the others' all-reduce with
:class:`~hopnet.errors.PeerFailure` naming it (the node hears of the death from its own
heartbeats or from the coordinator's ``peer_dead``); the GG draws it into no new group.
A worker whose step failed says ``{"t": "bye", "failed": true}`` as it closes, without
waiting: the coordinator tells the others (``peer_failed``), so a group waiting on it
fails at once, naming it, instead of after ``--timeout``.
A coordinator that stops answering fails the wait for a GO with
:class:`~hopnet.coordinator.client.CoordinatorLost`, naming it.

Its declaration (options, what it refuses, what it registers) is :mod:`hopnet.protocols.prague.spec`,
which imports no torch.
"""

from __future__ import annotations

from typing import Any

import torch

from hopnet.config import ProtocolConfig
from hopnet.protocols.prague.static_schedule import static_group
from hopnet.coordinator.wire import BYE_OK, SYNCED
from hopnet.errors import ConfigError, HopnetError, PeerFailure, ProtocolError
from hopnet.finite import refuse_non_finite_model
from hopnet.model_state import ModelState
from hopnet.protocols.base import ApplyFn, ModelSnapshot, Protocol, allreduce_each, reduce_or_roll_back
from hopnet.protocols.local_steps import mixes_at, round_of
from hopnet.protocols.prague.options import PragueOptions, restart_refusal
from hopnet.runtime.services import CoordinatorChannel, NodeServices
from hopnet.wire import Header, Message

TAG_PREFIX = "prague"


class PragueProtocol(Protocol):
    name = "prague"

    def __init__(self, config: ProtocolConfig, options: PragueOptions,
                 model: ModelState | torch.Tensor | None) -> None:
        super().__init__()
        state = ModelState.wrap(model)
        if state is None:
            raise ConfigError("--protocol prague averages models: start the worker with hopnet.init(model), "
                              "or give Worker a params buffer")
        if any(f.dim() != 1 or not f.is_contiguous() for f in state.flats):
            raise ConfigError("the prague protocol averages flat, contiguous tensors")
        self.config = config
        self.options = options
        self.flats = state.flats  # parameters and floating buffers, one tensor per dtype
        self.static = options.group_generator == "static"
        self.groups: list[list[int]] = []  # per iteration: the group that answered this worker's request
        self.gids: list[int | None] = []
        self.groups_run = 0
        self.served = 0  # groups run that others initiated
        self.no_sync = 0
        self._served_this_iteration = 0
        self._requested = -1  # the last iteration whose group this worker asked the GG for
        self._said_bye = False
        self._failed = False  # a step raised: leave without waiting for the GG, and say so
        self.groups_failed = 0  # P-Reduces a dead member took with it (--max-restarts: rolled back)
        self._before = ModelSnapshot()  # the model before the running P-Reduce (--max-restarts)

    def bind(self, node: NodeServices) -> None:
        super().bind(node)
        self.rank = node.rank
        self.world_size = node.graph.n
        if self.static:
            self.machines = tuple(node.graph.machine(r) for r in range(self.world_size))
        elif node.coordinator is None:
            raise ConfigError(f"--protocol prague --group-generator {self.options.group_generator} needs its Group "
                              "Generator: run it under `hopnet launch` or `hopnet simulate`, which start one")

    @property
    def _gg(self) -> CoordinatorChannel:
        """The client of the Group Generator (bind() refused a dynamic generator without one)."""
        coordinator = self.node.coordinator
        if coordinator is None:
            raise ConfigError(f"--protocol prague --group-generator {self.options.group_generator} has no Group "
                              "Generator on this node")
        return coordinator

    async def start(self) -> None:
        if self.node.max_restarts and (refusal := restart_refusal(self.options)) is not None:
            raise ConfigError(f"--max-restarts: {refusal}")
        self.node.entered(self.iteration, self)
        self._request(self.iteration)

    def _mixes(self, iteration: int) -> bool:
        return mixes_at(iteration, self.options.local_steps, self.final_iteration)

    def _request(self, k: int) -> None:
        """Ask the GG for a group at the start of mixing iteration ``k`` (with local steps, the GG counts
        requests, so rounds)."""
        if not self.static and self._mixes(k):
            self._gg.send({"t": "req", "iter": k})
            self._requested = k

    # ------------------------------------------------------------------ one iteration
    async def finish_iteration(self, apply: ApplyFn | None, *, last: bool = False) -> None:
        try:
            await self._finish_iteration(apply, last)
        except BaseException:
            self._failed = True
            raise

    async def _finish_iteration(self, apply: ApplyFn | None, last: bool) -> None:
        k = self.iteration
        if apply is not None:
            apply()
        self._served_this_iteration = 0
        if not self._mixes(k):  # a local step: no group (a group GO'd to this worker waits for its next sync)
            self.node.iteration_done(k, self)
            if not last:
                self.iteration = k + 1
                self.node.entered(k + 1, self)
                self._request(k + 1)
            return
        refuse_non_finite_model(self.flats, rank=self.rank, iteration=k, to="its group")
        if self.static:
            await self._static_sync(k)
        else:
            if self._requested != k:  # a last iteration not known as such when it began (local steps)
                self._request(k)
            await self._sync(k)
        self.node.iteration_done(k, self)
        if last:
            if not self.static:
                await self._leave()
            return
        self.iteration = k + 1
        self.node.entered(k + 1, self)
        self._request(k + 1)

    async def _sync(self, k: int) -> None:
        """Run the groups GO'd to this worker, in arrival order, up to and including its own."""
        loop_time = self.node.clock.now
        waited = 0.0
        while True:
            began = loop_time()
            message = await self._gg.receive(
                f"the GO of rank {self.rank}'s group for iteration {k}")
            waited += loop_time() - began
            if message.get("t") != "go":
                self.node.count_drop("unexpected_coordinator_message")
                continue
            own = bool(message.get("reply"))
            gid, members = await self._run(message, sync=own)
            if own:
                self.groups.append(members)
                self.gids.append(gid)
                break
            self.served += 1
            self._served_this_iteration += 1
        waited += await self._serve_until_synced(gid)
        self.node.waited("updates", waited)

    async def _serve_until_synced(self, gid: int) -> float:
        """Run the groups this worker's last ack let start, before going back to compute.

        The ack of its own group asked the host for a ``synced`` answer, which comes after
        every GO the GG sent in reply to that ack: a group waiting only for this worker's
        lock starts now instead of at its next sync point, one compute later."""
        loop_time = self.node.clock.now
        waited = 0.0
        while True:
            began = loop_time()
            message = await self._gg.receive(
                f"the coordinator's answer to rank {self.rank}'s ack of group {gid}")
            waited += loop_time() - began
            kind = message.get("t")
            if kind == SYNCED and message.get("id") == gid:
                return waited
            if kind == "go":
                await self._run(message)
                self.served += 1
                self._served_this_iteration += 1
            else:
                self.node.count_drop("unexpected_coordinator_message")

    async def _run(self, message: dict[str, Any], *, sync: bool = False) -> tuple[int, list[int]]:
        gid, members = message.get("gid"), message.get("members")
        if not isinstance(gid, int) or not isinstance(members, list) or self.rank not in members \
                or not all(isinstance(m, int) for m in members):
            raise ProtocolError(f"rank {self.rank}: the coordinator sent a GO it cannot run: {message!r}")
        replaced = self._replaced_member(members, message.get("restarts"))
        if len(members) == 1:
            self.no_sync += 1
        elif replaced is not None:
            self.groups_failed += 1
            self.node.record("group_failed", iter=self.iteration, gid=gid, members=members, peer=replaced,
                             peer_state="replaced")
        elif self.node.survives_losses:
            await self._reduce_or_roll_back(members, gid)
        else:
            await allreduce_each(self.node.collective, members, self.flats, "mean", tag=f"{TAG_PREFIX}/{gid}")
        self.groups_run += 1
        self._gg.send({"t": "ack", "gid": gid, **({"sync": gid} if sync else {})})
        return gid, members

    def _replaced_member(self, members: list[int], restarts: object) -> int | None:
        """A member of a group the Group Generator formed for a process that has since been replaced
        (``--max-restarts``: the GO names each member's restart number, none meaning 0), else None.
        Nobody runs such a group: the earlier process is gone, and the later one never got the GO."""
        seen = self.node.restarts_seen
        if not seen:
            return None
        numbers = restarts if isinstance(restarts, list) and len(restarts) == len(members) else [0] * len(members)
        return next((m for m, n in zip(members, numbers) if isinstance(n, int) and seen.get(m, 0) > n), None)

    async def _reduce_or_roll_back(self, members: list[int], gid: int) -> None:
        """With ``--max-restarts`` or ``--max-failures`` a member that dies takes the P-Reduce with it,
        not the run: the model goes back to what it was before the group, and the group is
        acknowledged as run (the GG releases the dead member itself, and takes its replacement back
        if one comes)."""
        failure = await reduce_or_roll_back(
            self.node, self._before, self.flats,
            allreduce_each(self.node.collective, members, self.flats, "mean", tag=f"{TAG_PREFIX}/{gid}"))
        if isinstance(failure, PeerFailure):
            self.groups_failed += 1
            self.node.record("group_failed", iter=self.iteration, gid=gid, members=members, peer=failure.peer,
                             peer_state=failure.peer_state)

    async def _static_sync(self, k: int) -> None:
        group = static_group(self.rank, round_of(k, self.options.local_steps), self.machines)
        members = sorted(group) if group else [self.rank]
        if len(members) == 1:
            self.no_sync += 1
        else:
            await allreduce_each(self.node.collective, members, self.flats, "mean", tag=f"{TAG_PREFIX}-static/{k}")
        self.groups_run += 1
        self.groups.append(members)
        self.gids.append(None)

    # ------------------------------------------------------------------ leaving
    async def _leave(self) -> None:
        """Say bye to the GG and run what it GO'd to this worker before it heard it."""
        if self._said_bye or self.static or self.node.coordinator is None:
            return
        self._said_bye = True
        coordinator = self.node.coordinator
        if self._failed:  # the others must not wait on a group with this worker: the GG tells them
            coordinator.send({"t": "bye", "failed": True})
            return
        coordinator.send({"t": "bye"})
        while True:
            message = await coordinator.receive(f"the coordinator's answer to rank {self.rank}'s goodbye")
            kind = message.get("t")
            if kind == BYE_OK:
                return
            if kind == "go":
                await self._run(message)
                self.served += 1
            else:
                self.node.count_drop("unexpected_coordinator_message")

    async def quiesce(self) -> None:
        """Leave the GG now (the last step did already; a loop that stopped without one did
        not), running what it GO'd to this worker before it heard the goodbye."""
        await self._leave()

    async def stop(self) -> None:
        """Leave the GG (if the last iteration did not already), then say goodbye to the graph
        neighbours, whose heartbeats watch this worker."""
        try:
            await self._leave()
        except HopnetError as exc:  # a worker failing anyway: leave without the GG's answer
            self.node.record("leave_incomplete", why=" ".join(str(exc).split())[:300])
        node = self.node
        await self.say_goodbye(peer for peer in node.graph.peers(self.rank)
                               if peer not in node.departed and peer not in node.dead)

    # ------------------------------------------------------------------ messages (all go through the mailbox)
    def buffers_for(self, header: Header) -> Any:
        return None

    def on_message(self, msg: Message) -> None:
        self.node.count_drop("unexpected_kind")

    # ------------------------------------------------------------------ records
    def snapshot(self) -> dict[str, Any]:
        if not self.groups:
            return {}
        return {"group": self.groups[-1], "gid": self.gids[-1], "served": self._served_this_iteration}

    def summary(self) -> dict[str, Any]:
        own = len(self.groups)
        return {"groups_run": self.groups_run, "own_groups": own, "served_groups": self.served,
                "no_sync": self.no_sync, "groups_failed": self.groups_failed,
                "mean_group_size": round(sum(map(len, self.groups)) / own, 3) if own else None}


__all__ = ["PragueProtocol"]

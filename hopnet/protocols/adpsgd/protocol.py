"""AD-PSGD: asynchronous decentralized SGD by atomic pairwise model averaging.

Lian et al., as Prague (ASPLOS'20) describes it in Sec. 2.3 and Fig. 3. It averages
models, not gradients. Every worker, every iteration:

1. reads its model and computes gradients on it (the trainer);
2. applies them to its model as it is now (``x_i <- x'_i - lr * g``; ``x'_i`` may differ
   from what was read, because an averaging may have changed it in between);
3. an *active* worker picks one *passive* neighbour at random (seeded) and
4. averages with it atomically: ``x_i, x_j <- (x_i + x_j) / 2``.

With ``--local-steps H`` an active does steps 3-4 only at every H-th iteration (and its last).

Active and passive sets are the two sides of the bipartite communication graph (every
edge joins an active and a passive worker). Only actives initiate, so no cycle of
workers can wait on each other and nothing deadlocks; a non-bipartite graph is refused
before anything starts (:func:`check_bipartite`).

How an averaging runs (one request, one reply):

* the active sends its model to the passive and waits for the reply (its trainer is
  blocked in ``step()``, so its model does not change meanwhile);
* the passive serves the request on its event loop, whatever its trainer is doing:
  under the model lock it computes the mean into the request's buffer and copies it
  into its model, then replies with that mean. Serving never awaits between reading and
  writing the model, so requests from several actives are served one after the other,
  in arrival order: the event loop is the queue;
* the active copies the mean into its model. Both now hold the same bytes, so the pair's
  sum is preserved (exactly, wherever ``(x_i + x_j) / 2`` is exact in the dtype).

Passives also train: each iteration they apply their own gradient step and go on, without
waiting for anyone. The optimizer step and a served averaging exclude each other through
the node's ``model_lock``, a ``threading.Lock``: the step runs on the node's loop thread inside
``step()`` today, but a reader on another thread (evaluation, a checkpoint, a test)
takes the same lock and sees the model either before or after an averaging, never
half-way through.

How a run ends: an active finishes its iterations and says ``bye`` to its passive
neighbours. A passive's last ``step()`` keeps serving until every active neighbour said
``bye`` (or was declared dead), so the model its trainer holds after the loop is final;
that wait fails after ``--timeout`` seconds without a request or a goodbye, naming the
actives still missing. Before ``worker.consensus()`` an active says ``done`` instead, which
ends that wait the same way (:meth:`AdPsgdProtocol.quiesce`). A
worker that leaves early (Ctrl-C, a stop in the simulator) says ``bye`` at once; a passive
replies to the request it is serving before that, and serves none after.

Failures: a passive that said ``bye`` is no longer chosen. If it says ``bye`` while an
active waits for its reply, the request was never served (replies go out before the
goodbye), so the averaging is skipped and recorded, naming the passive. A passive
declared dead during the wait fails the active with :class:`PeerFailure` naming it (the
averaging may or may not have happened on its side); under ``--max-restarts`` the active
skips that averaging instead and goes on, and takes the passive's replacement back. An active with no passive neighbour
left trains alone and records each skipped averaging.

Between replica groups (:mod:`hopnet.replica`) each lane runs this on its shard, and a replica decides
once: an active's lanes draw from the passives every lane still counts, with one seed, so they draw
alike; a passive lane holds the requests that reach it and serves, at each step boundary (and in its
last step until every lane knows every active is done), those every lane holds, in the actives'
order. An active then waits up to one step of its passive.

Its declaration (options, what it refuses, what it registers) is :mod:`hopnet.protocols.adpsgd.spec`,
which imports no torch.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hopnet.config import ProtocolConfig
from hopnet.errors import ConfigError, PeerFailure, WaitTimeout
from hopnet.finite import all_finite_in, refuse_non_finite_model
from hopnet.model_state import ModelState
from hopnet.protocols.base import ApplyFn, Protocol
from hopnet.protocols.adpsgd.options import REPLY, REQUEST, AdPsgdOptions, check_bipartite
from hopnet.protocols.local_steps import mixes_at
from hopnet.runtime.services import NodeServices
from hopnet.transports.base import DISCARD
from hopnet.wire import Header, Message, TensorSpec

LANE_POLL_S = 0.002
"""How often a passive lane of a replica group, in its last step, meets its other lanes again."""


@dataclass(frozen=True)
class Averaging:
    """One averaging as the passive served it, for observers (tests, debugging).

    The tensors are the live buffers of the model's first flat tensor (its parameters, then its
    floating buffers, of the first dtype): read them inside the observer call, do not keep them."""

    active: int
    passive: int
    active_iter: int
    passive_iter: int
    active_model: torch.Tensor
    passive_before: torch.Tensor
    mean: torch.Tensor


AveragingObserver = Callable[[Averaging], None]


class AdPsgdProtocol(Protocol):
    name = "ad-psgd"

    def __init__(self, config: ProtocolConfig, model: ModelState | torch.Tensor | None,
                 options: AdPsgdOptions | None = None) -> None:
        super().__init__()
        state = ModelState.wrap(model)
        if state is None:
            raise ConfigError("--protocol ad-psgd averages models: start the worker with hopnet.init(model), "
                              "or give Worker a params buffer")
        if any(f.dim() != 1 or not f.is_contiguous() for f in state.flats):
            raise ConfigError("the ad-psgd protocol averages flat, contiguous tensors")
        self.config = config
        self.local_steps = (options or AdPsgdOptions()).local_steps
        self.flats = state.flats  # parameters and floating buffers, one tensor per dtype
        self.specs = tuple(TensorSpec(f.dtype, tuple(f.shape)) for f in self.flats)
        self.observer: AveragingObserver | None = None  # called by a passive for each averaging it serves
        self.active = True
        self.neighbours: tuple[int, ...] = ()
        self.gone: dict[int, str] = {}  # neighbour -> "departed" | "dead"
        self.done: set[int] = set()  # neighbours that quiesced for the consensus: they average no more
        # Active side
        self.partners: list[int | None] = []  # per mixing iteration: the passive averaged with, None if skipped
        self.skips: list[dict[str, Any]] = []
        self._partner_now: int | None = None  # this iteration's partner (None: skipped, or a local step)
        self._reply_buffers: list[torch.Tensor] | None = None
        self._awaited: int | None = None  # the passive whose reply this active waits for
        self._reply: asyncio.Future[bool] | None = None
        # Passive side
        self.served = 0
        self._served_this_iteration = 0
        self._request_buffers: dict[int, list[torch.Tensor]] = {}
        self._activity: asyncio.Event | None = None  # set on each request or goodbye
        self._leaving = False  # said bye: serves no more requests
        self._early_requests: list[Message] | None = []  # requests that came before start (served then)
        self._held: dict[int, Message] = {}  # a lane of a replica group: requests held until its lanes agree

    def bind(self, node: NodeServices) -> None:
        super().bind(node)
        self.rank = node.rank
        actives, _ = check_bipartite(node.graph)
        self.active = self.rank in actives
        self.neighbours = node.graph.peers(self.rank)
        self.rng = random.Random(f"{self.config.seed}:ad-psgd:{self.rank}")

    @property
    def role(self) -> str:
        return "active" if self.active else "passive"

    async def start(self) -> None:
        self._activity = asyncio.Event()
        early, self._early_requests = self._early_requests, None
        for msg in early or ():  # a replacement's model was loaded since: averaged with it, not its initial one
            self.on_message(msg)
        self.node.record("role", role=self.role, neighbours=list(self.neighbours))
        self.node.entered(self.iteration, self)

    # ------------------------------------------------------------------ one iteration
    async def finish_iteration(self, apply: ApplyFn | None, *, last: bool = False) -> None:
        k = self.iteration
        if apply is not None:
            with self.node.model_lock:
                apply()
        self._partner_now = None
        if self.active:
            if mixes_at(k, self.local_steps, self.final_iteration):
                self._partner_now = await self._average_with_a_passive(k)
                self.partners.append(self._partner_now)
        elif self.node.lanes is not None and not last:
            await self._serve_agreed()
        if last and not self.active:
            await self._serve_until_actives_leave()
        self.node.iteration_done(k, self)
        self._served_this_iteration = 0
        if last:
            return
        self.iteration = k + 1
        self.node.entered(k + 1, self)

    async def _average_with_a_passive(self, k: int) -> int | None:
        """Average with one random passive neighbour; the partner, or None if skipped."""
        candidates = [p for p in self.neighbours if p not in self.gone and p not in self.done]
        if self.node.lanes is not None:  # every lane of the replica draws from the same list
            common, _ = await self.node.lanes.common(candidates, 0)
            candidates = [p for p in self.neighbours if p in common]
        if not candidates:
            self._skip(k, None, "no passive neighbour left" if self.neighbours else "no neighbours")
            return None
        partner = self.rng.choice(candidates)
        refuse_non_finite_model(self.flats, rank=self.rank, iteration=k, to=f"passive {partner}")
        if self._reply_buffers is None:
            self._reply_buffers = [torch.empty_like(f) for f in self.flats]
        loop = asyncio.get_running_loop()
        self._reply = loop.create_future()
        self._awaited = partner
        sent = self.node.post_tracked(Message(REQUEST, self.rank, partner, k, tensors=list(self.flats)))
        began = loop.time()
        # Waiting, the model does not change until the reply: a neighbour's replacement may take it now
        # (the passive it waits for may be that replacement, which serves only once it holds a model).
        self.node.handover_point()
        try:
            served = await self.node.clock.wait(self._reply, f"the averaging reply of passive {partner}",
                                                peer=partner, iteration=k)
        except WaitTimeout as exc:
            raise WaitTimeout(exc.what, peer=partner, iteration=k, waited_s=exc.waited_s,
                              peer_state=self.node.peer_state(partner)) from None
        finally:
            self.node.handover_point(False)
            self._awaited = None
            self._reply = None
            self.node.waited("updates", loop.time() - began, [partner])
        if sent is not None:
            await sent  # received means sent; this only lets the send's bookkeeping finish
        if not served:
            self._skip(k, partner, f"passive {partner} left before serving the averaging")
            return None
        if not all_finite_in(self._reply_buffers):
            self._drop_non_finite(partner, k)
            self._skip(k, partner, f"passive {partner}'s reply holds inf or NaN")
            return None
        with self.node.model_lock:
            for flat, mean in zip(self.flats, self._reply_buffers):
                flat.copy_(mean)
        return partner

    def _skip(self, k: int, partner: int | None, why: str) -> None:
        self.skips.append({"iter": k, "peer": partner, "why": why})
        self.node.record("averaging_skipped", iter=k, peer=partner, why=why)

    # ------------------------------------------------------------------ the passive's service
    def _serve(self, msg: Message) -> None:
        """One averaging, start to finish, with no await in between: atomic on the event loop."""
        means = msg.tensors
        if not all_finite_in(means):
            # Not mixed in: the active gets this passive's own model back, unchanged.
            self._drop_non_finite(msg.src, msg.iter)
            for flat, mean in zip(self.flats, means):
                mean.copy_(flat)
            self.node.post(Message(REPLY, self.rank, msg.src, msg.iter, tensors=list(means)))
            return
        with self.node.model_lock:
            observer = self.observer
            if observer is not None:
                before, active_model = self.flats[0].clone(), means[0].clone()
            for flat, mean in zip(self.flats, means):
                mean.add_(flat).mul_(0.5)
                flat.copy_(mean)
            if observer is not None:  # inside the lock: it sees the step as the readers will
                observer(Averaging(msg.src, self.rank, msg.iter, self.iteration, active_model, before, means[0]))
        self.served += 1
        self._served_this_iteration += 1
        # ``means`` are this active's request buffers: they are not written again before the active
        # has the reply, and so before this send is done.
        self.node.post(Message(REPLY, self.rank, msg.src, msg.iter, tensors=list(means)))

    def _drop_non_finite(self, sender: int, iteration: int) -> None:
        self.node.count_drop("non_finite")
        self.node.record("non_finite", iter=self.iteration, src=sender, update_iter=iteration)

    def _note_activity(self) -> None:
        if self._activity is not None:
            self._activity.set()

    # ------------------------------------------------------------------ leaving
    async def quiesce(self) -> None:
        """A passive serves until every active neighbour is done or gone (its last step did
        already; a loop that stopped without one did not), then serves no more. An active has
        nothing in flight once its step returned."""
        if not self.active:
            await self._serve_until_actives_leave()
        self._leaving = True

    def on_peer_done(self, peer: int) -> None:
        """A passive that quiesced serves no more: an active still waiting for its reply was not
        served (the passive replies before it says done). An active that quiesced asks no more."""
        self.done.add(peer)
        self._note_activity()
        if self._awaited == peer and self._reply is not None and not self._reply.done():
            self._reply.set_result(False)

    async def stop(self) -> None:
        """Say goodbye to the neighbours still here. A passive that finished its last step has
        none left (it served until every active said goodbye); one leaving early serves no
        more requests from here on."""
        self._leaving = True
        await self.say_goodbye(peer for peer in self.neighbours if peer not in self.gone)

    async def _serve_until_actives_leave(self) -> None:
        """A passive's last step returns once every active neighbour said goodbye, so the model
        its trainer holds after the loop is final. The timeout counts silence: each request or
        goodbye restarts it."""
        activity = self._activity
        assert activity is not None
        loop = asyncio.get_running_loop()
        began = loop.time()
        # The trainer is blocked and every averaging served here is atomic on the loop: between two,
        # the model is consistent, and a neighbour's replacement may take it (a passive's donor has
        # often run its loop to the end before an active dies).
        self.node.handover_point()
        try:
            if self.node.lanes is not None:
                await self._serve_agreed_until_none_left()
            else:
                await self._serve_until_none_left(activity)
        finally:
            self.node.handover_point(False)
        self.node.waited("updates", loop.time() - began)

    async def _serve_until_none_left(self, activity: asyncio.Event) -> None:
        while remaining := [p for p in self.neighbours if p not in self.gone and p not in self.done]:
            activity.clear()
            try:
                await self.node.clock.wait(activity.wait(), f"requests or goodbyes from active neighbour(s) "
                                           f"{', '.join(map(str, remaining))} after the last iteration",
                                           peer=remaining[0], iteration=self.iteration)
            except WaitTimeout as exc:
                raise WaitTimeout(exc.what, peer=remaining[0], iteration=self.iteration, waited_s=exc.waited_s,
                                  peer_state=self.node.peer_state(remaining[0])) from None

    # ------------------------------------------------------------------ a lane of a replica group
    async def _serve_agreed(self) -> frozenset[int]:
        """Serve the requests every lane of this passive's replica holds, in the actives' order, so each
        lane averages its shard with the same actives at the same point; the others wait for the next
        boundary. What every lane knows has finished comes back (actives gone, or done)."""
        lanes = self.node.lanes
        assert lanes is not None
        n = self.node.graph.n
        finished = [n + p for p in self.neighbours if p in self.gone or p in self.done]
        common, _ = await lanes.common([*self._held, *finished], 0, candidates=2 * n)
        for active in sorted(p for p in common if p < n):
            msg = self._held.pop(active)
            if active not in self.gone:
                self._serve(msg)
        for active in [p for p in self._held if p in self.gone]:
            del self._held[active]
        return frozenset(p - n for p in common if p >= n)

    async def _serve_agreed_until_none_left(self) -> None:
        """The last step of a passive lane: serve agreed requests until every lane knows every active
        neighbour is done or gone; ``--timeout`` counts time without an averaging served."""
        clock = self.node.clock
        quiet_since = clock.now()
        while True:
            served = self.served
            finished = await self._serve_agreed()
            remaining = [p for p in self.neighbours if p not in finished]
            if not remaining:
                return
            if self.served != served:
                quiet_since = clock.now()
            elif clock.now() - quiet_since > self.config.timeout_s:
                raise WaitTimeout(f"requests or goodbyes from active neighbour(s) {', '.join(map(str, remaining))} "
                                  "after the last iteration, that every lane of the replica has",
                                  peer=remaining[0], iteration=self.iteration, waited_s=clock.now() - quiet_since,
                                  peer_state=self.node.peer_state(remaining[0]))
            await asyncio.sleep(LANE_POLL_S)

    # ------------------------------------------------------------------ peers leaving
    def on_peer_departed(self, peer: int, last_iteration: int) -> None:
        self._gone(peer, "departed")

    def on_peer_dead(self, peer: int) -> None:
        self._gone(peer, "dead")

    def _gone(self, peer: int, state: str) -> None:
        self.gone.setdefault(peer, state)
        self._request_buffers.pop(peer, None)
        self._note_activity()
        if self._awaited != peer or self._reply is None or self._reply.done():
            return
        if state == "departed":
            self._reply.set_result(False)  # it replies before saying bye: our request was never served
        elif self.node.survives_losses:
            # Its side may have averaged, but that side is gone (a replacement, if any, takes a live
            # neighbour's model). This model is as the averaging found it: skip it and go on.
            self._reply.set_result(False)
        else:
            self._reply.set_exception(PeerFailure(
                f"rank {self.rank}: passive partner {peer} went silent (dead) during the averaging of "
                f"iteration {self.iteration} (rank {peer} unreachable from rank {self.rank}); "
                "its side may or may not have averaged",
                peer=peer, peer_state="dead", iteration=self.iteration))

    def on_peer_rejoined(self, peer: int) -> None:
        self.gone.pop(peer, None)
        self.done.discard(peer)
        self._note_activity()

    # ------------------------------------------------------------------ receiving
    def buffers_for(self, header: Header) -> Any:
        kind = header.kind
        if kind not in (REQUEST, REPLY):
            return None
        if header.specs != self.specs:
            self.node.count_drop("bad_payload")
            return DISCARD
        if kind == REPLY:
            if self.active and header.src == self._awaited and self._reply_buffers is not None:
                return self._reply_buffers
            self.node.count_drop("unexpected_reply")
            return DISCARD
        if self.active or self._leaving or header.src not in self.neighbours or header.src in self.gone:
            self.node.count_drop("unexpected_request")
            return DISCARD
        buffers = self._request_buffers.get(header.src)
        if buffers is None:
            buffers = self._request_buffers[header.src] = [torch.empty_like(f) for f in self.flats]
        return buffers

    def on_message(self, msg: Message) -> None:
        if msg.kind == REQUEST and msg.tensors and self._early_requests is not None:
            self._early_requests.append(msg)  # before start: the model may not be the one it trains
            return
        if msg.kind == REQUEST and msg.tensors:
            if msg.src in self.gone or self._leaving:
                self.node.count_drop("unexpected_request")  # its active is gone, or this passive left
                return
            if self.node.lanes is not None:
                self._held[msg.src] = msg  # served once every lane of the replica has it
                return
            self._serve(msg)
            self._note_activity()
        elif msg.kind == REPLY and msg.tensors and self._reply is not None and not self._reply.done() \
                and msg.src == self._awaited:
            self._reply.set_result(True)
        else:
            self.node.count_drop("unexpected_kind")

    # ------------------------------------------------------------------ records
    def snapshot(self) -> dict[str, Any]:
        if self.active:
            return {"partner": self._partner_now}
        return {"served": self._served_this_iteration}

    def summary(self) -> dict[str, Any]:
        if self.active:
            return {"role": "active", "averagings": sum(p is not None for p in self.partners),
                    "averagings_skipped": len(self.skips)}
        return {"role": "passive", "averagings_served": self.served}


__all__ = ["AdPsgdProtocol", "Averaging"]

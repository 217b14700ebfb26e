"""Hop: queue-based decentralized training (Hop, ASPLOS'19, Sec. 3-6).

One class covers the settings of Hop's Table 1, combined as the paper combines them:

* standard decentralized training, parallel (default) or serial approach (Sec. 3.2),
  with token queues bounding the gap between neighbours by ``max_ig`` (Fig. 7);
* backup workers (Fig. 8): a worker needs ``|N_in(i)| - N_buw(i)`` updates of its
  iteration and takes whatever else of that iteration has already arrived;
* bounded staleness (Fig. 9): the newest update per in-neighbour, if no older than
  ``k - s``, mixed with the iteration-weighted average of Eq. 2;
* iteration skipping (Sec. 5) for a worker that finds itself far behind;
* notify-ack (Sec. 3.3), the baseline Hop improves on: a worker enters iteration
  ``k`` only once every out-neighbour has acknowledged consuming its update ``k - 1``.

Slow links. With bounded staleness a receiver only ever uses the newest update of each
in-neighbour, so an update that has not left this process when a newer one is ready is
worthless: updates go by ``post_latest`` (on a link slower than the worker, at most one
waits per out-neighbour, the newest), and credits go as tokens on the transport's express
lane, behind no update bytes. A fast worker then runs at its own pace across a slow link
instead of the link's: backup workers spare it the wait for the remote update, and the
tokens keep the gap bound. Without staleness every update of an iteration may be needed,
so nothing is replaced and credits ride on the updates.

Tokens travel as credits. When a worker enters iteration ``k`` it grants its
in-neighbours a token; where the in-neighbour is also an out-neighbour the credit
rides on the update it sends anyway, so a symmetric graph pays no extra message.
The grants also tell a worker which iteration each out-neighbour has reached, which
is all it needs to skip sending updates that would arrive late (Sec. 6.2), with no
round trip.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hopnet.config import ProtocolConfig
from hopnet.config_checks import graph_in_words
from hopnet.errors import ConfigError, PeerFailure, ProtocolError, WaitTimeout
from hopnet.finite import all_finite_in
from hopnet.graph import Graph
from hopnet.model_state import ModelState
from hopnet.options import ProtocolOptions, option
from hopnet.output_spec import SKIPS, TOKENS_WAIT, UPDATES_WAIT, Count, OutputSpec, Wait
from hopnet.protocols.base import ApplyFn, Protocol
from hopnet.registry import Averages, MessageKind, ProtocolSpec, register
from hopnet.runtime.mix_sums import MixSums, mix_into
from hopnet.runtime.services import NodeServices
from hopnet.runtime.queues import BufferPool, TokenCredits, Update, UpdateQueue
from hopnet.transports.base import DISCARD
from hopnet.wire import Header, Message, TensorSpec

CREDIT = "c"
WELCOME = "hop_welcome"
"""Worker -> a neighbour's replacement (``--max-restarts``): the iteration it is in, and, when it
sends updates to that neighbour, its update of that iteration (the one the dead process got)."""


_ANY_SENDER = -1
"""The receive pool's one key (see :class:`BufferPool`): buffers are shared by all senders."""


class HopProtocol(Protocol):
    name = "hop"

    def __init__(self, config: ProtocolConfig, options: HopOptions, model: ModelState | torch.Tensor | None, *,
                 notify_ack: bool = False) -> None:
        super().__init__()
        state = ModelState.wrap(model)
        flats = state.flats if state is not None else []
        if any(f.dim() != 1 or not f.is_contiguous() for f in flats):
            raise ConfigError("Hop mixes flat, contiguous tensors (see hopnet.model_state.ModelState)")
        self.config = config
        self.options = options
        self.flats = flats
        """What an update carries and the reduce mixes: the model's flat tensors (parameters and
        floating buffers, one per dtype), all with the same weights."""
        self.notify_ack = notify_ack
        self.use_tokens = options.token_queues and not self.notify_ack
        self.staleness = options.staleness
        self.specs = tuple(TensorSpec(f.dtype, tuple(f.shape)) for f in flats)
        self.skipped_iterations = 0
        self.late_updates_dropped = 0
        self.updates_not_sent = 0
        self.skip_log: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ set-up
    def bind(self, node: NodeServices) -> None:
        super().bind(node)
        graph, rank = node.graph, node.rank
        self.rank = rank
        self.in_peers: tuple[int, ...] = graph.in_peers(rank)
        self.out_peers: tuple[int, ...] = graph.out_peers(rank)
        self._in_peer_set = frozenset(self.in_peers)
        self._out_peer_set = frozenset(self.out_peers)
        self.peers: tuple[int, ...] = tuple(sorted(self._in_peer_set | self._out_peer_set))
        self.self_weight = graph.weight(rank, rank)
        self.in_weight = {j: graph.weight(j, rank) for j in self.in_peers}
        self.n_buw = self.options.backup_workers_for(rank)
        if self.n_buw > len(self.in_peers):
            raise ConfigError(f"rank {rank} has {len(self.in_peers)} in-neighbours besides itself, "
                              f"so it cannot have {self.n_buw} backup workers")
        factory: Callable[[], list[torch.Tensor]] | None = None
        if self.flats:
            flats = self.flats
            factory = lambda: [torch.empty_like(f) for f in flats]  # noqa: E731
        self.num_slots = self._slots_needed(graph)
        # One pool for every sender: a buffer is held only while it is received, summed or (with
        # staleness) the newest update of its sender, so no sender needs buffers of its own.
        self.pool = BufferPool(factory, (_ANY_SENDER,), per_sender=1)
        self.queue = UpdateQueue(self.num_slots)
        self.summing = self.staleness is None and bool(self.flats)
        """Mix by accumulation (:mod:`hopnet.runtime.mix_sums`): the queue then only records which
        updates came. With staleness the newest update of a sender replaces its older one, which
        a sum could not take back, so the queue keeps the newest update's tensors until the reduce."""
        self.sums = MixSums(self._release)
        self.tokens = TokenCredits(self.out_peers, self.options.max_ig)
        self.acks: dict[int, int] = {j: -1 for j in self.out_peers}
        self.last_used: dict[int, int] = {j: -1 for j in self.in_peers}
        self.newest_received: dict[int, int] = {j: -1 for j in self.in_peers}
        self.departed_after: dict[int, int] = {}
        # --max-restarts: peers that came back as new processes; a replacement's view of its neighbours
        self._joined_late: set[int] = set()
        self.welcomes: dict[int, int] = {}
        self._welcomed: asyncio.Event | None = None
        self._rejoin_from = 0
        self._started_at: int | None = None

    def _slots_needed(self, graph: Graph) -> int:
        """Rotating slots: how far ahead an in-neighbour can be, plus how far back we still look."""
        if self.use_tokens:
            lead = self.options.max_ig
        elif self.notify_ack:
            lead = 2
        else:
            factor = 1 if self.staleness is None else self.staleness + 1
            back = graph.back_lengths()
            lead = factor * max((back[j, self.rank] for j in self.in_peers), default=1)
        return lead + (self.staleness or 0) + 1

    # ------------------------------------------------------------------ receiving
    def buffers_for(self, header: Header) -> Any:
        if header.kind == WELCOME and not header.specs:
            return None
        if header.kind not in ("update", WELCOME):
            return None
        if header.src not in self._in_peer_set:
            self.node.count_drop("update_from_non_in_neighbor")
            return DISCARD
        if not self.specs:
            if header.specs:
                self.node.count_drop("bad_payload")
                return DISCARD
            return None
        if header.specs != self.specs:
            self.node.count_drop("bad_payload")
            return DISCARD
        return self.pool.acquire(_ANY_SENDER)

    def _release(self, tensors: list[torch.Tensor] | None) -> None:
        self.pool.release(_ANY_SENDER, tensors)

    def _store(self, update: Update) -> bool:
        """Queue an update (False for a duplicate, whose buffers are given back); when summing, its
        tensors go into its iteration's sum (a non-finite update is counted, named and left out).
        Raises :class:`ProtocolError` (nothing released) past the queue's window."""
        tensors = update.tensors if self.specs else None
        if not self.summing:
            update.tensors = tensors
            if not self.queue.enqueue(update):
                self._release(tensors)
                return False
            return True
        update.tensors = None
        if not self.queue.enqueue(update):
            self._release(tensors)
            return False
        if tensors is None:
            return True
        if not all_finite_in(tensors):
            self._drop_non_finite(update.iter, update.src, update.iter)
            self._release(tensors)
            return True
        self.sums.add(update.iter, tensors, self.in_weight[update.src])
        return True

    def _drop_non_finite(self, k: int, src: int, update_iter: int) -> None:
        self.node.count_drop("non_finite")
        self.node.record("non_finite", iter=k, src=src, update_iter=update_iter)

    def on_message(self, msg: Message) -> None:
        kind = msg.kind
        if kind == WELCOME:
            self._on_welcome(msg)
            return
        if kind == "update" and msg.src in self._joined_late and self._beyond_window(msg.iter):
            # a replacement that started further ahead than this worker's queue reaches (it took the
            # furthest neighbour's pace): its update is dropped, as one would be on a lossy link
            self.node.count_drop("update_beyond_window")
            self._release(msg.tensors if self.specs else None)
            self._on_credit(msg)
            return
        if kind == "update":
            self._on_credit(msg)
            if msg.src not in self._in_peer_set:
                return
            if msg.iter > self.newest_received[msg.src]:
                self.newest_received[msg.src] = msg.iter
            if self._is_late(msg.iter, msg.src) or (self.staleness is not None
                                                    and msg.iter < self.queue.newest_iter(msg.src)):
                self.late_updates_dropped += 1
                self._release(msg.tensors if self.specs else None)
                return
            if self.staleness is not None:
                # Only the newest update per in-neighbour is ever used (Sec. 6.1): keep one.
                self._release_updates(self.queue.take(w_id=msg.src))
            self._store(Update(msg.iter, msg.src, msg.tensors))
        elif kind == "token":
            self._on_credit(msg)
        elif kind == "ack":
            if msg.src in self._out_peer_set and msg.iter > self.acks[msg.src]:
                self.acks[msg.src] = msg.iter
                self.tokens.wake()
        else:
            self.node.count_drop("unexpected_kind")

    def _on_credit(self, msg: Message) -> None:
        meta = msg.meta
        if not meta or CREDIT not in meta:
            return
        count = meta[CREDIT]
        if msg.src not in self._out_peer_set or not isinstance(count, int) or count < 1:
            self.node.count_drop("bad_credit")
            return
        self.tokens.grant(msg.src, count, msg.iter)

    def _oldest_useful(self) -> int:
        return self.iteration - (self.staleness or 0)

    def _is_late(self, iteration: int, src: int) -> bool:
        if iteration < self._oldest_useful():
            return True
        return self.staleness is not None and iteration <= self.last_used[src]

    def on_peer_departed(self, peer: int, last_iteration: int) -> None:
        self.departed_after[peer] = last_iteration
        if peer in self._out_peer_set:
            self.tokens.depart(peer)
        self.queue.wake()

    def on_peer_dead(self, peer: int) -> None:
        # Nothing is on its way from a dead peer: the newest update it sent is its last.
        self.on_peer_departed(peer, self.newest_received.get(peer, -1))

    # ------------------------------------------------------------------ replacements (--max-restarts)
    def _check_restartable(self) -> None:
        refusal = _restart_refusal(self.options, self.config.protocol)
        if refusal is not None:
            raise ConfigError(f"--max-restarts: {refusal}")

    def on_peer_rejoined(self, peer: int) -> None:
        """A neighbour's replacement joined: count it in again as if it were in this worker's iteration
        (its own grants correct that), and tell it where this worker is, with the update of this
        iteration that the dead process got (the model has not changed since: the reduce comes at
        the end of the iteration)."""
        self._check_restartable()
        if peer not in self.peers:
            return
        k = self.iteration
        self.departed_after.pop(peer, None)
        self._joined_late.add(peer)
        if peer in self._out_peer_set:
            # as if it were about to enter this iteration: its entry (begin) grants that token itself
            self.tokens.readmit(peer, entered=k)
            self.acks[peer] = k - 1
        if peer in self._in_peer_set:
            self.last_used[peer] = min(self.last_used[peer], k - 1)
        tensors = list(self.flats) if peer in self._out_peer_set and self.flats else []
        self.node.post(Message(WELCOME, self.rank, peer, k, tensors=tensors))
        self.queue.wake()

    def rejoin_at(self, iteration: int, state: Mapping[str, Any]) -> None:
        self._check_restartable()
        super().rejoin_at(iteration, state)
        self._rejoin_from = iteration

    def _on_welcome(self, msg: Message) -> None:
        if msg.src not in self.peers:
            self.node.count_drop("unexpected_welcome")
            return
        self.welcomes[msg.src] = msg.iter
        if msg.tensors and msg.src in self._in_peer_set:
            try:
                self._store(Update(msg.iter, msg.src, msg.tensors))
            except ProtocolError:  # neighbours further apart than the queue reaches: this one is not needed
                self.node.count_drop("welcome_beyond_window")
                self._release(msg.tensors)
            else:
                self.newest_received[msg.src] = max(self.newest_received[msg.src], msg.iter)
        elif msg.tensors:
            self._release(msg.tensors)
        if self._started_at is not None:  # late: it gets its fillers now
            self._fill(msg.src, msg.iter, self._started_at)
        if self._welcomed is not None:
            self._welcomed.set()

    async def after_rejoin(self) -> None:
        """The replacement hears where each neighbour is (``--peer-timeout`` at most), starts at the
        furthest in-neighbour's iteration, so that every in-neighbour still sends it that iteration's
        update, and sends each out-neighbour behind it what the dead process owed: its model as the
        updates of the iterations between (with their tokens)."""
        node = self.node
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.peer_timeout_s
        while True:
            live = [p for p in self.peers if p not in node.dead and p not in node.departed]
            missing = [p for p in live if p not in self.welcomes]
            if not missing or loop.time() >= deadline:
                break
            self._welcomed = asyncio.Event()
            try:
                await asyncio.wait_for(self._welcomed.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                break
        self._welcomed = None
        ahead = [self.welcomes[p] for p in self.in_peers if p in self.welcomes]
        start = max([self._rejoin_from, *ahead])
        self.iteration = start
        # Welcomes of earlier iterations must not hold the queue's slots: the neighbours' updates of the
        # iterations ahead arrive before the trainer's loop begins.
        self._discard_older_than(start - (self.staleness or 0))
        self.acks = {j: start - 1 for j in self.acks}
        self.last_used = {j: start - 1 for j in self.last_used}
        self.newest_received = {j: max(start - 1, self.newest_received[j]) for j in self.newest_received}
        self.tokens.restart_at(start, {p: self.welcomes[p] + 1 for p in self.out_peers if p in self.welcomes})
        for peer in self.peers:
            if peer not in self.welcomes:
                self.departed_after[peer] = start - 1  # gone, or silent: handled as gone until it speaks
        self._started_at = start
        for peer, at in self.welcomes.items():
            self._fill(peer, at, start)
        node.record("hop_rejoined", iter=start, welcomes={str(p): k for p, k in sorted(self.welcomes.items())})

    def _fill(self, peer: int, at: int, start: int) -> None:
        """Send ``peer`` (in iteration ``at``) this worker's updates of ``at .. start - 1`` and the tokens of
        the iterations between, so that neither waits for what the dead process would have sent."""
        if at >= start:
            return
        if self.notify_ack and peer in self._in_peer_set:  # it enters an iteration once this one acked the last
            self.node.post(Message("ack", self.rank, peer, start - 1))
        # The neighbour counted this worker as about to enter ``at`` (on_peer_rejoined); the entry into
        # ``start`` grants its own token (begin): these are the ones of the iterations between.
        credit = start - at if self.use_tokens else 0
        if peer in self._out_peer_set:
            first = max(at, start - self.num_slots + 1)
            for tag in range(first, start):
                meta = {CREDIT: credit} if credit and peer in self._in_peer_set and tag == first else None
                self.node.post(Message("update", self.rank, peer, tag, meta=meta, tensors=list(self.flats)))
        elif credit and peer in self._in_peer_set:
            self.node.post(Message("token", self.rank, peer, start - 1, meta={CREDIT: credit}))

    def _beyond_window(self, iteration: int) -> bool:
        return iteration >= self.iteration + self.num_slots - (self.staleness or 0)

    def _expected(self, k: int) -> Sequence[int]:
        """In-neighbours that will still send an update of iteration ``k``."""
        gone = self.departed_after
        if not gone:
            return self.in_peers
        return [j for j in self.in_peers if gone.get(j, k) >= k]

    # ------------------------------------------------------------------ iteration flow
    async def start(self) -> None:
        """Nothing yet: iteration 0 is entered (and the model sent) in :meth:`begin`."""

    def resume_at(self, iteration: int) -> None:
        super().resume_at(iteration)
        # Every rank resumes at ``iteration``: no ack of an earlier one will come.
        self.acks = {j: iteration - 1 for j in self.acks}
        self.last_used = {j: iteration - 1 for j in self.last_used}
        self.newest_received = {j: iteration - 1 for j in self.newest_received}

    async def begin(self) -> None:
        await self._enter(self.iteration, 1)

    async def finish_iteration(self, apply: ApplyFn | None, *, last: bool = False) -> None:
        k = self.iteration
        if self.options.serial:
            if apply is not None:
                apply()
            self._send_updates(k, credit=0)
            updates, iters = await self._recv(k)
            await self.node.flush()
            self._reduce(updates, iters, k)
        else:
            updates, iters = await self._recv(k)
            await self.node.flush()
            self._reduce(updates, iters, k)
            if apply is not None:
                apply()
        if self.notify_ack:
            for j in self.in_peers:
                if j not in self.departed_after:
                    self.node.post(Message("ack", self.rank, j, k))
        self.node.iteration_done(k, self)
        if last:
            return
        target = await self._maybe_skip(k)
        if self.use_tokens:
            await self._wait(lambda: self.tokens.available(target - k), self.tokens,
                             lambda: ("tokens", self.tokens.missing(target - k)), target)
            await self.tokens.acquire(target - k)
        await self._enter(target, target - k)

    async def stop(self) -> None:
        await self.say_goodbye(peer for peer in self.peers if peer not in self.departed_after)

    async def _maybe_skip(self, k: int) -> int:
        """Sec. 5: jump ahead when more than ``skip_threshold`` behind every out-neighbour."""
        threshold, max_jump = self.options.skip_threshold, self.options.max_jump
        if threshold is None or max_jump is None:
            return k + 1
        behind = self.tokens.min_lead()
        if behind is None or behind <= threshold:
            return k + 1
        target = k + 1 + min(max_jump, behind - 1)
        # Before jumping to ``target`` the worker needs its in-neighbours' updates of target - 1,
        # and an in-neighbour cannot get more than max_ig iterations ahead of this worker (it
        # needs this worker's tokens). On a directed graph an out-neighbour may be further ahead
        # than that, so cap the jump where the in-neighbours can still deliver.
        target = min(target, k + self.options.max_ig)
        if self.final_iteration is not None:
            target = min(target, self.final_iteration)
        if target <= k + 1:
            return k + 1
        # Renew the parameters with the in-neighbours' updates of iteration target - 1.
        updates, iters = await self._recv(target - 1)
        self._reduce(updates, iters, target - 1)
        self.skipped_iterations += target - k - 1
        self.skip_log.append({"rank": self.rank, "iter": k, "to": target, "behind": behind,
                              "t": round(self.node.clock.now(), 9)})
        self.node.record("skip", iter=k, to=target, behind=behind)
        return target

    async def _enter(self, k: int, count: int) -> None:
        """Enter iteration ``k`` having advanced ``count`` iterations: grant, then send (parallel)."""
        self.iteration = k
        self._discard_older_than(self._oldest_useful())
        if self.notify_ack and k > 0:
            await self._wait(lambda: all(self.acks[j] >= k - 1 for j in self._live_out()), self.tokens,
                             lambda: ("acks", [j for j in self._live_out() if self.acks[j] < k - 1]), k)
        self.node.entered(k, self)
        credit = count if self.use_tokens else 0
        if self.options.serial:
            if credit:
                for j in self.in_peers:
                    if j not in self.departed_after:
                        self.node.post(Message("token", self.rank, j, k, meta={CREDIT: credit}))
        else:
            self._send_updates(k, credit)

    def _live_out(self) -> list[int]:
        return [j for j in self.out_peers if j not in self.departed_after]

    def _send_updates(self, k: int, credit: int) -> None:
        payload = self.flats
        known = self.tokens.known_iter
        # An out-neighbour already in iteration m uses updates no older than m - s (s = 0
        # without staleness); anything older would be dropped on arrival, so it is not sent.
        newest_useful = k + (self.staleness or 0)
        gone = self.departed_after
        newest_only = self.staleness is not None
        for peer in self.peers:
            if peer in gone:
                continue  # it left: nothing sent to it would be read
            meta = {CREDIT: credit} if credit and peer in self._in_peer_set else None
            if peer in self._out_peer_set and known[peer] <= newest_useful:
                if newest_only:
                    self.node.post_latest(Message("update", self.rank, peer, k, tensors=payload))
                    if meta is not None:
                        self.node.post_express(Message("token", self.rank, peer, k, meta=meta))
                    continue
                self.node.post(Message("update", self.rank, peer, k, meta=meta, tensors=payload))
            else:
                if peer in self._out_peer_set:
                    self.updates_not_sent += 1
                if meta is not None:
                    self.node.post(Message("token", self.rank, peer, k, meta=meta))

    async def _recv(self, k: int) -> tuple[list[Update], list[int]]:
        if self.staleness is not None:
            return await self._recv_stale(k)
        need = len(self.in_peers) - self.n_buw
        while True:
            await self._wait(lambda: self.queue.size(iter=k) >= min(need, len(self._expected(k)))
                             or self._short_of_peers(k, need), self.queue,
                             lambda: ("updates", self._missing_updates(k)), k)
            if not (self._short_of_peers(k, need) and self.queue.size(iter=k) < need):
                break
            await self._await_replacements(k, need)
        updates = self.queue.take(iter=k)
        return updates, [u.iter for u in updates]

    async def _await_replacements(self, k: int, need: int) -> None:
        """Iteration ``k`` needs the update of a dead in-neighbour: under ``--max-restarts`` wait for its
        replacement (``--timeout`` at most), which sends what the dead process owed; else fail naming it."""
        dead = [j for j in self.in_peers if j in self.node.dead]
        if not self.node.max_restarts or not dead:
            raise self._peer_failure(k, need)
        self.node.handover_point()
        try:
            await self.node.wait_for_rejoins(f"rank {self.rank}'s updates of iteration {k}")
        finally:
            self.node.handover_point(False)

    def _short_of_peers(self, k: int, need: int) -> bool:
        return len(self._expected(k)) < need

    def _peer_failure(self, k: int, need: int) -> PeerFailure:
        """Iteration ``k`` needs an update that departed or dead in-neighbours will never send."""
        gone = sorted(j for j in self.in_peers if j not in self._expected(k))
        # Blame a peer that said nothing before one that said goodbye: a dead peer is the cause,
        # the others may only have left because of it.
        peer = next((j for j in gone if self.node.peer_state(j) == "dead"), gone[0])
        state = self.node.peer_state(peer)
        need_text = (f"rank {self.rank} needs {need} of its {len(self.in_peers)} in-neighbours' "
                     f"updates with {self.n_buw} backup workers")
        others = [j for j in gone if j != peer]
        also = f"; in-neighbour(s) {others} are gone too" if others else ""
        if state == "dead":
            silent = self.node.dead.get(peer, 0.0)
            message = (f"rank {self.rank} cannot finish iteration {k}: peer {peer} went silent "
                       f"(dead: nothing heard from it for {silent:.1f}s; its process died or hangs, "
                       f"or its host is unreachable) and {need_text}{also}")
        else:
            message = self._departure_text(peer, k, need_text) + also
        return PeerFailure(message, peer=peer, peer_state=state, iteration=k)

    def _departure_text(self, peer: int, k: int, need_text: str) -> str:
        last = self.departed_after[peer]
        final = self.node.final_iterations.get(peer)
        mine = self.final_iteration
        if final is not None and last >= final and (mine is None or mine > final):
            runs_to = f"runs to iteration {mine}" if mine is not None else f"needs its update of iteration {k}"
            return (f"peer {peer} finished at iteration {final} but rank {self.rank} {runs_to}: "
                    "every rank must run the same number of iterations")
        if final is not None and last < final:
            return (f"rank {self.rank} cannot finish iteration {k}: peer {peer} left at iteration "
                    f"{last}, before its last iteration {final}, and {need_text}")
        return (f"rank {self.rank} cannot finish iteration {k}: peer {peer} left after iteration "
                f"{last} and {need_text}")

    def _missing_updates(self, k: int) -> list[int]:
        return [j for j in self._expected(k) if not self.queue.size(iter=k, w_id=j)]

    async def _recv_stale(self, k: int) -> tuple[list[Update], list[int]]:
        """Fig. 9 (as its text describes): newest update per in-neighbour if >= k - s."""
        oldest = k - (self.staleness or 0)
        need = len(self.in_peers) - self.n_buw

        def fresh_peers() -> list[int]:
            return [j for j in self.in_peers
                    if self.last_used[j] >= oldest or self._newest_from(j) >= oldest]

        def satisfied() -> bool:
            return len(fresh_peers()) >= min(need, len(self._expected(k)))

        while True:
            await self._wait(satisfied, self.queue,
                             lambda: ("an update no older than iteration %d" % oldest,
                                      [j for j in self._expected(k) if j not in fresh_peers()]), k)
            if not (len(self._expected(k)) < need and len(fresh_peers()) < need):
                break
            await self._await_replacements(k, need)
        chosen: list[Update] = []
        stale: list[Update] = []
        for j in self.in_peers:
            entries = self.queue.take(w_id=j)
            if not entries:
                continue
            newest = max(entries, key=lambda u: u.iter)
            stale.extend(u for u in entries if u is not newest)
            if newest.iter >= oldest and newest.iter > self.last_used[j]:
                self.last_used[j] = newest.iter
                chosen.append(newest)
            else:
                stale.append(newest)
        self._release_updates(stale)
        return chosen, [u.iter for u in chosen]

    def _discard_older_than(self, iteration: int) -> None:
        self._release_updates(self.queue.take_older_than(iteration))
        self.sums.discard_older_than(iteration)

    def _release_updates(self, updates: list[Update]) -> None:
        for update in updates:
            self._release(update.tensors)
            update.tensors = None

    def _newest_from(self, j: int) -> int:
        return self.queue.newest_iter(j)

    async def _wait(self, ready: Callable[[], bool], waitable: UpdateQueue | TokenCredits,
                    describe: Callable[[], tuple[str, Sequence[int]]], k: int) -> None:
        """Wait until ``ready()``; on timeout, name what was missing and from whom."""
        if ready():
            return
        node = self.node
        began = node.timer()
        # The peers still missing when the wait was last re-checked: the ones whose arrival ended it.
        missing = list(describe()[1])

        def tracked() -> bool:
            if ready():
                return True
            missing[:] = describe()[1]
            return False

        # Waiting here, the model is consistent (the reduce comes after): a neighbour's replacement may
        # take it now (in a strict run it may be what this worker waits for).
        node.handover_point()
        try:
            await node.clock.wait(waitable.wait_until(tracked), "", iteration=k)
        except WaitTimeout as exc:
            what, peers = describe()
            peer = peers[0] if peers else None
            raise WaitTimeout(f"{what} (rank {self.rank})", peer=peer,
                              peer_state=self.node.peer_state(peer) if peer is not None else None,
                              iteration=k, waited_s=exc.waited_s) from None
        finally:
            node.handover_point(False)
            still = set(describe()[1])
            node.waited("updates" if waitable is self.queue else "tokens", node.timer() - began,
                        [j for j in missing if j not in still] or missing)

    # ------------------------------------------------------------------ mixing
    def _reduce(self, updates: list[Update], iters: list[int], k: int) -> None:
        """Weighted average of this worker's parameters and the received ones (Eq. 1 / Eq. 2)."""
        if self.summing:
            summed = self.sums.pop(k)  # what came of iteration k: at least the updates taken
            if summed is not None:
                mix_into(self.flats, self.self_weight, summed)
                self._release(summed.tensors)
            return
        if not self.flats or not updates:
            self._release_updates(updates)
            return
        updates, iters = self._finite_only(updates, iters, k)
        if self.staleness is None:
            weights = [self.in_weight[u.src] for u in updates]
            own = self.self_weight
        else:
            base = k - self.staleness
            weights = [self.in_weight[u.src] * (it - base + 1) for u, it in zip(updates, iters)]
            own = self.self_weight * (self.staleness + 1)
        total = own + sum(weights)
        for i, flat in enumerate(self.flats):
            flat.mul_(own / total)
            for update, weight in zip(updates, weights):
                assert update.tensors is not None
                flat.add_(update.tensors[i], alpha=weight / total)
        self._release_updates(updates)

    def _finite_only(self, updates: list[Update], iters: list[int], k: int) -> tuple[list[Update], list[int]]:
        """Leave a non-finite update out of the mix (dropped, counted, its sender named)."""
        kept = [(u, it) for u, it in zip(updates, iters) if u.tensors is None or all_finite_in(u.tensors)]
        if len(kept) == len(updates):
            return updates, iters
        for update in updates:
            if all(update is not u for u, _ in kept):
                self._drop_non_finite(k, update.src, update.iter)
                self._release_updates([update])
        return [u for u, _ in kept], [it for _, it in kept]

    def summary(self) -> dict[str, Any]:
        return {"queue_high_water": self.queue.high_water,
                "token_high_water": self.tokens.high_water if self.use_tokens else None,
                "skipped_iterations": self.skipped_iterations,
                "late_updates_dropped": self.late_updates_dropped, "updates_not_sent": self.updates_not_sent,
                "buffers_allocated": self.pool.allocated, "sums_high_water": self.sums.high_water}

    def snapshot(self) -> dict[str, Any]:
        snap: dict[str, Any] = {"queue": len(self.queue)}
        if self.use_tokens:
            snap["tokens"] = {str(j): self.tokens.tokens(j) for j in self.out_peers}
        return snap



# ---------------------------------------------------------------------- options
def parse_backup_workers(text: str | int | dict[int, int] | dict[str, int] | None) -> int | dict[int, int]:
    """``N`` (every rank) or ``R:N,R:N`` (per rank; unnamed ranks get 0)."""
    if text is None:
        return 0
    if isinstance(text, bool):
        raise ConfigError(f"--backup-workers must be a count, not {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"--backup-workers must be >= 0 (got {text})")
        return text
    if isinstance(text, dict):
        return {int(k): int(v) for k, v in text.items()}
    text = text.strip()
    if ":" not in text:
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(f"--backup-workers {text!r}: expected N or R:N,R:N") from None
        if value < 0:
            raise ConfigError(f"--backup-workers must be >= 0 (got {value})")
        return value
    result: dict[int, int] = {}
    for item in text.split(","):
        try:
            rank_text, count_text = item.split(":")
            rank, count = int(rank_text), int(count_text)
        except ValueError:
            raise ConfigError(f"--backup-workers {text!r}: expected N or R:N,R:N") from None
        if rank < 0 or count < 0:
            raise ConfigError(f"--backup-workers {text!r}: ranks and counts must be >= 0")
        if rank in result:
            raise ConfigError(f"--backup-workers {text!r}: rank {rank} given twice")
        result[rank] = count
    return result


DEFAULT_MAX_IG = 2


@dataclass(frozen=True)
class HopOptions(ProtocolOptions):
    """Hop's options (Table 1's settings)."""

    max_ig: int = option(DEFAULT_MAX_IG, minimum=1, metavar="N",
                         help="maximum iteration gap between neighbours, via token queues")
    token_queues: bool = option(True, help="turn token queues off (the gap is then bounded by path lengths only)")
    serial: bool = option(False, help="serial approach: compute, apply, send, then reduce (default: parallel)")
    backup_workers: int | dict[int, int] = option(0, metavar="N|R:N,...", parse=parse_backup_workers,
                                                  help="updates a worker may go without per iteration: one "
                                                       "number or per rank")
    staleness: int | None = option(None, minimum=0, metavar="S",
                                   help="bounded staleness: use neighbours' newest update if no older than k-S")
    skip_threshold: int | None = option(None, minimum=1, metavar="T",
                                        help="skip iterations when more than T behind every out-neighbour")
    max_jump: int | None = option(None, minimum=1, metavar="J", help="at most J iterations per skip")

    def __post_init__(self) -> None:
        object.__setattr__(self, "backup_workers", parse_backup_workers(self.backup_workers))
        super().__post_init__()

    def check(self) -> None:
        if (self.max_jump is None) != (self.skip_threshold is None):
            raise ConfigError("--skip-threshold and --max-jump go together")
        if self.skip_threshold is not None and not self.token_queues:
            raise ConfigError("iteration skipping needs token queues (it reads them to spot a straggler)")
        if self.has_backup_workers and not self.token_queues:
            raise ConfigError("backup workers need token queues: without them the iteration gap is unbounded")

    def check_ranks(self, world_size: int) -> None:
        if isinstance(self.backup_workers, dict):
            bad = sorted(r for r in self.backup_workers if r >= world_size)
            if bad:
                raise ConfigError(f"--backup-workers: rank {bad[0]} out of range (there are {world_size} workers)")

    @property
    def has_backup_workers(self) -> bool:
        bw = self.backup_workers
        return any(v > 0 for v in bw.values()) if isinstance(bw, dict) else bw > 0

    def backup_workers_for(self, rank: int) -> int:
        bw = self.backup_workers
        return bw.get(rank, 0) if isinstance(bw, dict) else bw

    def settings(self) -> list[str]:
        shown = [f"max_ig={self.max_ig}" if self.token_queues else "no token queues"]
        if self.serial:
            shown.append("serial")
        if self.backup_workers:
            shown.append(f"backup_workers={self.backup_workers}")
        if self.staleness is not None:
            shown.append(f"staleness={self.staleness}")
        if self.skip_threshold is not None:
            shown.append(f"skip_threshold={self.skip_threshold} max_jump={self.max_jump}")
        return shown


@dataclass(frozen=True)
class NotifyAckOptions(ProtocolOptions):
    """Notify-ack is a baseline: its gap of at most 2 leaves no room for backup workers, staleness,
    skipping or token queues (Sec. 3.4-3.5); only the approach is a choice."""

    serial: bool = option(False, help="serial approach: compute, apply, send, then reduce (default: parallel)")

    def as_hop(self) -> HopOptions:
        return HopOptions(serial=self.serial)


# ---------------------------------------------------------------------- checks against the graph
# What is refused, and why (Table 1 and Sec. 4-5; ``d(a, b)`` is the shortest path a -> b):
#
# * More backup workers at a rank than it has in-neighbours (Fig. 8 needs
#   ``N_buw(i) < |N_in(i)|`` with the self-loop counted).
# * Iteration skipping that can never trigger. A worker ``i`` skips when it is more than
#   ``T`` iterations behind every out-neighbour ``j``. How far ``j`` can get ahead of its
#   in-neighbour ``i`` is ``min(b0, max_ig * d(j, i))``: ``b0`` is 1 when ``j`` needs
#   ``i``'s update of every iteration, ``s + 1`` with staleness ``s`` and unbounded when
#   ``j`` has backup workers; the token queues give the second term. When ``T`` is not
#   below that for any worker, nothing ever skips. A jump is also capped at
#   ``max_ig - 1`` iterations (docs/design.md), so ``--max-ig 1`` never skips.
#
# What is accepted, with a note:
#
# * ``--staleness S`` that the token queues always pre-empt. Worker ``i`` can be at most
#   ``max_ig * d(i, j)`` iterations ahead of its in-neighbour ``j``, and with the parallel
#   approach the update that carries ``j``'s token is the update itself, so ``i`` always
#   holds an update no older than ``k - max_ig * d(i, j)`` (one older with ``--serial``).
#   When ``S`` is at least that on every edge, the bound never makes a worker wait, and
#   ``S`` only sets Eq. 2's mixing weights: asynchronous within the token bound, so not refused.
# * ``--max-jump J`` above ``max_ig - 1``: it acts as ``max_ig - 1``.
def check_hop_graph(config: ProtocolConfig, options: HopOptions, graph: Graph) -> list[str]:
    _check_backup_workers(options, graph)
    notes: list[str] = []
    # These checks need only each edge's way back (Graph.back_lengths), not the n x n path
    # lengths (O(n^2) memory: 800 MB at 10,000 workers).
    if options.skip_threshold is not None:
        notes.extend(_check_skipping(options, graph))
    if options.staleness is not None and options.token_queues:
        notes.extend(_staleness_notes(options, graph))
    return notes


def backup_workers_flag(options: HopOptions) -> str:
    """``--backup-workers`` as the user would have written it."""
    bw = options.backup_workers
    if isinstance(bw, dict):
        return "--backup-workers " + ",".join(f"{r}:{n}" for r, n in sorted(bw.items()))
    return f"--backup-workers {bw}"


def _check_backup_workers(options: HopOptions, graph: Graph) -> None:
    for rank in range(graph.n):
        wanted = options.backup_workers_for(rank)
        degree = len(graph.in_peers(rank))
        if wanted > degree:
            noun = "in-neighbour" if degree == 1 else "in-neighbours"
            raise ConfigError(f"{backup_workers_flag(options)}: rank {rank} of {graph_in_words(graph)} has "
                              f"{degree} {noun}, so it can go without at most {degree} of their updates")


def _lead_bound(options: HopOptions, back: Mapping[tuple[int, int], int], i: int, j: int) -> float:
    """How far out-neighbour ``j`` can ever get ahead of its in-neighbour ``i`` (Table 1);
    ``back[i, j]`` is d(j, i)."""
    if options.backup_workers_for(j) > 0:
        own = math.inf  # j can go on without i's updates
    elif options.staleness is not None:
        own = options.staleness + 1
    else:
        own = 1
    return min(own, options.max_ig * float(back[i, j]))


def largest_lead(options: HopOptions, graph: Graph) -> float:
    """The most any worker can ever be behind *all* its out-neighbours: what a skip threshold must stay below."""
    back = graph.back_lengths()
    best = 0.0
    for i in range(graph.n):
        outs = graph.out_peers(i)
        if outs:
            best = max(best, min(_lead_bound(options, back, i, j) for j in outs))
    return best


def _check_skipping(options: HopOptions, graph: Graph) -> list[str]:
    threshold, max_jump, max_ig = options.skip_threshold, options.max_jump, options.max_ig
    assert threshold is not None and max_jump is not None
    flag = f"--skip-threshold {threshold}"
    if max_ig < 2:
        raise ConfigError(f"{flag}: a jump is capped at max_ig - 1 iterations, so --max-ig {max_ig} "
                          "never skips (use --max-ig 2 or more)")
    lead = largest_lead(options, graph)
    if lead <= 1 and options.staleness is None and not options.has_backup_workers:
        raise ConfigError(f"{flag} is never passed: without --backup-workers or --staleness a worker is never "
                          "more than 1 iteration behind its out-neighbours (Hop Table 1), so nothing would skip")
    if threshold >= lead:
        limit = int(lead)
        if options.staleness is not None and not options.has_backup_workers and lead == options.staleness + 1:
            why = f"with --staleness {options.staleness}"
        elif lead == max_ig:
            why = f"with --max-ig {max_ig}"
        else:
            why = f"with these options on {graph_in_words(graph)}"
        hint = f" (use a threshold below {limit})" if limit >= 2 else ""
        raise ConfigError(f"{flag} is never passed: {why} no worker falls more than {limit} "
                          f"iteration{'s' if limit != 1 else ''} behind all its out-neighbours, "
                          f"so nothing would skip{hint}")
    notes = []
    if max_jump > max_ig - 1:
        notes.append(f"--max-jump {max_jump} acts as {max_ig - 1}: a jump is capped at max_ig - 1 iterations "
                     f"(--max-ig {max_ig})")
    return notes


def _staleness_notes(options: HopOptions, graph: Graph) -> list[str]:
    staleness = options.staleness
    assert staleness is not None
    extra = 1 if options.serial else 0
    back = graph.back_lengths()  # back[j, i] = d(i, j) for each in-neighbour j of i
    reach = max((options.max_ig * back[j, i] + extra for i in range(graph.n) for j in graph.in_peers(i)),
                default=0)
    if staleness < reach:
        return []
    return [f"--staleness {staleness} never makes a worker wait here: the token queues (--max-ig {options.max_ig}) "
            f"stop it first, so it only sets the mixing weights (a bound that binds is below {reach})"]


# ---------------------------------------------------------------------- the gap bound (Table 1)
def gap_bound(options: HopOptions, graph: Graph) -> np.ndarray:
    """The upper bound on Iter(i) - Iter(j) as an N x N matrix (inf = unbounded)."""
    d = graph.shortest_path_lengths().astype(float)
    forward = d.T  # forward[i][j] = length(Path j -> i)
    backward = d   # backward[i][j] = length(Path i -> j)
    if options.has_backup_workers:
        base = np.full_like(forward, np.inf)
    elif options.staleness is not None:
        base = (options.staleness + 1) * forward
    else:
        base = forward
    if options.token_queues:
        return np.minimum(base, options.max_ig * backward)
    return base


def gap_rule(options: HopOptions) -> str:
    """:func:`gap_bound` in words (len = shortest path length)."""
    tokens = f"{options.max_ig}·len(i→j)" if options.token_queues else None
    if options.has_backup_workers:
        base = None
    elif options.staleness is not None:
        base = f"{options.staleness + 1}·len(j→i)"
    else:
        base = "len(j→i)"
    if base is None:
        return tokens or "unbounded"
    return f"min({base}, {tokens})" if tokens else base


def notify_ack_gap_bound(options: NotifyAckOptions, graph: Graph) -> np.ndarray:
    d = graph.shortest_path_lengths().astype(float)
    return np.minimum(d.T, 2 * d)


def _restart_refusal(options: HopOptions, protocol: str = "hop") -> str | None:
    if options.serial:
        return f"--protocol {protocol} --serial cannot replace a dead worker"
    if protocol == "hop" and not options.token_queues:
        return "--protocol hop cannot replace a dead worker without token queues (its welcome counts on them)"
    return None


HOP_COUNTS = (Count(SKIPS, "skips"), Count("skipped_iterations", "iterations skipped", in_summary=False),
              Count("late_updates_dropped", "late updates dropped", in_summary=False),
              Count("updates_not_sent", "updates not sent", in_summary=False),
              Count("queue_high_water", "queue high water", "max", in_summary=False),
              Count("token_high_water", "token high water", "max", in_summary=False))
HOP_OUTPUT = OutputSpec(waits=(UPDATES_WAIT, TOKENS_WAIT), counts=HOP_COUNTS, gaps="neighbours")
NOTIFY_ACK_OUTPUT = OutputSpec(waits=(UPDATES_WAIT, Wait("wait_tokens_s", "wait for acknowledgements", "wait acks")),
                               counts=HOP_COUNTS, gaps="neighbours")

register(ProtocolSpec(
    name="hop",
    summary="Hop's queue-based decentralized training: each worker mixes its neighbours' updates, with "
            "token queues bounding the gap (--max-ig), and backup workers, bounded staleness and "
            "iteration skipping for stragglers.",
    options=HopOptions,
    build=lambda config, options, model, grads: HopProtocol(config, options, model),
    averages=Averages.MODELS,
    uses_graph=True,
    check_graph=check_hop_graph,
    gap_bound=gap_bound,
    gap_rule=gap_rule,
    simulated_without_tensors=True,
    resumable=True,
    restartable=True,
    restart_refusal=_restart_refusal,
    message_kinds=(MessageKind(WELCOME),),
    output=HOP_OUTPUT,
))

register(ProtocolSpec(
    name="notify-ack",
    summary="the baseline Hop improves on: a worker enters iteration k once every out-neighbour "
            "acknowledged its update k-1.",
    options=NotifyAckOptions,
    build=lambda config, options, model, grads: HopProtocol(config, options.as_hop(), model, notify_ack=True),
    averages=Averages.MODELS,
    uses_graph=True,
    gap_bound=notify_ack_gap_bound,
    gap_rule=lambda options: "min(len(j→i), 2·len(i→j))",
    simulated_without_tensors=True,
    resumable=True,
    restartable=True,
    restart_refusal=lambda options: _restart_refusal(options.as_hop(), "notify-ack"),
    message_kinds=(MessageKind(WELCOME),),
    output=NOTIFY_ACK_OUTPUT,
))

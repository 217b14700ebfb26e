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

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hopnet.config import ProtocolConfig
from hopnet.errors import ConfigError, PeerFailure, WaitTimeout
from hopnet.graph import Graph
from hopnet.protocols.base import ApplyFn, Protocol
from hopnet.runtime.services import NodeServices
from hopnet.runtime.queues import BufferPool, TokenCredits, Update, UpdateQueue
from hopnet.transports.base import DISCARD
from hopnet.wire import Header, Message, TensorSpec

CREDIT = "c"


class HopProtocol(Protocol):
    name = "hop"

    def __init__(self, config: ProtocolConfig, params: torch.Tensor | None) -> None:
        super().__init__()
        if params is not None and (params.dim() != 1 or not params.is_contiguous()):
            raise ConfigError("Hop mixes one flat, contiguous parameter buffer (see hopnet.FlatParams)")
        self.config = config
        self.params = params
        self.notify_ack = config.protocol == "notify-ack"
        self.use_tokens = config.token_queues and not self.notify_ack
        self.staleness = config.staleness
        self.spec = TensorSpec(params.dtype, tuple(params.shape)) if params is not None else None
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
        self.n_buw = self.config.backup_workers_for(rank)
        if self.n_buw > len(self.in_peers):
            raise ConfigError(f"rank {rank} has {len(self.in_peers)} in-neighbours besides itself, "
                              f"so it cannot have {self.n_buw} backup workers")
        factory: Callable[[], list[torch.Tensor]] | None = None
        if self.params is not None:
            params = self.params
            factory = lambda: [torch.empty_like(params)]  # noqa: E731
        self.num_slots = self._slots_needed(graph)
        self.pool = BufferPool(factory, self.in_peers, per_sender=min(2, self.num_slots))
        self.queue = UpdateQueue(self.num_slots, self.pool)
        self.tokens = TokenCredits(self.out_peers, self.config.max_ig)
        self.acks: dict[int, int] = {j: -1 for j in self.out_peers}
        self.last_used: dict[int, int] = {j: -1 for j in self.in_peers}
        self.newest_received: dict[int, int] = {j: -1 for j in self.in_peers}
        self.departed_after: dict[int, int] = {}

    def _slots_needed(self, graph: Graph) -> int:
        """Rotating slots: how far ahead an in-neighbour can be, plus how far back we still look."""
        if self.use_tokens:
            lead = self.config.max_ig
        elif self.notify_ack:
            lead = 2
        else:
            factor = 1 if self.staleness is None else self.staleness + 1
            lead = factor * max((graph.path_length(self.rank, j) for j in self.in_peers), default=1)
        return lead + (self.staleness or 0) + 1

    # ------------------------------------------------------------------ receiving
    def buffers_for(self, header: Header) -> Any:
        if header.kind != "update":
            return None
        if header.src not in self._in_peer_set:
            self.node.count_drop("update_from_non_in_neighbor")
            return DISCARD
        if self.spec is None:
            if header.specs:
                self.node.count_drop("bad_payload")
                return DISCARD
            return None
        if len(header.specs) != 1 or header.specs[0] != self.spec:
            self.node.count_drop("bad_payload")
            return DISCARD
        return self.pool.acquire(header.src)

    def on_message(self, msg: Message) -> None:
        kind = msg.kind
        if kind == "update":
            self._on_credit(msg)
            if msg.src not in self._in_peer_set:
                return
            if msg.iter > self.newest_received[msg.src]:
                self.newest_received[msg.src] = msg.iter
            if self._is_late(msg.iter, msg.src) or (self.staleness is not None
                                                    and msg.iter < self.queue.newest_iter(msg.src)):
                self.late_updates_dropped += 1
                self.pool.release(msg.src, msg.tensors if self.spec is not None else None)
                return
            payload = msg.tensors if self.spec is not None else None
            if self.staleness is not None:
                # Only the newest update per in-neighbour is ever used (Sec. 6.1): keep one.
                self.queue.release(self.queue.take(w_id=msg.src))
            self.queue.enqueue(Update(msg.iter, msg.src, payload))
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

    def _expected(self, k: int) -> Sequence[int]:
        """In-neighbours that will still send an update of iteration ``k``."""
        gone = self.departed_after
        if not gone:
            return self.in_peers
        return [j for j in self.in_peers if gone.get(j, k) >= k]

    # ------------------------------------------------------------------ iteration flow
    async def start(self) -> None:
        await self._enter(0, 1)

    async def finish_iteration(self, apply: ApplyFn | None, *, last: bool = False) -> None:
        k = self.iteration
        if self.config.serial:
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
        threshold, max_jump = self.config.skip_threshold, self.config.max_jump
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
        target = min(target, k + self.config.max_ig)
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
        self.queue.discard_older_than(self._oldest_useful())
        if self.notify_ack and k > 0:
            await self._wait(lambda: all(self.acks[j] >= k - 1 for j in self._live_out()), self.tokens,
                             lambda: ("acks", [j for j in self._live_out() if self.acks[j] < k - 1]), k)
        self.node.entered(k, self)
        credit = count if self.use_tokens else 0
        if self.config.serial:
            if credit:
                for j in self.in_peers:
                    if j not in self.departed_after:
                        self.node.post(Message("token", self.rank, j, k, meta={CREDIT: credit}))
        else:
            self._send_updates(k, credit)

    def _live_out(self) -> list[int]:
        return [j for j in self.out_peers if j not in self.departed_after]

    def _send_updates(self, k: int, credit: int) -> None:
        payload = [self.params] if self.params is not None else []
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
        await self._wait(lambda: self.queue.size(iter=k) >= min(need, len(self._expected(k)))
                         or self._short_of_peers(k, need), self.queue,
                         lambda: ("updates", self._missing_updates(k)), k)
        if self._short_of_peers(k, need) and self.queue.size(iter=k) < need:
            raise self._peer_failure(k, need)
        updates = self.queue.take(iter=k)
        return updates, [u.iter for u in updates]

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

        await self._wait(satisfied, self.queue,
                         lambda: ("an update no older than iteration %d" % oldest,
                                  [j for j in self._expected(k) if j not in fresh_peers()]), k)
        if len(self._expected(k)) < need and len(fresh_peers()) < need:
            raise self._peer_failure(k, need)
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
        self.queue.release(stale)
        return chosen, [u.iter for u in chosen]

    def _newest_from(self, j: int) -> int:
        return self.queue.newest_iter(j)

    async def _wait(self, ready: Callable[[], bool], waitable: UpdateQueue | TokenCredits,
                    describe: Callable[[], tuple[str, Sequence[int]]], k: int) -> None:
        """Wait until ``ready()``; on timeout, name what was missing and from whom."""
        if ready():
            return
        node = self.node
        began = node.timer()
        try:
            await node.clock.wait(waitable.wait_until(ready), "", iteration=k)
        except WaitTimeout as exc:
            what, peers = describe()
            peer = peers[0] if peers else None
            raise WaitTimeout(f"{what} (rank {self.rank})", peer=peer,
                              peer_state=self.node.peer_state(peer) if peer is not None else None,
                              iteration=k, waited_s=exc.waited_s) from None
        finally:
            node.waited("updates" if waitable is self.queue else "tokens", node.timer() - began)

    # ------------------------------------------------------------------ mixing
    def _reduce(self, updates: list[Update], iters: list[int], k: int) -> None:
        """Weighted average of this worker's parameters and the received ones (Eq. 1 / Eq. 2)."""
        if self.params is None or not updates:
            self.queue.release(updates)
            return
        if self.staleness is None:
            weights = [self.in_weight[u.src] for u in updates]
            own = self.self_weight
        else:
            base = k - self.staleness
            weights = [self.in_weight[u.src] * (it - base + 1) for u, it in zip(updates, iters)]
            own = self.self_weight * (self.staleness + 1)
        total = own + sum(weights)
        params = self.params
        params.mul_(own / total)
        for update, weight in zip(updates, weights):
            assert update.tensors is not None
            params.add_(update.tensors[0], alpha=weight / total)
        self.queue.release(updates)

    def summary(self) -> dict[str, Any]:
        return {"queue_high_water": self.queue.high_water,
                "token_high_water": self.tokens.high_water if self.use_tokens else None,
                "skipped_iterations": self.skipped_iterations,
                "late_updates_dropped": self.late_updates_dropped, "updates_not_sent": self.updates_not_sent,
                "buffers_allocated": self.pool.allocated}

    def snapshot(self) -> dict[str, Any]:
        snap: dict[str, Any] = {"queue": len(self.queue)}
        if self.use_tokens:
            snap["tokens"] = {str(j): self.tokens.tokens(j) for j in self.out_peers}
        return snap


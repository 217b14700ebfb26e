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

Its declaration (options, what it refuses, what it registers) is :mod:`hopnet.protocols.hop.spec`,
which imports no torch. The class is built on :class:`~hopnet.protocols.hop.state.HopState` (its
state and shared bookkeeping), with its receiving side in :mod:`.receiving`, its part in replacing a
dead worker in :mod:`.rejoin`, and the words of its failures in :mod:`.failures`; this module holds
the iteration flow: entering a round, sending, waiting for updates and tokens, and mixing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from hopnet.errors import WaitTimeout
from hopnet.finite import all_finite_in
from hopnet.protocols.base import ApplyFn
from hopnet.protocols.hop.mix_sums import mix_into
from hopnet.protocols.hop.options import WELCOME
from hopnet.protocols.hop.queues import TokenCredits, Update, UpdateQueue
from hopnet.protocols.hop.receiving import HopReceiving
from hopnet.protocols.hop.rejoin import HopRejoin
from hopnet.protocols.hop.state import CREDIT, PART, STREAM_WINDOW
from hopnet.protocols.local_steps import round_of, rounds_sent_by
from hopnet.wire import Message

AGREE_POLL_S = 0.002
"""How often the lanes of a replica meet again while the updates they all have are too few."""


class HopProtocol(HopReceiving, HopRejoin):
    name = "hop"

    def on_message(self, msg: Message) -> None:
        kind = msg.kind
        if kind == "update":
            if msg.src in self._joined_late and self._beyond_window(msg.iter):
                # a replacement that started further ahead than this worker's queue reaches (it took the
                # furthest neighbour's pace): its update is dropped, as one would be on a lossy link
                self.node.count_drop("update_beyond_window")
                self._release(msg.tensors if self.specs else None)
                self._on_credit(msg)
                return
            self._on_credit(msg)
            if msg.src not in self._in_peer_set:
                return
            if msg.meta and PART in msg.meta:
                self._on_chunk(msg)
                return
            if msg.iter > self.newest_received[msg.src]:
                self.newest_received[msg.src] = msg.iter
            if self._is_late(msg.iter, msg.src) or (self.staleness is not None
                                                    and msg.iter < self.queue.newest_iter(msg.src)):
                self.late_updates_dropped += 1
                self._release(msg.tensors if self.specs else None)
                return
            if self.staleness is not None:
                # Only the newest update per in-neighbour is ever used (Sec. 6.1): keep one. A lane of a
                # replica group keeps the one before it too: its lanes choose an update all of them hold.
                older = self.queue.held(w_id=msg.src)
                if self.node.lanes is not None:
                    older = older[:-1]
                for update in older:
                    self.queue.take(iter=update.iter, w_id=msg.src)
                self._release_updates(older)
            self._store(Update(msg.iter, msg.src, msg.tensors))
        elif kind == "token":
            self._on_credit(msg)
        elif kind == WELCOME:
            self._on_welcome(msg)
        elif kind == "ack":
            if msg.src in self._out_peer_set and msg.iter > self.acks[msg.src]:
                self.acks[msg.src] = msg.iter
                self.tokens.wake()
        else:
            self.node.count_drop("unexpected_kind")

    def on_peer_departed(self, peer: int, last_iteration: int) -> None:
        # a goodbye names the peer's iteration: it sent its model up to the round it last entered
        final = self.node.final_iterations.get(peer, self.final_iteration)
        self._departed(peer, rounds_sent_by(last_iteration, self.local_steps, final))

    def _departed(self, peer: int, last_round: int) -> None:
        self.departed_after[peer] = last_round
        if peer in self._out_peer_set:
            self.tokens.depart(peer)
        self.queue.wake()

    def on_peer_dead(self, peer: int) -> None:
        # Nothing is on its way from a dead peer: the newest update it sent is its last.
        self._departed(peer, self.newest_received.get(peer, -1))

    async def start(self) -> None:
        """Nothing yet: iteration 0 is entered (and the model sent) in :meth:`begin`."""

    def resume_at(self, iteration: int) -> None:
        super().resume_at(iteration)
        # Every rank resumes at ``iteration`` (in the middle of a round, possibly: it mixes where it
        # would have): no ack of an earlier round will come.
        before = self.round - 1
        self.acks = {j: before for j in self.acks}
        self.last_used = {j: before for j in self.last_used}
        self.newest_received = {j: before for j in self.newest_received}

    async def begin(self) -> None:
        if self._mixes(self.iteration):
            await self._enter(self.iteration, 1)

    async def finish_iteration(self, apply: ApplyFn | None, *, last: bool = False) -> None:
        k = self.iteration
        if not self._mixes(k):  # a local step (--local-steps): no message, no wait
            if apply is not None:
                apply()
            self.node.iteration_done(k, self)
            if not last:
                await self._advance(k + 1, 1)
            return
        await self._mix(apply, k, self.round, last)

    async def _mix(self, apply: ApplyFn | None, k: int, r: int, last: bool) -> None:
        """Finish mixing iteration ``k``, the end of round ``r`` (the same number without local steps)."""
        if self.options.serial:
            if apply is not None:
                apply()
            self._send_updates(r, credit=0)
            updates, iters = await self._recv(r)
            await self.node.flush()
            self._reduce(updates, iters, r)
        else:
            updates, iters = await self._recv(r)
            await self.node.flush()
            self._reduce(updates, iters, r)
            if apply is not None:
                apply()
        if self.notify_ack:
            for j in self.in_peers:
                if j not in self.departed_after:
                    self.node.post(Message("ack", self.rank, j, r))
        self.node.iteration_done(k, self)
        if last:
            return
        target = await self._maybe_skip(r)  # skipping is refused with local steps: rounds are iterations here
        await self._advance(target if self.local_steps == 1 else k + 1, target - r)

    async def _advance(self, k: int, count: int) -> None:
        """Go on to iteration ``k``; at a mixing iteration, enter its round having advanced ``count`` rounds
        (the token queues' wait, then the grants and, in the parallel approach, the model sent)."""
        if not self._mixes(k):
            self.iteration = k
            return
        if self.use_tokens:
            r = round_of(k, self.local_steps)
            await self._wait(lambda: self.tokens.available(count), self.tokens,
                             lambda: ("tokens", self.tokens.missing(count)), r)
            await self._leave_together()
            await self.tokens.acquire(count)
        await self._enter(k, count)

    async def stop(self) -> None:
        await self.say_goodbye(peer for peer in self.peers if peer not in self.departed_after)

    async def _maybe_skip(self, k: int) -> int:
        """Sec. 5: jump ahead when more than ``skip_threshold`` behind every out-neighbour. The lanes of a
        replica group jump together, as far as the one that would jump least."""
        threshold, max_jump = self.options.skip_threshold, self.options.max_jump
        if threshold is None or max_jump is None:
            return k + 1
        behind = self.tokens.min_lead()
        if self.node.lanes is not None:
            least = await self.node.lanes.least(0 if behind is None or behind <= threshold else behind)
            behind = least or None
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

    async def _enter(self, iteration: int, count: int) -> None:
        """Enter mixing iteration ``iteration``, so its round, having advanced ``count`` rounds: grant, then
        send (parallel). Entries count rounds (its ``enter`` record, the gap tracker)."""
        self.iteration = iteration
        k = self.round
        self._discard_older_than(self._oldest_useful())
        if self.notify_ack and k > 0:
            await self._wait(lambda: all(self.acks[j] >= k - 1 for j in self._live_out()), self.tokens,
                             lambda: ("acks", [j for j in self._live_out() if self.acks[j] < k - 1]), k)
            await self._leave_together()
        self.node.entered(k, self)
        credit = count if self.use_tokens else 0
        if self.options.serial:
            if credit:
                for j in self.in_peers:
                    if j not in self.departed_after:
                        self.node.post(Message("token", self.rank, j, k, meta={CREDIT: credit}))
        else:
            self._send_updates(k, credit)

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
                self._post_update(peer, k, meta)
            else:
                if peer in self._out_peer_set:
                    self.updates_not_sent += 1
                if meta is not None:
                    self.node.post(Message("token", self.rank, peer, k, meta=meta))

    def _post_update(self, peer: int, k: int, meta: dict[str, Any] | None) -> None:
        """The model as iteration ``k``'s update to ``peer``: one message, or (streaming) one per
        region, in order, the credit riding on the first."""
        if not self.streaming:
            self.node.post(Message("update", self.rank, peer, k, meta=meta, tensors=self.flats))
            return
        chunks = [Message("update", self.rank, peer, k, meta={PART: index, **(meta or {})} if index == 0
                          else {PART: index}, tensors=[region.of(self.flats)])
                  for index, region in enumerate(self.regions)]
        self.node.post_stream(chunks, STREAM_WINDOW)

    async def _recv(self, k: int) -> tuple[list[Update], list[int]]:
        if self.staleness is not None:
            return await self._recv_stale(k)
        if k > self._awaiting:
            self._awaiting = k
            if self._hold_from:  # (never in the simulator: its models have no tensors to sum)
                self.node.take_in_held()
        need = len(self.in_peers) - self.n_buw
        while True:
            await self._wait(lambda: self.queue.size(iter=k) >= min(need, len(self.expected_senders(k)))
                             or self._short_of_peers(k, need), self.queue,
                             lambda: ("updates", self._missing_updates(k)), k)
            if not (self._short_of_peers(k, need) and self.queue.size(iter=k) < need):
                break
            await self._await_replacements(k, need)
        if self.agreeing:  # (its agreement's first all-reduce is where the lanes meet)
            with self._handover_point():
                return await self._recv_agreed(k, need)
        await self._leave_together()
        updates = self.queue.take(iter=k)
        return updates, [u.iter for u in updates]

    async def _recv_agreed(self, k: int, need: int) -> tuple[list[Update], list[int]]:
        """A lane of a replica group (:mod:`hopnet.replica`) mixes the updates of iteration ``k`` that every
        lane of its replica has, once they are as many as every lane needs, so all its lanes mix the same
        senders; one that reached this lane alone is dropped as late."""
        lanes = self.node.lanes
        assert lanes is not None
        began = self.node.clock.now()
        while True:
            have = [j for j in self.in_peers if self.queue.size(iter=k, w_id=j)]
            common, enough = await lanes.common(have, min(need, len(self.expected_senders(k))))
            if enough:
                break
            if self.node.clock.now() - began > self.config.timeout_s:
                missing = self._missing_updates(k)
                raise WaitTimeout(f"updates every lane of the replica has (rank {self.rank})",
                                  peer=missing[0] if missing else None, iteration=k,
                                  waited_s=self.node.clock.now() - began)
            await asyncio.sleep(AGREE_POLL_S)
        taken = self.queue.take(iter=k)
        chosen = [u for u in taken if u.src in common]
        apart = [u for u in taken if u.src not in common]
        self.late_updates_dropped += len(apart)
        self._release_updates(apart)
        return chosen, [u.iter for u in chosen]

    def _short_of_peers(self, k: int, need: int) -> bool:
        return len(self.expected_senders(k)) < need

    def _missing_updates(self, k: int) -> list[int]:
        return [j for j in self.expected_senders(k) if not self.queue.size(iter=k, w_id=j)]

    async def _recv_stale(self, k: int) -> tuple[list[Update], list[int]]:
        """Fig. 9 (as its text describes): newest update per in-neighbour if >= k - s."""
        oldest = k - (self.staleness or 0)
        await self._await_fresh(k, oldest)
        if self.node.lanes is not None:
            with self._handover_point():
                return await self._recv_stale_agreed(k, oldest)
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

    def _fresh_peers(self, oldest: int) -> list[int]:
        return [j for j in self.in_peers if self.last_used[j] >= oldest or self._newest_from(j) >= oldest]

    async def _await_fresh(self, k: int, oldest: int) -> None:
        need = len(self.in_peers) - self.n_buw

        def satisfied() -> bool:
            return len(self._fresh_peers(oldest)) >= min(need, len(self.expected_senders(k)))

        while True:
            await self._wait(satisfied, self.queue,
                             lambda: ("an update no older than iteration %d" % oldest,
                                      [j for j in self.expected_senders(k) if j not in self._fresh_peers(oldest)]), k)
            if not (len(self.expected_senders(k)) < need and len(self._fresh_peers(oldest)) < need):
                break
            await self._await_replacements(k, need)

    async def _recv_stale_agreed(self, k: int, oldest: int) -> tuple[list[Update], list[int]]:
        """Bounded staleness in a lane of a replica group: the update of each in-neighbour is the newest
        one every lane of the replica holds (each lane keeps its sender's two newest, so one is found
        while the lanes' arrivals differ), and enough of them is what every lane needs. Two small
        all-reduces: the newest each lane holds (their least is the candidate), then whether every
        lane holds it and the largest need."""
        lanes = self.node.lanes
        assert lanes is not None
        need = len(self.in_peers) - self.n_buw
        began = self.node.clock.now()
        while True:
            unused = [max((u.iter for u in self.queue.held(w_id=j) if u.iter > self.last_used[j]), default=-1)
                      for j in self.in_peers]
            candidate = await lanes.least_each(unused)
            held = [int(e >= oldest and self.queue.size(iter=e, w_id=j) > 0) for j, e in zip(self.in_peers, candidate)]
            *everywhere, most_needed = await lanes.least_each([*held, -min(need, len(self.expected_senders(k)))])
            fresh = {j for j, ok in zip(self.in_peers, everywhere) if ok} | {
                j for j in self.in_peers if self.last_used[j] >= oldest}
            if len(fresh) >= -most_needed:
                break
            if self.node.clock.now() - began > self.config.timeout_s:
                missing = [j for j in self.expected_senders(k) if j not in fresh]
                raise WaitTimeout(f"an update no older than iteration {oldest} that every lane of the replica "
                                  f"holds (rank {self.rank})", peer=missing[0] if missing else None, iteration=k,
                                  waited_s=self.node.clock.now() - began)
            await asyncio.sleep(AGREE_POLL_S)
        chosen: list[Update] = []
        for j, e, ok in zip(self.in_peers, candidate, everywhere):
            if ok:
                chosen.extend(self.queue.take(iter=e, w_id=j))
                self.last_used[j] = e
            used = [u for u in self.queue.held(w_id=j) if u.iter <= self.last_used[j]]
            for update in used:
                self.queue.take(iter=update.iter, w_id=j)
            self._release_updates(used)
        return chosen, [u.iter for u in chosen]

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

    def _reduce(self, updates: list[Update], iters: list[int], k: int) -> None:
        """Weighted average of this worker's parameters and the received ones (Eq. 1 / Eq. 2)."""
        if self.summing:
            self._reduced = k
            for key in [key for key in self._arriving if key[0] == k]:
                del self._arriving[key]  # its regions that came are in the sum; the rest are late
            summed = self.sums.pop(k)  # what came of iteration k: at least the updates taken
            if summed is not None:
                mix_into(self.flats, self.self_weight, summed, self.regions)
                self.sums.release(summed)
            self.node.take_in_held()  # the next iteration's updates, into the buffers just freed
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
                "buffers_allocated": self.pool.allocated + self.region_pool.allocated,
                "sums_high_water": self.sums.high_water, "late_chunks_dropped": self.late_chunks_dropped,
                "updates_held": self.updates_held}

    def snapshot(self) -> dict[str, Any]:
        snap: dict[str, Any] = {"queue": len(self.queue)}
        if self.use_tokens:
            snap["tokens"] = {str(j): self.tokens.tokens(j) for j in self.out_peers}
        if self.staleness is not None:  # the iteration of each in-neighbour's newest update mixed so far
            snap["mixed"] = {str(j): self.last_used[j] for j in self.in_peers}
        return snap


__all__ = ["HopProtocol"]

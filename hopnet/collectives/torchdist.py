"""All-reduce among a group of ranks over torch.distributed (gloo on CPU, NCCL on CUDA).

Groups are formed by their members alone. A group's process group is built from the
run's c10d store under a prefix of its own (``hopnet/coll/{backend}/{members}/...``), by
the group's members only, with ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` constructed
directly: no ``new_group`` and no call involving any rank outside the group.

Communicators are cached, at most ``max_cached`` per collective (default
:data:`DEFAULT_MAX_CACHED`). NCCL allows few live communicators per GPU (each holds
buffers on the device); Prague (Sec. 6.1) meets the same limit. Past the bound the
layer stops caching: a group met when the cache is full gets a fresh communicator for
each call, destroyed right after.

Members must agree whether a group is cached, yet each member's cache fills with its
own other groups. So the first call of a group decides, once, through the store: each
member votes whether it has room (and reserves it); the group is cached only if all
say yes, and then for good (cached communicators are never evicted, so the decision
never has to be taken back). Every later call of the group knows the answer locally:
a cached group's call costs no store traffic at all; an uncached group's call forms a
communicator under ``.../once/{tag}/{n}`` (the n-th call with that tag) and drops it.

The reduce itself is ``allreduce`` (sum) on the group's process group; ``mean``
divides by the group size afterwards. gloo and NCCL reduce each element once and
send the result to every member, so members end bit for bit equal (the tests check it).
A cached group's call issues the reduce on the caller's event loop (gloo and NCCL only
enqueue it) and a thread per cached group waits for it; a caller outside the loop that
blocks anyway (:meth:`TorchCollective.allreduce_blocking`, used by
:meth:`hopnet.api.Worker.allreduce`, and :meth:`TorchCollective.issuer`, used by the gradient
hooks of :mod:`hopnet.protocols.overlap`) issues and waits in its own thread instead; any other call (the first of a
group, or an uncached one, which talk to the store and construct process groups) runs
in a thread of its own. Every wait (store, construction, reduce) has the collective's
timeout (``--timeout``) and fails naming the group.

A member that goes silent. gloo's and NCCL's own timeouts stay at ``--timeout``: an op's timeout
cannot tell a slow member (a straggler still computing, a large reduce on a slow link) from a
dead one. The node's heartbeats can (``node``: its ``dead``, neighbours silent for
``--peer-timeout`` and ranks the coordinator declared dead): the waits for a reduce go in slices
of 0.25 s (a call waiting for its thread, which may wait for the store, looks as often), and
after each one a wait whose group has a member declared dead ends with a
:class:`~hopnet.errors.PeerFailure` naming the group and that member. The op is left
behind (neither backend can cancel one): the group is broken, later calls on it fail the same
way, and its communicator is aborted (NCCL) or dropped (gloo) at close.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hopnet.collectives.base import REDUCE_OPS, Collective, IssueFn, PendingReduce, ReduceOp, check_group
from hopnet.errors import ConfigError, HopnetError, PeerFailure, WaitTimeout
from hopnet.runtime.services import NodeServices
from hopnet.transports.store_clones import StoreClones
from hopnet.transports.torchdist import (GiveUp, OpWaiter, backend_for, build_group, one_line, release_group,
                                         settle, wait_collective)

DEFAULT_MAX_CACHED = 16
"""Communicators kept per process. NCCL's cost per communicator (device buffers, a
proxy thread) makes a few dozen the practical ceiling; 16 covers a rank's fixed groups
in every protocol of this project and the most frequent of Prague's rotating ones."""

STORE_PREFIX = "hopnet/coll"
WAIT_SLICE_S = 0.25
"""How often a call waiting for its thread asks whether a member was declared dead."""


class TorchCollective(Collective):
    """:class:`~hopnet.collectives.base.Collective` over torch.distributed process groups."""

    def __init__(self, rank: int, world_size: int, store: dist.Store, *, timeout_s: float = 120.0,
                 max_cached: int = DEFAULT_MAX_CACHED, host: str = "127.0.0.1",
                 backend: str | None = None, node: NodeServices | None = None) -> None:
        """``node``: whose ``dead`` peers end the waits on a group they are members of (None: only
        ``timeout_s`` does)."""
        if max_cached < 1:
            raise ConfigError(f"max_cached must be >= 1 (got {max_cached})")
        if timeout_s <= 0:
            raise ConfigError(f"timeout must be positive (got {timeout_s})")
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self._stores = StoreClones(store)  # uncached calls meet through the store in threads of their own
        self.timeout_s = float(timeout_s)
        self.max_cached = max_cached
        self.host = host
        self.backend = backend  # None: by each tensor's device
        self.node = node
        self._broken: dict[tuple[str, tuple[int, ...]], PeerFailure] = {}  # groups a silent member left an op in
        self.built = 0  # communicators constructed so far
        self.uncached_calls = 0  # calls that formed a communicator for themselves alone
        self._cached: dict[tuple[str, tuple[int, ...]], Any] = {}
        self._decided: dict[tuple[str, tuple[int, ...]], bool] = {}  # cached or not, agreed by the members
        self._reserved = 0
        self._waiters: dict[tuple[str, tuple[int, ...]], OpWaiter] = {}  # one thread per cached group
        self._deciding: dict[tuple[str, tuple[int, ...]], asyncio.Future[BaseException | None]] = {}
        self._calls: Counter[tuple[tuple[int, ...], str]] = Counter()
        self._lock = threading.Lock()
        self._issue_lock = threading.Lock()
        self._closed = False

    @property
    def cached_groups(self) -> list[tuple[int, ...]]:
        """Groups whose communicator is cached."""
        with self._lock:
            return [members for _, members in self._cached]

    @property
    def uncached_groups(self) -> list[tuple[int, ...]]:
        """Groups the members agreed not to cache (the bound was reached by one of them)."""
        with self._lock:
            return [members for (_, members), cached in self._decided.items() if not cached]

    async def allreduce(self, group: Sequence[int], tensor: torch.Tensor, op: ReduceOp = "mean", *,
                        tag: str) -> torch.Tensor:
        members = self._check(group, tensor, op, tag)
        if len(members) == 1:
            return tensor
        key = (self.backend or backend_for(tensor.device), members)
        # The group's first call still meets the others, or reduces. (Once it is done, its callback
        # may not have run yet: a done future is awaited without yielding.)
        while (deciding := self._deciding.get(key)) is not None and not deciding.done():
            await asyncio.shield(deciding)
        if key in self._broken:
            raise self._failure(self._broken[key], members, tag)
        pg = self._cached.get(key) if self._decided.get(key) else None
        if pg is not None:
            return await self._reduce_cached(key, pg, tensor, op, tag)
        self._calls[(members, tag)] += 1
        call = self._calls[(members, tag)]
        loop = asyncio.get_running_loop()
        done: asyncio.Future[BaseException | None] = loop.create_future()

        def run() -> None:
            error: BaseException | None = None
            try:
                self._reduce(members, tensor, op, tag, call)
            except BaseException as exc:
                error = exc
            try:
                loop.call_soon_threadsafe(settle(done), error)
            except RuntimeError:
                pass

        if key not in self._decided and key not in self._deciding:
            # Calls of the group issued meanwhile (the buckets of one backward pass, an issuer's) wait
            # until this one, which decides whether the group is cached and forms it, has also reduced:
            # a call issued on the cached group while this one's thread still issues its own could go
            # first on one rank and second on another, and gloo would pair them wrongly.
            self._deciding[key] = done
            done.add_done_callback(lambda ended: self._deciding.pop(key) if self._deciding.get(key) is ended else None)
        threading.Thread(target=run, name=f"hopnet-allreduce-{self.rank}", daemon=True).start()
        error = await self._settled(done, members)
        if error is not None:
            if isinstance(error, PeerFailure) and error.peer_state == "dead":
                raise self._broken_by(error, key, tag)
            if isinstance(error, HopnetError):
                raise error
            raise HopnetError(f"rank {self.rank}: all-reduce {tag!r} of group {list(members)} failed: "
                              f"{one_line(error)}") from error
        return tensor

    def allreduce_blocking(self, group: Sequence[int], tensor: torch.Tensor, op: ReduceOp = "mean", *,
                           tag: str) -> torch.Tensor | None:
        """A cached group's reduce, issued and waited for in the calling thread: no hand-off to
        the loop and back (at 1 MiB those cost up to half the time, docs/performance/index.md, "All-reduce against torch.distributed").
        None for a group not yet known to be cached: its first call meets through the store, and
        an uncached one forms a communicator per call; those go through :meth:`allreduce`."""
        members = self._check(group, tensor, op, tag)
        if len(members) == 1:
            return tensor
        issue = self.issuer(members, op, tensor.device)
        return issue(tensor, tag).wait() if issue is not None else None

    def issuer(self, group: Sequence[int], op: ReduceOp, device: torch.device) -> IssueFn | None:
        """Reduces of a cached group, issued in the calling thread (gloo and NCCL only enqueue
        them) and waited for there: see :meth:`Collective.issuer`. None until the group's first
        call, on the loop, has formed it and reduced."""
        members = tuple(group)
        key = (self.backend or backend_for(device), members)
        pg = self._cached.get(key) if self._decided.get(key) else None
        deciding = self._deciding.get(key)
        if pg is None or self._closed or (deciding is not None and not deciding.done()) or key in self._broken:
            return None

        def issue(tensor: torch.Tensor, tag: str) -> PendingReduce:
            return _IssuedReduce(self, self._issue(pg, tensor, members, tag), tensor, members, op, tag)
        return issue

    def _check(self, group: Sequence[int], tensor: torch.Tensor, op: str, tag: str) -> tuple[int, ...]:
        if self._closed:
            raise HopnetError("allreduce on a closed collective")
        members = check_group(group, self.rank, self.world_size)
        if op not in REDUCE_OPS:
            raise ConfigError(f"unknown reduce op {op!r} (choose from {', '.join(REDUCE_OPS)})")
        if not isinstance(tag, str) or not tag:
            raise ConfigError("an all-reduce needs a non-empty string tag")
        if not tensor.is_contiguous():
            raise ConfigError("all-reduce needs a contiguous tensor")
        return members

    def _issue(self, pg: Any, tensor: torch.Tensor, members: tuple[int, ...], tag: str) -> Any:
        # The loop and a blocking caller may issue on one group; gloo numbers its ops with a
        # plain counter, so issues are serialised.
        try:
            with self._issue_lock:
                return pg.allreduce([tensor])
        except Exception as exc:
            raise HopnetError(f"rank {self.rank}: all-reduce {tag!r} of group {list(members)} failed: "
                              f"{one_line(exc)}") from None

    async def _reduce_cached(self, key: tuple[str, tuple[int, ...]], pg: Any, tensor: torch.Tensor, op: str,
                             tag: str) -> torch.Tensor:
        """The hot path: issue on the loop (both backends only enqueue), wait in the group's thread."""
        members = key[1]
        loop = asyncio.get_running_loop()
        done: asyncio.Future[BaseException | None] = loop.create_future()
        issued = _IssuedReduce(self, self._issue(pg, tensor, members, tag), tensor, members, op, tag)
        waiter = self._waiters.get(key)
        if waiter is None:
            waiter = self._waiters[key] = OpWaiter(f"hopnet-allreduce-{self.rank}-{'-'.join(map(str, members))}",
                                                  loop, self.timeout_s, functools.partial(self._wait_reduce, members))
        waiter.add([issued.work], tensor.device, settle(done))
        return issued.finish(await done)

    # ------------------------------------------------------------------ members gone silent
    def silent_member(self, members: Sequence[int]) -> PeerFailure | None:
        """A failure naming the members of ``members`` the node declared dead, or None. Asked
        between slices of a wait, from any thread (it only reads the node's ``dead``)."""
        node = self.node
        if node is None:
            return None
        dead = {m: node.dead.get(m) for m in members if m != self.rank and m in node.dead}
        if not dead:
            return None
        causes = node.death_causes
        said = [f"rank {m} " + (f"was lost ({causes[m]})" if m in causes else f"went silent for {s or 0.0:.1f}s")
                for m, s in sorted(dead.items())]
        return PeerFailure(" and ".join(said), peer=min(dead), peer_state="dead")

    async def _settled(self, done: asyncio.Future[BaseException | None],
                       members: tuple[int, ...]) -> BaseException | None:
        """What a call's thread settled ``done`` with; or, should a member be declared dead first
        (the thread may be waiting for the store, where the members meet), that failure: ``done``
        is settled with it, so that calls of the group waiting behind this one go on, and the
        thread is left to its timeout. (Not slices of the store's wait: each timed-out wait logs
        two warnings of c10d's.)"""
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(done), WAIT_SLICE_S)
            except TimeoutError:
                silent = self.silent_member(members)
                if silent is not None:
                    settle(done)(silent)
                    return done.result()

    def _gives_up(self, members: Sequence[int]) -> GiveUp:
        return functools.partial(self.silent_member, members)

    def _wait_reduce(self, members: tuple[int, ...], work: Any, device: torch.device, timeout_s: float) -> None:
        wait_collective(work, device, timeout_s, self._gives_up(members))

    def _broken_by(self, silent: PeerFailure, key: tuple[str, tuple[int, ...]], tag: str) -> PeerFailure:
        """A member of ``key``'s group went silent (``silent``) while all-reduce ``tag`` waited: the
        op is left behind in the group, which is broken for good. The failure to raise."""
        self._broken[key] = silent
        return self._failure(silent, key[1], tag)

    def _failure(self, silent: PeerFailure, members: Sequence[int], tag: str) -> PeerFailure:
        """``silent`` (from :meth:`silent_member`) as the failure of all-reduce ``tag``."""
        return PeerFailure(f"rank {self.rank}: all-reduce {tag!r} of group {list(members)}: {silent}",
                           peer=silent.peer, peer_state="dead")

    # ------------------------------------------------------------------ in the call's thread
    def _reduce(self, members: tuple[int, ...], tensor: torch.Tensor, op: str, tag: str, call: int) -> None:
        with self._stores.lease() as store:
            self._reduce_with(store, members, tensor, op, tag, call)

    def _reduce_with(self, store: dist.Store, members: tuple[int, ...], tensor: torch.Tensor, op: str, tag: str,
                     call: int) -> None:
        backend = self.backend or backend_for(tensor.device)
        key = (backend, members)
        base = f"{STORE_PREFIX}/{backend}/{'-'.join(map(str, members))}"
        index = members.index(self.rank)
        cached = self._decided.get(key)
        if cached is None:
            cached = self._decide(store, key, base, index, members, tag)
        if cached:
            pg = self._cached.get(key)
            if pg is None:
                pg = self._form(store, key[0], f"{base}/cached", index, members, tag)
                with self._lock:
                    self._cached[key] = pg
            self._run(pg, tensor, members, tag)
        else:
            prefix = f"{base}/once/{tag}/{call}"
            pg = self._form(store, key[0], prefix, index, members, tag)
            abandoned = True  # unless the reduce ends: a member went silent, or the wait timed out
            try:
                self._run(pg, tensor, members, tag)
                abandoned = False
                # A member may still be reading our last bytes: close only once all are done.
                done_keys = [f"{prefix}/done{i}" for i in range(len(members))]
                store.set(done_keys[index], "1")
                store.wait(done_keys, timedelta(seconds=self.timeout_s))
            finally:
                release_group(pg, abandoned=abandoned)
            with self._lock:
                self.uncached_calls += 1
        if op == "mean":
            tensor.div_(len(members))

    def _decide(self, store: dist.Store, key: tuple[str, tuple[int, ...]], base: str, index: int, members: tuple[int, ...],
                tag: str) -> bool:
        """The group's first call: cache it only if every member has room (one vote, once)."""
        with self._lock:
            room = len(self._cached) + self._reserved < self.max_cached
            if room:
                self._reserved += 1
        vote_keys = [f"{base}/decide/{i}" for i in range(len(members))]
        try:
            store.set(vote_keys[index], "1" if room else "0")
            # multi_get alone would block for the store's own timeout, not this collective's
            store.wait(vote_keys, timedelta(seconds=self.timeout_s))
            votes = store.multi_get(vote_keys)
        except Exception as exc:
            with self._lock:
                self._reserved -= int(room)
            missing = [m for m, k in zip(members, vote_keys) if not self._has(k)]
            raise WaitTimeout(f"group {list(members)} to meet for all-reduce {tag!r} "
                              f"(missing ranks {missing}): {one_line(exc)}", waited_s=self.timeout_s,
                              peer=missing[0] if missing else None, peer_state="stalled") from None
        cached = all(v == b"1" for v in votes)
        with self._lock:
            self._reserved -= int(room)
            if cached:
                self._cached[key] = None  # the slot is taken; the communicator follows
            self._decided[key] = cached
        return cached

    def _form(self, store: dist.Store, backend: str, prefix: str, index: int, members: tuple[int, ...], tag: str) -> Any:
        try:
            pg = build_group(dist.PrefixStore(prefix, store), backend, index, len(members),
                             timeout_s=self.timeout_s, host=self.host)
        except Exception as exc:
            raise HopnetError(f"rank {self.rank}: cannot form group {list(members)} for all-reduce "
                              f"{tag!r}: {one_line(exc)}") from None
        with self._lock:
            self.built += 1
        return pg

    def _run(self, pg: Any, tensor: torch.Tensor, members: tuple[int, ...], tag: str) -> None:
        try:
            wait_collective(pg.allreduce([tensor]), tensor.device, self.timeout_s, self._gives_up(members))
        except TimeoutError:
            raise WaitTimeout(f"all-reduce {tag!r} of group {list(members)}", waited_s=self.timeout_s,
                              peer_state="stalled") from None

    def _has(self, key: str) -> bool:
        try:
            with self._stores.lease() as store:  # not the connection whose wait just timed out
                return bool(store.check([key]))
        except Exception:
            return False

    async def close(self) -> None:
        self._closed = True
        for waiter in self._waiters.values():
            waiter.stop()
        loop = asyncio.get_running_loop()
        for waiter in self._waiters.values():  # no thread may be inside torch when the process exits
            await loop.run_in_executor(None, waiter.join, 5.0)
        self._waiters.clear()
        with self._lock:
            for key, pg in self._cached.items():
                if pg is not None:
                    release_group(pg, abandoned=key in self._broken)
            self._cached.clear()


@dataclass(frozen=True)
class _IssuedReduce:
    """A cached group's reduce, issued on the loop or by :meth:`TorchCollective.issuer`; waited for by a
    group's waiter thread (then :meth:`finish`) or by the issuing thread itself (:meth:`wait`)."""

    collective: TorchCollective
    work: Any
    tensor: torch.Tensor
    members: tuple[int, ...]
    op: str
    tag: str

    def wait(self) -> torch.Tensor:
        try:
            wait_collective(self.work, self.tensor.device, self.collective.timeout_s,
                            self.collective._gives_up(self.members))
        except Exception as exc:
            return self.finish(exc)
        return self.finish(None)

    def finish(self, error: BaseException | None) -> torch.Tensor:
        """The op ended (``error``: how it failed, or its wait timed out): raise that, else divide
        for ``mean`` and give the result."""
        members = list(self.members)
        if isinstance(error, PeerFailure) and error.peer_state == "dead":
            key = (self.collective.backend or backend_for(self.tensor.device), self.members)
            raise self.collective._broken_by(error, key, self.tag) from None
        if isinstance(error, TimeoutError):
            raise WaitTimeout(f"all-reduce {self.tag!r} of group {members}", waited_s=self.collective.timeout_s,
                              peer_state="stalled") from None
        if error is not None:
            raise HopnetError(f"rank {self.collective.rank}: all-reduce {self.tag!r} of group {members} failed: "
                              f"{one_line(error)}") from error
        if self.op == "mean":
            self.tensor.div_(len(self.members))
        return self.tensor


__all__ = ["DEFAULT_MAX_CACHED", "TorchCollective"]

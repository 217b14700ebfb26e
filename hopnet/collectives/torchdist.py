"""All-reduce among a group of ranks over torch.distributed (gloo on CPU, NCCL on CUDA).

Groups are formed by their members alone. A group's process group is built from the
run's c10d store under the prefix ``hopnet/coll/{backend}/{members}/epoch{E}``, by the
group's members only, with ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` constructed
directly: no ``new_group`` and no call involving any rank outside the group.

Communicators are cached, at most ``max_cached`` per collective (default
:data:`DEFAULT_MAX_CACHED`). NCCL allows few live communicators per GPU (each holds
buffers on the device); Prague (Sec. 6.1) meets the same limit. Past the bound the
least recently used communicator that no call is using is destroyed.

Members must agree on which communicator a call uses, yet each member evicts on its
own (its other groups differ). So every call starts with a vote through the store:
each member posts the epoch of the communicator it holds for the group (or -1), and
reads the others'. If all hold the same epoch, that communicator is used; otherwise
all build a fresh one under a new epoch that the store hands out (the first member to
ask fixes it for the call). The vote costs three store round trips per call (a
fraction of a millisecond on one host), paid so that eviction needs no coordination.

The reduce itself is ``allreduce`` (sum) on the group's process group; ``mean``
divides by the group size afterwards. gloo and NCCL reduce each element once and
send the result to every member, so members end bit for bit equal (the tests check it).
Each call runs in a thread of its own and is awaited on the caller's event loop; every
wait (store, construction, reduce) has the collective's timeout and fails naming the group.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hopnet.collectives.base import REDUCE_OPS, Collective, ReduceOp, check_group
from hopnet.errors import ConfigError, HopnetError, WaitTimeout
from hopnet.transports.torchdist import _shutdown, backend_for, build_group, wait_work

DEFAULT_MAX_CACHED = 8
"""Communicators kept per process. NCCL's cost per communicator (device buffers, a
proxy thread) makes a few dozen the practical ceiling; 8 covers a rank's groups in
every protocol of this project with room for Prague's rotating groups."""

STORE_PREFIX = "hopnet/coll"


@dataclass
class _Cached:
    epoch: int
    pg: Any
    users: int = 0


class TorchCollective(Collective):
    """:class:`~hopnet.collectives.base.Collective` over torch.distributed process groups."""

    def __init__(self, rank: int, world_size: int, store: dist.Store, *, timeout_s: float = 120.0,
                 max_cached: int = DEFAULT_MAX_CACHED, host: str = "127.0.0.1",
                 backend: str | None = None) -> None:
        if max_cached < 1:
            raise ConfigError(f"max_cached must be >= 1 (got {max_cached})")
        if timeout_s <= 0:
            raise ConfigError(f"timeout must be positive (got {timeout_s})")
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self.timeout_s = float(timeout_s)
        self.max_cached = max_cached
        self.host = host
        self.backend = backend  # None: by each tensor's device
        self.built = 0  # communicators constructed so far
        self.evicted = 0
        self._cache: OrderedDict[tuple[str, tuple[int, ...]], _Cached] = OrderedDict()
        self._calls: Counter[tuple[tuple[int, ...], str]] = Counter()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def cached_groups(self) -> list[tuple[int, ...]]:
        """Groups whose communicator is cached, least recently used first."""
        with self._lock:
            return [members for _, members in self._cache]

    async def allreduce(self, group: Sequence[int], tensor: torch.Tensor, op: ReduceOp = "mean", *,
                        tag: str) -> torch.Tensor:
        if self._closed:
            raise HopnetError("allreduce on a closed collective")
        members = check_group(group, self.rank, self.world_size)
        if op not in REDUCE_OPS:
            raise ConfigError(f"unknown reduce op {op!r} (choose from {', '.join(REDUCE_OPS)})")
        if not isinstance(tag, str) or not tag:
            raise ConfigError("an all-reduce needs a non-empty string tag")
        if not tensor.is_contiguous():
            raise ConfigError("all-reduce needs a contiguous tensor")
        if len(members) == 1:
            return tensor
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
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(error))
            except RuntimeError:
                pass

        threading.Thread(target=run, name=f"hopnet-allreduce-{self.rank}", daemon=True).start()
        error = await done
        if error is not None:
            if isinstance(error, HopnetError):
                raise error
            raise HopnetError(f"rank {self.rank}: all-reduce {tag!r} of group {list(members)} failed: "
                              f"{_one_line(error)}") from error
        return tensor

    # ------------------------------------------------------------------ in the call's thread
    def _reduce(self, members: tuple[int, ...], tensor: torch.Tensor, op: str, tag: str, call: int) -> None:
        backend = self.backend or backend_for(tensor.device)
        key = (backend, members)
        base = f"{STORE_PREFIX}/{backend}/{'-'.join(map(str, members))}"
        index = members.index(self.rank)
        entry = self._use(key)
        try:
            entry = self._agree(key, entry, base, f"{base}/call/{tag}/{call}", index, members, tag)
            try:
                work = entry.pg.allreduce([tensor])
                wait_work(work, tensor.device, self.timeout_s)
            except TimeoutError:
                raise WaitTimeout(f"all-reduce {tag!r} of group {list(members)}", waited_s=self.timeout_s,
                                  peer_state="stalled") from None
        finally:
            self._release(key, entry)
        if op == "mean":
            tensor.div_(len(members))
        self._forget_vote(f"{base}/call/{tag}/{call}", index)

    def _agree(self, key: tuple[str, tuple[int, ...]], entry: _Cached | None, base: str, call_key: str,
               index: int, members: tuple[int, ...], tag: str) -> _Cached:
        """The vote: the communicator every member holds, or a new one built by all."""
        vote_keys = [f"{call_key}/vote{i}" for i in range(len(members))]
        mine = entry.epoch if entry is not None else -1
        try:
            self.store.set(vote_keys[index], str(mine))
            self.store.wait(vote_keys, timedelta(seconds=self.timeout_s))
            votes = [int(v) for v in self.store.multi_get(vote_keys)]
        except Exception as exc:
            missing = [m for m, k in zip(members, vote_keys) if not self._has(k)]
            raise WaitTimeout(f"group {list(members)} to meet for all-reduce {tag!r} "
                              f"(missing ranks {missing}): {_one_line(exc)}", waited_s=self.timeout_s,
                              peer=missing[0] if missing else None, peer_state="stalled") from None
        if entry is not None and all(v == mine for v in votes):
            return entry
        candidate = self.store.add(f"{base}/epochs", 1)
        epoch = int(self.store.compare_set(f"{call_key}/epoch", "", str(candidate)))
        try:
            pg = build_group(dist.PrefixStore(f"{base}/epoch{epoch}", self.store), key[0], index,
                             len(members), timeout_s=self.timeout_s, host=self.host)
        except Exception as exc:
            raise HopnetError(f"rank {self.rank}: cannot form group {list(members)} for all-reduce "
                              f"{tag!r}: {_one_line(exc)}") from None
        fresh = _Cached(epoch, pg, users=1)
        with self._lock:
            self.built += 1
            old = self._cache.pop(key, None)
            if old is not None:
                old.users -= 1
                if old.users == 0:
                    _shutdown(old.pg)
            self._cache[key] = fresh
            self._evict_over_bound()
        return fresh

    def _use(self, key: tuple[str, tuple[int, ...]]) -> _Cached | None:
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                entry.users += 1
                self._cache.move_to_end(key)
            return entry

    def _release(self, key: tuple[str, tuple[int, ...]], entry: _Cached | None) -> None:
        if entry is None:
            return
        with self._lock:
            entry.users -= 1
            if entry.users == 0 and self._cache.get(key) is not entry:
                _shutdown(entry.pg)  # replaced or evicted while this call used it
            self._evict_over_bound()

    def _evict_over_bound(self) -> None:
        """Drop least recently used idle communicators until at most ``max_cached`` remain."""
        while len(self._cache) > self.max_cached:
            victim = next((k for k, e in self._cache.items() if e.users == 0), None)
            if victim is None:
                return  # all busy: evicted when their calls end
            _shutdown(self._cache.pop(victim).pg)
            self.evicted += 1

    def _has(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except Exception:
            return False

    def _forget_vote(self, call_key: str, index: int) -> None:
        # Everyone has read the votes once the reduce completed (it needed all members).
        try:
            self.store.delete_key(f"{call_key}/vote{index}")
            if index == 0:
                self.store.delete_key(f"{call_key}/epoch")
        except Exception:  # the store is gone at shutdown: nothing to clean
            pass

    async def close(self) -> None:
        self._closed = True
        with self._lock:
            for entry in self._cache.values():
                _shutdown(entry.pg)
            self._cache.clear()


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return (lines[0] if lines else type(error).__name__)[:300]


__all__ = ["DEFAULT_MAX_CACHED", "TorchCollective"]

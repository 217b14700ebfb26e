"""The rendezvous over a torch ``TCPStore``, for workers that torchrun or srun started.

`hopnet launch` runs a ZeroMQ rendezvous server (:mod:`hopnet.rendezvous.server`); other
launchers give hopnet only a store. Each rank writes ``<prefix>addr/<rank>`` (its address
and the protocol options it runs, JSON) and waits for every other rank's key; the table
is the same on every rank. Rank 0 shares the run directory the same way, and at the end
every rank writes ``<prefix>done/<rank>`` so that the rank hosting the store keeps
serving it until the others no longer need it.

Every wait polls with a deadline and raises :class:`~hopnet.errors.WaitTimeout` naming the
store and the ranks that never wrote their key.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch.distributed as dist

from hopnet.errors import ConfigError, HopnetError, WaitTimeout
from hopnet.rendezvous.wire import config_mismatch

POLL_S = 0.05


class StoreRendezvous:
    """Address exchange, one shared value and the closing handshake on the run's store."""

    def __init__(self, store: dist.TCPStore, *, prefix: str, rank: int, world_size: int, endpoint: str) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.world_size = world_size
        self.endpoint = endpoint

    def _key(self, kind: str, rank: int | str) -> str:
        return f"{self.prefix}{kind}/{rank}"

    def _wait(self, kind: str, ranks: list[int], what: str, timeout_s: float) -> None:
        keys = [self._key(kind, r) for r in ranks]
        deadline = time.monotonic() + timeout_s
        started = time.monotonic()
        while True:
            try:
                if self.store.check(keys):
                    return
            except Exception as exc:  # the store's server went away
                raise HopnetError(f"the run's store at {self.endpoint} failed while waiting for {what}: "
                                  f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
            if time.monotonic() >= deadline:
                missing = [r for r, k in zip(ranks, keys) if not self.store.check([k])]
                raise WaitTimeout(f"{what} on the store at {self.endpoint} (rank(s) {missing} never arrived)",
                                  waited_s=time.monotonic() - started)
            time.sleep(POLL_S)

    def exchange(self, address: str, config: dict[str, Any] | None, timeout_s: float) -> dict[int, str]:
        """Publish this rank's address and options; return every rank's address."""
        self.store.set(self._key("addr", self.rank), json.dumps({"address": address, "config": config}))
        ranks = list(range(self.world_size))
        self._wait("addr", ranks, "the address exchange", timeout_s)
        table: dict[int, str] = {}
        first: tuple[int, dict[str, Any]] | None = None
        for r in ranks:
            entry = json.loads(self.store.get(self._key("addr", r)).decode("utf-8"))
            table[r] = str(entry["address"])
            other = entry.get("config")
            if other is None:
                continue
            if first is None:
                first = (r, other)
            elif other != first[1]:
                raise ConfigError(config_mismatch(first[0], first[1], r, other))
        return table

    def share(self, name: str, value: str | None, timeout_s: float) -> str:
        """Rank 0 sets ``name`` to ``value``; every rank returns rank 0's value."""
        if self.rank == 0:
            if value is None:
                raise ValueError("rank 0 must give the value it shares")
            self.store.set(self._key(name, 0), value)
            return value
        self._wait(name, [0], f"rank 0's {name}", timeout_s)
        return self.store.get(self._key(name, 0)).decode("utf-8")

    def finish(self, timeout_s: float) -> None:
        """Say this rank is done with the store; the rank hosting it waits for every rank's word
        (at most ``timeout_s``: a rank that died says nothing)."""
        try:
            self.store.set(self._key("done", self.rank), "1")
            if self.rank == 0:
                self._wait("done", list(range(self.world_size)), "the other ranks' end", timeout_s)
        except (HopnetError, WaitTimeout):
            pass


__all__ = ["StoreRendezvous"]

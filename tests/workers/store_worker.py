"""A worker for tests/test_store.py: open the run's c10d store and meet the other ranks there."""

from __future__ import annotations

import json
import sys
from datetime import timedelta

from hopnet.bootstrap.env import WorkerEnv
from hopnet.rendezvous.store import connect_store

env = WorkerEnv.from_environ()
assert env is not None and env.store, "started without HOPNET_STORE"
store = connect_store(env.store, timeout_s=30)
store.set(f"test/rank{env.rank}", str(env.rank * 10))
keys = [f"test/rank{r}" for r in range(env.world_size)]
store.wait(keys, timedelta(seconds=30))
values = [int(store.get(k)) for k in keys]
print("STORE", json.dumps({"endpoint": env.store, "values": values}), flush=True)
sys.stdout.flush()

"""A worker for tests/test_torch_collective.py: all-reduces over TorchCollective, results to files.

Every rank runs the same schedule of (group, tag) rounds, skipping the rounds it is not
a member of, and saves each round's input and output (a non-member saves its tensor
untouched) as ``{run_dir}/r{round}_rank{R}_{in|out}.pt``; the cache's size after every
call goes to ``cache_rank{R}.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import torch

from hopnet.collectives.torchdist import TorchCollective
from hopnet.bootstrap.env import WorkerEnv
from hopnet.rendezvous.store import connect_store

parser = argparse.ArgumentParser()
parser.add_argument("--schedule", required=True, help="JSON list of groups, one per round")
parser.add_argument("--max-cached", type=int, default=8)
parser.add_argument("--numel", type=int, default=100_003)
parser.add_argument("--op", default="mean")
args = parser.parse_args()
env = WorkerEnv.from_environ()
assert env is not None
run_dir = Path(env.run_dir)


async def main() -> None:
    coll = TorchCollective(env.rank, env.world_size, connect_store(env.store, 60), timeout_s=60,
                           max_cached=args.max_cached)
    sizes = []
    generator = torch.Generator().manual_seed(1000 + env.rank)
    for rnd, group in enumerate(json.loads(args.schedule)):
        x = torch.randn(args.numel, generator=generator, dtype=torch.float32) * (env.rank + 1)
        torch.save(x.clone(), run_dir / f"r{rnd}_rank{env.rank}_in.pt")
        if env.rank in group:
            await coll.allreduce(group, x, args.op, tag=f"test/{rnd}")
            sizes.append(len(coll.cached_groups))
        torch.save(x, run_dir / f"r{rnd}_rank{env.rank}_out.pt")
    (run_dir / f"cache_rank{env.rank}.json").write_text(json.dumps(
        {"sizes": sizes, "built": coll.built, "uncached_calls": coll.uncached_calls,
         "uncached_groups": [list(g) for g in coll.uncached_groups]}))
    await coll.close()


asyncio.run(main())
print("DONE", flush=True)

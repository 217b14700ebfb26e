"""A worker for tests/test_launcher.py: rendezvous with fake addresses, then do as told."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from hopnet.bootstrap.env import WorkerEnv
from hopnet.rendezvous.client import barrier, exchange_addresses

parser = argparse.ArgumentParser()
parser.add_argument("--pid-dir", default=None)
parser.add_argument("--fail-rank", type=int, default=None)
parser.add_argument("--fail-code", type=int, default=3)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--barrier", action="store_true")
parser.add_argument("--grandchild", action="store_true", help="start a `sleep 60` child first")
parser.add_argument("--ignore-sigterm-rank", type=int, default=None)
args, extra = parser.parse_known_args()

env = WorkerEnv.from_environ()
assert env is not None, "HOPNET_RANK is not set"


def on_sigterm(signum, frame):
    if args.pid_dir:
        with open(os.path.join(args.pid_dir, f"rank{env.rank}.sigterm"), "w") as f:
            f.write("SIGTERM\n")
    if args.ignore_sigterm_rank != env.rank:
        os._exit(0)  # skip the interpreter's teardown (torch makes it slow): we test the launcher


signal.signal(signal.SIGTERM, on_sigterm)

if args.pid_dir:
    pids = [os.getpid()]
    if args.grandchild:
        pids.append(subprocess.Popen(["sleep", "60"]).pid)
    with open(os.path.join(args.pid_dir, f"rank{env.rank}.pid.tmp"), "w") as f:
        f.write(" ".join(map(str, pids)))
    os.replace(os.path.join(args.pid_dir, f"rank{env.rank}.pid.tmp"),
               os.path.join(args.pid_dir, f"rank{env.rank}.pid"))

print("ENV " + json.dumps({"rank": env.rank, "world_size": env.world_size, "local_rank": env.local_rank,
                           "graph": env.graph_path, "run_dir": env.run_dir, "bind": env.bind_host,
                           "protocol": env.config().protocol,
                           "unbuffered": os.environ.get("PYTHONUNBUFFERED")}))
print("ARGV " + json.dumps(extra))
print(f"hello from stderr of {env.rank}", file=sys.stderr)
table = exchange_addresses(env.rendezvous, env.rank, env.world_size, f"tcp://127.0.0.1:1000{env.rank}",
                           timeout_s=20.0)
print("TABLE " + json.dumps(table, sort_keys=True))
if args.fail_rank == env.rank:
    raise SystemExit(args.fail_code)
if args.sleep:
    time.sleep(args.sleep)
if args.barrier:
    barrier(env.rendezvous, env.rank, "done", timeout_s=20.0)
    print("BARRIER done")

"""A worker for tests/test_restarts_launcher.py that needs no rendezvous and no hopnet runtime.

Rank VICTIM dies (SIGKILL, exit 3, SIGSTOP until the launcher kills it, or a ConfigError) unless it is a replacement (``HOPNET_RESTART`` set;
with ``--always`` replacements die too); the other ranks sleep a little and exit 0. A
replacement writes ``rank{R}.restart{N}.json`` into OUT_DIR (its pid and the restart
variables it saw), sleeps ``--hold`` seconds and exits 0. Every process writes its pid to
``rank{R}.{N}.pid`` (N = 0 for the first one).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("victim", type=int)
parser.add_argument("out_dir")
parser.add_argument("--how", choices=("kill", "exit", "stop", "config"), default="kill")
parser.add_argument("--always", action="store_true", help="replacements die as well")
parser.add_argument("--sleep", type=float, default=1.0, help="how long the other ranks run")
parser.add_argument("--hold", type=float, default=0.0, help="how long a replacement runs")
args = parser.parse_args()

rank = int(os.environ["HOPNET_RANK"])
restart = os.environ.get("HOPNET_RESTART")
out = Path(args.out_dir)


def write(name: str, text: str) -> None:
    tmp = out / (name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, out / name)


signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
write(f"rank{rank}.{restart or 0}.pid", str(os.getpid()))
if rank == args.victim and (restart is None or args.always):
    if args.how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif args.how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)  # silent until the launcher kills it
    elif args.how == "config":
        from hopnet.errors import ConfigError

        raise ConfigError("this rank's configuration is wrong")
    os._exit(3)
if restart is not None:
    write(f"rank{rank}.restart{restart}.json", json.dumps({
        "pid": os.getpid(), "HOPNET_RESTART": restart, "HOPNET_MAX_RESTARTS": os.environ.get("HOPNET_MAX_RESTARTS")}))
    time.sleep(args.hold)
    raise SystemExit(0)
time.sleep(args.sleep)

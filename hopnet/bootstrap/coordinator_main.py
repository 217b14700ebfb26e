"""``python -m hopnet.bootstrap.coordinator_main``: the coordinator process `hopnet launch` starts.

    python -m hopnet.bootstrap.coordinator_main --graph G.json --config JSON [--run-dir D] [--bind HOST]

It builds the state machine the configuration names (:func:`hopnet.coordinator.make_coordinator`),
binds a ROUTER on a free port, prints ``HOPNET_COORDINATOR=tcp://HOST:PORT`` as its first
line (the launcher reads it and hands the address to the workers), and serves until
SIGTERM, which ends it cleanly with a ``stop`` record in ``D/coordinator.jsonl``. It arms
the launcher watch (:mod:`hopnet.bootstrap.parent_watch`) first, so it never outlives its
launcher. Exit status: 0 after SIGTERM, 2 for bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from types import FrameType

from hopnet.config import ProtocolConfig
from hopnet.coordinator import make_coordinator
from hopnet.coordinator.server import ADDRESS_PREFIX, CoordinatorServer
from hopnet.errors import ConfigError
from hopnet.graph import Graph
from hopnet.bootstrap import parent_watch
from hopnet.bootstrap.env import Restarts
from hopnet.bootstrap.title import coordinator_title, set_title
from hopnet.security import keys_from_environ


def main(argv: list[str] | None = None) -> int:
    parent_watch.start()
    parser = argparse.ArgumentParser(prog="python -m hopnet.bootstrap.coordinator_main")
    parser.add_argument("--graph", required=True, help="graph JSON the launcher wrote")
    parser.add_argument("--config", required=True, help="the protocol configuration as JSON")
    parser.add_argument("--run-dir", default=None, help="where coordinator.jsonl goes")
    parser.add_argument("--bind", default="127.0.0.1", help="host to bind (default 127.0.0.1)")
    args = parser.parse_args(argv)
    set_title(coordinator_title(args.run_dir))
    try:
        config = ProtocolConfig.from_json(args.config)
        graph = Graph.from_json(args.graph)
        machine = make_coordinator(config, graph)
        if machine is None:
            raise ConfigError(f"--protocol {config.protocol} needs no coordinator")
        server = CoordinatorServer(machine, bind_host=args.bind, peer_timeout_s=config.peer_timeout_s,
                                   run_dir=args.run_dir, curve=keys_from_environ(),
                                   restarts=Restarts.from_environ(os.environ).allowed > 0)
    except (ConfigError, OSError, ValueError) as exc:
        print(f"hopnet coordinator: error: {exc}", file=sys.stderr, flush=True)
        return 2

    def on_signal(signum: int, frame: FrameType | None) -> None:
        server.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"{ADDRESS_PREFIX}{server.address}", flush=True)
    server.run()
    return 0


if __name__ == "__main__":
    from hopnet.bootstrap.worker_main import leave

    leave(main())  # without the interpreter's teardown, which the launcher would wait for

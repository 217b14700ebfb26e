"""``python -m hopnet.bootstrap.store_main --host HOST [--run-dir D]``: the run's c10d store in a
process of its own, which `hopnet launch` forks from its fork server (:mod:`hopnet.launch.run_store`).

It hosts a torch ``TCPStore`` (:func:`hopnet.rendezvous.store.host_store`), prints
``HOPNET_STORE=HOST:PORT`` as its first line, and serves until SIGTERM or SIGINT. It arms the
launcher watch (:mod:`hopnet.bootstrap.parent_watch`) first, so it never outlives its launcher.
Exit status: 0 after SIGTERM, 2 when the store cannot be hosted (one line on stderr)."""

from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType

from hopnet.bootstrap import parent_watch
from hopnet.bootstrap.title import set_title, store_title
from hopnet.errors import HopnetError
from hopnet.rendezvous.store import host_store

ENDPOINT_PREFIX = "HOPNET_STORE="


def main(argv: list[str] | None = None) -> int:
    parent_watch.start()
    parser = argparse.ArgumentParser(prog="python -m hopnet.bootstrap.store_main")
    parser.add_argument("--host", default="127.0.0.1", help="the host name the workers reach it by")
    parser.add_argument("--run-dir", default=None, help="the run directory (for the process title)")
    args = parser.parse_args(argv)
    set_title(store_title(args.run_dir))
    try:
        hosted = host_store(args.host)
    except HopnetError as exc:
        print(f"hopnet store: error: {exc}", file=sys.stderr, flush=True)
        return 2
    stopping: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopping.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"{ENDPOINT_PREFIX}{hosted.endpoint}", flush=True)
    while not stopping:
        signal.pause()
    hosted.close()
    return 0


if __name__ == "__main__":
    from hopnet.bootstrap.worker_main import leave

    leave(main())  # without the interpreter's teardown, which the launcher would wait for

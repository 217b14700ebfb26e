"""Hop on the torch plane across a slow link: is a transfer that outlasts --peer-timeout taken for a death?

Two emulated hosts (bench/netns_hosts.py; needs root), 2 workers each on ring:4, host 1's link
capped with ``tc tbf`` at RATE; tests/workers/hop_worker.py with DIM float64 parameters, so each
update crosses the cap for DIM * 8 / RATE seconds (two edges cross each way). Prints both
launchers' exit codes and, per rank, its ``peer_dead`` records (none expected) and its longest
wait for updates. Heartbeats travel apart from the payloads on this plane, so only a small
message's own delay on the saturated link counts against --peer-timeout.

    python bench/torch_plane_slow_link.py --rate 8mbit --dim 750000 --iterations 6 --peer-timeout 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from netns_hosts import NamespacedHosts, unavailable_reason  # noqa: E402

LAUNCH = [sys.executable, "-m", "hopnet.cli.main", "launch"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="8mbit", help="host 1's link cap (tc tbf rate)")
    parser.add_argument("--dim", type=int, default=750_000, help="float64 parameters per worker")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--peer-timeout", default="5")
    parser.add_argument("--out", type=Path, default=None, help="run directories (default: a fresh temp dir)")
    args = parser.parse_args()
    why_not = unavailable_reason()
    if why_not is not None:
        sys.exit(f"no emulated hosts: {why_not}")
    out = args.out or Path(tempfile.mkdtemp(prefix="slowlink"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
           "PYTHONUNBUFFERED": "1"}
    with NamespacedHosts(2) as hosts:
        hosts.cap(1, args.rate)
        procs = []
        started = time.monotonic()
        try:
            for node in (0, 1):
                argv = [*LAUNCH, "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint",
                        f"{hosts.addresses[0]}:29851", "--bind", hosts.addresses[node], "--insecure",
                        "--graph", "ring:4", "--bulk", "torch", "--peer-timeout", args.peer_timeout,
                        "--timeout", "120", "--no-progress", "--run-dir", str(out / f"n{node}"),
                        str(ROOT / "tests" / "workers" / "hop_worker.py"), "--dim", str(args.dim),
                        "--compute-ms", "5", "--iterations", str(args.iterations)]
                with open(out / f"launch{node}.txt", "w") as log:
                    procs.append(subprocess.Popen(hosts.command(node, argv), env=env, stdout=log,
                                                  stderr=subprocess.STDOUT, start_new_session=True))
            codes = [p.wait(timeout=600) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    print(f"{args.rate}, dim {args.dim}, --peer-timeout {args.peer_timeout}: exit codes {codes}, "
          f"{time.monotonic() - started:.1f} s; runs in {out}")
    for log in sorted(out.glob("n*/rank*.jsonl")):
        records = [json.loads(line) for line in log.read_text().splitlines() if line.endswith("}")]
        dead = [(r["peer"], r["silent_s"], r["iter"]) for r in records if r["event"] == "peer_dead"]
        waits = [r.get("wait_updates_s", 0.0) for r in records if r["event"] == "iteration"]
        print(f"  {log.name}: peer_dead (peer, silent_s, iter) {dead}; longest wait for updates "
              f"{max(waits, default=0.0):.1f} s")


if __name__ == "__main__":
    main()

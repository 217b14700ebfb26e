"""How fast do workers notice a dead neighbour on their own? (no launcher involved)

Starts ring:N workers (tests/workers/peer_worker.py) with the launcher's environment but
without the launcher, waits until they train, then SIGKILLs or SIGSTOPs one of them and
measures, for each of its two neighbours:

* ``detect_s``: seconds from the signal to the neighbour's ``peer_dead`` record (its
  ``mono`` field: the monotonic clock the processes of one machine share);
* ``silent_s``: the silence at which the neighbour declared it dead (the same record):
  --peer-timeout plus how late the check came;
* ``exit_s``: seconds from the signal to the neighbour's exit (it fails naming the peer,
  closes and exits; on a loaded machine the interpreter's teardown takes a while).

    python bench/dead_peers.py --runs 5                 # ~4 min on 2 cores
    python bench/dead_peers.py --runs 2 --peer-timeout 2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hopnet import Graph, ProtocolConfig  # noqa: E402
from hopnet.launch.env import ENV_VARS, WorkerEnv  # noqa: E402
from hopnet.launch.rendezvous import RendezvousServer  # noqa: E402

WORKER = ROOT / "tests" / "workers" / "peer_worker.py"


def one_run(n: int, victim: int, sig: signal.Signals, config: ProtocolConfig, run_dir: Path) -> list[dict]:
    graph = Graph.ring(n)
    run_dir.mkdir(parents=True)
    graph.to_json(run_dir / "graph.json")
    base = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    base.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    procs: list[subprocess.Popen[bytes]] = []
    with RendezvousServer(n) as server:
        try:
            for rank in range(n):
                env = WorkerEnv(rank=rank, world_size=n, local_rank=rank, graph_path=str(run_dir / "graph.json"),
                                rendezvous=server.endpoint, run_dir=str(run_dir), config_json=config.to_json())
                procs.append(subprocess.Popen([sys.executable, str(WORKER), "--iterations", "1000000",
                                               "--compute-ms", "5"], env={**base, **env.to_environ()},
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                              start_new_session=True))
            log = run_dir / f"rank{victim}.jsonl"
            while not (log.exists() and log.read_text().count('"event":"iteration"') >= 40):
                time.sleep(0.1)
            os.killpg(procs[victim].pid, sig)
            signalled = time.monotonic()
            results = []
            for rank in sorted(graph.peers(victim)):
                procs[rank].wait(timeout=config.timeout_s)
                exit_s = time.monotonic() - signalled
                records = [json.loads(line) for line in (run_dir / f"rank{rank}.jsonl").read_text().splitlines()]
                dead = next(r for r in records if r["event"] == "peer_dead")
                failure = json.loads((run_dir / f"failure_rank{rank}.json").read_text())
                results.append({"rank": rank, "detect_s": dead["mono"] - signalled, "silent_s": dead["silent_s"],
                                "exit_s": exit_s,
                                "peer": failure["peer"], "peer_state": failure["peer_state"]})
            return results
        finally:
            for proc in procs:
                if proc.poll() is None:
                    for s in (signal.SIGCONT, signal.SIGKILL):
                        try:
                            os.killpg(proc.pid, s)
                        except ProcessLookupError:
                            pass
                proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="runs per signal")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--peer-timeout", type=float, default=5.0)
    args = parser.parse_args()
    config = ProtocolConfig(timeout_s=60.0, peer_timeout_s=args.peer_timeout)
    print(f"ring:{args.nproc}, --peer-timeout {args.peer_timeout:g}, --timeout 60, {args.runs} runs per signal, "
          "both neighbours of rank 2 each run; min / median / max")
    print("| signal | signal -> peer_dead, s | silent_s at declaration | signal -> neighbour exited, s | blamed |")
    print("| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for sig in (signal.SIGKILL, signal.SIGSTOP):
            rows = []
            for run in range(args.runs):
                rows += one_run(args.nproc, 2, sig, config, Path(tmp) / f"{sig.name}-{run}")
            blamed = sorted({f"peer {r['peer']} {r['peer_state']}" for r in rows})
            cells = [_spread([r[key] for r in rows]) for key in ("detect_s", "silent_s", "exit_s")]
            print(f"| {sig.name} | {' | '.join(cells)} | {', '.join(blamed)} |", flush=True)


def _spread(values: list[float]) -> str:
    """min / median / max"""
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


if __name__ == "__main__":
    main()

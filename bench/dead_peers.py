"""How fast is a silent worker noticed: by its neighbours alone, and through `hopnet launch`?

**Through the launcher** (``--mode launcher``; issue 17: "a silent worker is named within
--peer-timeout + 2 s"): ``hopnet launch --nproc 4 --protocol P --peer-timeout T`` on
``examples/synthetic.py`` (allreduce, which needs a model: ``examples/train_digits.py``),
with an iteration count it never reaches, for P in hop (standard: no backup workers, so
the run stops) and allreduce. Once the ranks log iterations, plus a
random 0.5-3 s, a random rank gets SIGKILL or SIGSTOP (never continued). Measured from the
signal: ``named_s``, until the launcher prints its first line naming the victim (its
stderr read line by line, each line stamped on arrival), and ``exit_s``, until it exits.
A run still going 90 s after the signal counts as a hang and is killed.

**Neighbours alone** (``--mode peers``): starts ring:N workers (tests/workers/peer_worker.py) with the launcher's environment but
without the launcher, waits until they train, then SIGKILLs or SIGSTOPs one of them and
measures, for each of its two neighbours:

* ``detect_s``: seconds from the signal to the neighbour's ``peer_dead`` record (its
  ``mono`` field: the monotonic clock the processes of one machine share);
* ``silent_s``: the silence at which the neighbour declared it dead (the same record):
  --peer-timeout plus how late the check came;
* ``exit_s``: seconds from the signal to the neighbour's exit (it fails naming the peer,
  closes and exits; on a loaded machine the interpreter's teardown takes a while).

    python bench/dead_peers.py --mode launcher --trials 6        # 6 per protocol and signal, ~8 min on 2 cores
    python bench/dead_peers.py --mode peers --runs 5             # ~4 min on 2 cores
    python bench/dead_peers.py --mode peers --runs 2 --peer-timeout 2
    python bench/dead_peers.py --mode peers --runs 2 --bulk torch --peer-timeout 3 --timeout 20   # the torch plane

With ``--bulk torch`` the workers move their updates over gloo (a store is hosted for them);
their heartbeats go over ZeroMQ as on the other plane. ``detect_s`` is blank for a neighbour
that never declared the victim dead (its wait timed out first, naming it stalled).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))

from faults import LaunchRun, first_naming, inject, workload  # noqa: E402
from hopnet import Graph, ProtocolConfig  # noqa: E402
from hopnet.bootstrap.env import ENV_VARS, WorkerEnv  # noqa: E402
from hopnet.rendezvous.store import host_store  # noqa: E402
from hopnet.rendezvous.server import RendezvousServer  # noqa: E402

WORKER = ROOT / "tests" / "workers" / "peer_worker.py"
HANG_AFTER_S = 90.0


def launcher_trial(protocol: str, fault: str, victim: int, peer_timeout: float, rng: random.Random,
                   run_dir: Path) -> dict:
    """One launch, one fault: seconds from the signal to the launcher's line naming the victim and
    to its exit (None where that never came)."""
    run = LaunchRun.start(["--nproc", "4", "--protocol", protocol, "--peer-timeout", str(peer_timeout),
                           "--timeout", "60", *workload(protocol, 100_000, 20.0)], run_dir)
    pids: dict[int, int] = {}
    result: dict = {"protocol": protocol, "fault": fault, "victim": victim, "named_s": None, "exit_s": None,
                    "exit": None, "line": ""}
    try:
        deadline = time.monotonic() + 120
        pids = run.worker_pids(4, deadline)
        if len(pids) < 4 or not run.wait_training(deadline):
            result["line"] = "never started training"
            return result
        time.sleep(rng.uniform(0.5, 3.0))
        inject(fault, pids[victim])
        signalled = time.monotonic()
        result["exit"] = run.wait(HANG_AFTER_S)
        if result["exit"] is not None:
            result["exit_s"] = time.monotonic() - signalled
        naming = first_naming(run.launcher_lines(), victim, signalled)
        if naming is not None:
            result["named_s"], result["line"] = naming.t - signalled, naming.text
        return result
    finally:
        run.end(pids)


def launcher_mode(args: argparse.Namespace, tmp: Path) -> None:
    rng = random.Random(args.seed)
    target = args.peer_timeout + 2
    print(f"hopnet launch --nproc 4 (ring), examples/synthetic.py --compute-ms 20 (allreduce: "
          f"examples/train_digits.py), --peer-timeout "
          f"{args.peer_timeout:g} (target: named within {target:g} s), {args.trials} trials per row, random victim "
          "and time; min / median / max", flush=True)
    print("| protocol | signal | signal -> launcher names the victim, s | within target | "
          "signal -> launcher exit, s | hangs |\n| --- | --- | --- | --- | --- | --- |", flush=True)
    every = []
    for protocol in args.protocols.split(","):
        for fault in ("SIGSTOP", "SIGKILL"):
            rows = [launcher_trial(protocol, fault, rng.randrange(4), args.peer_timeout, rng,
                                   tmp / f"launch-{protocol}-{fault}-{i}") for i in range(args.trials)]
            every += rows
            named = [r["named_s"] for r in rows if r["named_s"] is not None]
            exits = [r["exit_s"] for r in rows if r["exit_s"] is not None]
            within = sum(s <= target for s in named)
            hangs = sum(r["exit"] is None for r in rows)
            print(f"| {protocol} | {fault} | {_spread(named) if named else '-'} (named {len(named)} of {len(rows)}) | "
                  f"{within} of {len(rows)} | {_spread(exits) if exits else '-'} | {hangs} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(every, indent=1))


def one_run(n: int, victim: int, sig: signal.Signals, config: ProtocolConfig, run_dir: Path,
            store: str = "") -> list[dict]:
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
                                rendezvous=server.endpoint, run_dir=str(run_dir), config_json=config.to_json(),
                                store=store)
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
                procs[rank].wait(timeout=config.timeout_s + 30.0)
                exit_s = time.monotonic() - signalled
                records = [json.loads(line) for line in (run_dir / f"rank{rank}.jsonl").read_text().splitlines()]
                dead = next((r for r in records if r["event"] == "peer_dead"), None)
                failure = json.loads((run_dir / f"failure_rank{rank}.json").read_text())
                results.append({"rank": rank, "detect_s": None if dead is None else dead["mono"] - signalled,
                                "silent_s": None if dead is None else dead["silent_s"], "exit_s": exit_s,
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
    parser.add_argument("--mode", choices=("launcher", "peers", "both"), default="both")
    parser.add_argument("--runs", type=int, default=5, help="peers mode: runs per signal")
    parser.add_argument("--trials", type=int, default=6, help="launcher mode: trials per protocol and signal")
    parser.add_argument("--protocols", default="hop,allreduce", help="launcher mode (default: hop,allreduce)")
    parser.add_argument("--seed", type=int, default=0, help="launcher mode: victims and times")
    parser.add_argument("--json", type=Path, default=None, help="launcher mode: write every trial here")
    parser.add_argument("--nproc", type=int, default=4, help="peers mode")
    parser.add_argument("--peer-timeout", type=float, default=None,
                        help="default: 3 in launcher mode, 5 in peers mode")
    parser.add_argument("--bulk", choices=("auto", "torch"), default="auto",
                        help="peers mode: the plane of the updates (auto: ZeroMQ for these small ones)")
    parser.add_argument("--timeout", type=float, default=60.0, help="peers mode: the workers' --timeout")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.mode in ("launcher", "both"):
            launcher_mode(argparse.Namespace(**{**vars(args), "peer_timeout": args.peer_timeout or 3.0}), Path(tmp))
        if args.mode in ("peers", "both"):
            peers_mode(argparse.Namespace(**{**vars(args), "peer_timeout": args.peer_timeout or 5.0}), Path(tmp))


def peers_mode(args: argparse.Namespace, tmp: Path) -> None:
    config = ProtocolConfig(timeout_s=args.timeout, peer_timeout_s=args.peer_timeout, bulk=args.bulk)
    print(f"ring:{args.nproc}, --bulk {args.bulk}, --peer-timeout {args.peer_timeout:g}, --timeout {args.timeout:g}, "
          f"{args.runs} runs per signal, both neighbours of rank 2 each run; min / median / max")
    print("| signal | signal -> peer_dead, s | silent_s at declaration | signal -> neighbour exited, s | blamed |")
    print("| --- | --- | --- | --- | --- |")
    for sig in (signal.SIGKILL, signal.SIGSTOP):
        rows = []
        for run in range(args.runs):
            if args.bulk == "torch":
                hosted = host_store("127.0.0.1")  # one per run: the pair groups' keys must not meet old ones
                try:
                    rows += one_run(args.nproc, 2, sig, config, tmp / f"{sig.name}-{run}", hosted.endpoint)
                finally:
                    hosted.close()
            else:
                rows += one_run(args.nproc, 2, sig, config, tmp / f"{sig.name}-{run}")
        blamed = sorted({f"peer {r['peer']} {r['peer_state']}" for r in rows})
        cells = [_spread([r[key] for r in rows if r[key] is not None]) for key in ("detect_s", "silent_s", "exit_s")]
        print(f"| {sig.name} | {' | '.join(cells)} | {', '.join(blamed)} |", flush=True)


def _spread(values: list[float]) -> str:
    """min / median / max"""
    if not values:
        return "never"
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


if __name__ == "__main__":
    main()

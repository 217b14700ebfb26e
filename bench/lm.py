"""Time to a target held-out loss on a language model: hopnet's protocols against torch DDP in one invocation.

    python bench/lm.py --scenario none        # 4 workers, homogeneous
    python bench/lm.py --scenario straggler   # rank 0 4x slower (--slowdown rank=0:4; DDP: the same stretch)
    sudo python bench/lm.py --scenario link   # two emulated hosts of 2 workers, host 1's link capped at 10 mbit
    python bench/lm.py --preset small --iterations 600 --eval-every 50   # 10.7M parameters: a bigger machine

Every run trains examples/train_lm.py (the byte-level decoder on the stdlib's source, AdamW,
warm-up + cosine, two micro-batches, clipping, bf16) for ``--iterations`` on ``--nproc`` workers:
DDP first, through torchrun and its twin bench/lm_ddp.py (gloo), then each hopnet run through
``hopnet launch`` with the example unchanged. The **target** is the held-out loss DDP reaches after
``--budget`` of its ``--iterations`` (default: half; every run has the same schedule, so that a
protocol whose iterations each gain less than DDP's has room to get there in more of them). A
run's time to target is the time until *every* worker's own model first scores at or below it
(each worker's clock from the start of its training loop, evaluated every ``--eval-every``
iterations; the evaluations' own time is in it, alike for all). ``DDP / this`` above 1 is sooner than DDP. Hop runs with the options the README gives for
a persistent straggler under ``--scenario straggler`` (``hop-skip``); ``diloco-avg`` is DiLoCo with
a plain average for its outer step (``--outer-lr 1 --outer-momentum 0``), ``allreduce-torch`` the
all-reduce over gloo (``--bulk torch``); ``--runs`` picks others. Under ``--scenario link`` the 4 workers
are 2 on each of two emulated hosts (bench/netns_hosts.py: network namespaces on a bridge, as root),
host 1's link capped at ``--cap`` both ways with ``tc ... tbf``; DDP runs one torchrun per host, hopnet
one launcher per host (``--nnodes 2``), and each row also gives the megabytes that crossed the link.

    python bench/lm.py --table diloco   # loss against inner steps and bytes: DiLoCo H=1-200, int8, allreduce
    python bench/lm.py --table memory   # peak RSS per worker and the share of time waiting, per protocol

(bench/lm_tables.py describes those two.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netns_hosts import NamespacedHosts, unavailable_reason  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_lm.py"
TWIN = ROOT / "bench" / "lm_ddp.py"

SCENARIOS = {"none": [], "straggler": ["rank=0:4"], "link": []}
LINKED = {"link"}
"""Scenarios on two emulated hosts (host 1's link capped) rather than one machine."""
RUNS = {
    "allreduce": ["--protocol", "allreduce"],
    "hop": [],
    "hop-skip": ["--backup-workers", "1", "--skip-threshold", "2", "--max-jump", "10", "--max-ig", "4"],
    "ad-psgd": ["--protocol", "ad-psgd"],
    "partial-reduce": ["--protocol", "partial-reduce"],
    "diloco": ["--protocol", "diloco", "--local-steps", "10"],
    "diloco-avg": ["--protocol", "diloco", "--local-steps", "10", "--outer-lr", "1", "--outer-momentum", "0"],
    "diloco-quorum": ["--protocol", "diloco", "--local-steps", "10", "--outer-quorum", "3"],
    "allreduce-torch": ["--protocol", "allreduce", "--bulk", "torch"],
    "hop-stale": ["--backup-workers", "1", "--staleness", "8", "--max-ig", "16"],
    "diloco-h50-int8": ["--protocol", "diloco", "--local-steps", "50", "--compress", "int8"],
    "diloco-h50-int8-x4": ["--protocol", "diloco", "--local-steps", "50", "--compress", "int8"],
}
LONGER = {"diloco-h50-int8-x4": 4}
"""Runs given this many times ``--iterations`` (their schedule stretched with them): a protocol whose
iterations are cheap on a slow link may reach the target in more of them, sooner."""
DEFAULT_RUNS = {"none": "ddp,allreduce,allreduce-torch,hop,ad-psgd,partial-reduce,diloco,diloco-avg",
                "straggler": "ddp,allreduce,hop-skip,ad-psgd,partial-reduce,diloco,diloco-avg",
                "link": "ddp,allreduce,hop-stale,ad-psgd,partial-reduce,diloco,diloco-h50-int8"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def iterations_of(name: str, args: argparse.Namespace) -> int:
    return args.iterations * LONGER.get(name, 1)


def example_args(args: argparse.Namespace, iterations: int | None = None) -> list[str]:
    iterations = args.iterations if iterations is None else iterations
    return ["--preset", args.preset, "--iterations", str(iterations), "--eval-every", str(args.eval_every),
            "--seed", str(args.seed), "--device", args.device, *args.example_args.split()]


def run(name: str, cmds: list[list[str]], extra_env: dict[str, str] | None = None) -> float:
    """Run ``cmds`` side by side (one per host); every one must succeed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [
        str(ROOT), os.environ.get("PYTHONPATH")])), **(extra_env or {}))
    start = time.monotonic()
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in cmds]
    outputs = [proc.communicate(timeout=3600)[0] for proc in procs]
    for proc, output in zip(procs, outputs):
        if proc.returncode != 0:
            for other in procs:
                other.kill()
            tail = "\n".join(output.strip().splitlines()[-20:])
            raise SystemExit(f"bench/lm.py: {name} failed (exit {proc.returncode}):\n{tail}")
    return time.monotonic() - start


def run_ddp(run_dir: Path, slowdown: list[str], args: argparse.Namespace,
            hosts: NamespacedHosts | None = None) -> list[list[tuple[int, float, float]]]:
    twin = [str(TWIN), "--out", str(run_dir), *[f"--slowdown={spec}" for spec in slowdown], *example_args(args)]
    port = free_port()
    if hosts is None:
        cmds = [[sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
                 "--master-addr", "127.0.0.1", "--master-port", str(port), *twin]]
    else:
        cmds = [hosts.command(node, [
            "env", f"GLOO_SOCKET_IFNAME={hosts.inner[node]}", sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2", "--nproc-per-node", str(args.nproc // 2), "--node-rank", str(node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.addresses[0]}:{port}",
            "--local-addr", hosts.addresses[node],  # both namespaces share one host name
            "--rdzv-conf", f"is_host={int(node == 0)}", *twin]) for node in range(2)]
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("lm_rank*.json"):
        old.unlink()
    run("ddp", cmds)
    ranks = [json.loads((run_dir / f"lm_rank{r}.json").read_text()) for r in range(args.nproc)]
    return [[(int(i), float(t), float(loss)) for i, t, loss in data["evals"]] for data in ranks]


def run_hopnet(name: str, run_dir: Path, slowdown: list[str], args: argparse.Namespace,
               hosts: NamespacedHosts | None = None, *, flags: list[str] | None = None, script: Path = EXAMPLE,
               extra_env: dict[str, str] | None = None) -> tuple[list[list[tuple[int, float, float]]], float | None]:
    """``hopnet launch`` of ``script`` (the example, or a wrapper that runs it) with the launcher's
    ``flags`` (default: ``RUNS[name]``): each rank's evaluations (iteration, seconds, loss) and the
    consensus model's loss."""
    def launch(node_dir: Path, multi: list[str]) -> list[str]:
        return [sys.executable, "-m", "hopnet.cli.main", "launch", "--nproc", str(args.nproc), *multi,
                "--run-dir", str(node_dir), "--overwrite", "--no-progress", "--seed", str(args.seed),
                *(RUNS[name] if flags is None else flags), *[f"--slowdown={spec}" for spec in slowdown],
                str(script), *example_args(args, iterations_of(name, args))]

    if hosts is None:
        dirs, cmds = [run_dir], [launch(run_dir, [])]
    else:
        port = free_port()
        dirs = [run_dir / f"node{node}" for node in range(2)]
        cmds = [hosts.command(node, launch(dirs[node], [
            "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", f"{hosts.addresses[0]}:{port}",
            "--bind", hosts.addresses[node], "--insecure"])) for node in range(2)]
    run(name, cmds, extra_env)
    evals: list[list[tuple[int, float, float]]] = []
    consensus = None
    for r in range(args.nproc):
        (log,) = [d / f"rank{r}.jsonl" for d in dirs if (d / f"rank{r}.jsonl").exists()]
        mine = []
        for line in log.read_text().splitlines():
            record = json.loads(line)
            if record.get("event") != "eval":
                continue
            if record.get("consensus"):
                consensus = record["loss"] if consensus is None else consensus
            else:
                iteration = iterations_of(name, args) - 1 if record.get("final") else record["iter"]
                mine.append((int(iteration), float(record["elapsed"]), float(record["loss"])))
        evals.append(mine)
    return evals, consensus


def summarize(name: str, evals: list[list[tuple[int, float, float]]], consensus: float | None,
              target: float, args: argparse.Namespace) -> dict:
    reach = [next(((t, i + 1) for i, t, loss in rank if i >= 0 and loss <= target), (math.inf, math.inf))
             for rank in evals]
    finals = [rank[-1][2] for rank in evals]
    return {"name": name, "to_target_s": max(t for t, _ in reach), "iters_to_target": max(i for _, i in reach),
            "s_per_iteration": statistics.mean(rank[-1][1] for rank in evals) / iterations_of(name, args),
            "final_worst": max(finals), "final_best": min(finals),
            "consensus": finals[0] if consensus is None else consensus}


def link_bytes(hosts: NamespacedHosts | None) -> int:
    """Bytes host 1's link carried so far, both ways (its veth's counters)."""
    if hosts is None:
        return 0
    stats = Path("/sys/class/net") / hosts.outer[1] / "statistics"
    return sum(int((stats / name).read_text()) for name in ("rx_bytes", "tx_bytes"))


def measure(names: list[str], budget: int, args: argparse.Namespace,
            hosts: NamespacedHosts | None) -> tuple[list[dict], float]:
    """DDP, then each of ``names[1:]``: a row each, and the target DDP set."""
    slowdown = SCENARIOS[args.scenario]
    out = Path(args.out).resolve() / args.scenario
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    before = link_bytes(hosts)
    ddp_evals = run_ddp(out / "ddp", slowdown, args, hosts)
    ddp_mb = (link_bytes(hosts) - before) / 1e6
    at_budget = [loss for i, _, loss in ddp_evals[0] if i + 1 == budget]
    if not at_budget:
        raise SystemExit(f"bench/lm.py: error: --budget {budget} is not an evaluation point (--eval-every)")
    target = at_budget[0]
    print(f"target: held-out loss {target:.4f}, DDP's after {budget} of {args.iterations} iterations", flush=True)
    rows = [summarize("ddp", ddp_evals, None, target, args) | {"link_mb": ddp_mb}]
    for name in names[1:]:
        before = link_bytes(hosts)
        try:
            evals, consensus = run_hopnet(name, out / name, slowdown, args, hosts)
        except SystemExit as failed:  # one run's failure is a row of the table, not the end of the others
            print(failed, file=sys.stderr, flush=True)
            rows.append({"name": f"{name} (failed)", "to_target_s": math.inf, "iters_to_target": math.inf,
                         "s_per_iteration": math.nan, "final_worst": math.nan, "final_best": math.nan,
                         "consensus": math.nan, "link_mb": math.nan})
            continue
        rows.append(summarize(name, evals, consensus, target, args) | {"link_mb": (link_bytes(hosts) - before) / 1e6})
    return rows, target


TABLE_DEFAULTS = {"diloco": 600, "memory": 100}
"""--table's own default --iterations (4 workers on 2 cores: about 15 and 3 minutes for the tiny preset)."""


def run_table(args: argparse.Namespace) -> None:
    """--table diloco or memory (bench/lm_tables.py); memory evaluates only after the last iteration."""
    import lm_tables

    args.iterations = args.iterations or TABLE_DEFAULTS[args.table]
    args.eval_every = args.eval_every or (50 if args.table == "diloco" else args.iterations)
    runs = lm_tables.TABLES[args.table]
    names = args.runs.split(",") if args.runs else lm_tables.DEFAULT_RUNS[args.table]
    if any(n not in runs for n in names):
        raise SystemExit(f"bench/lm.py: error: --table {args.table} runs are {', '.join(runs)}")
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    lm_tables.main(args.table, names, Path(args.out).resolve() / args.table, args)
    print(f"load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", choices=["time", *TABLE_DEFAULTS], default="time",
                        help="time: to DDP's target (the default); diloco, memory: bench/lm_tables.py")
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="none")
    parser.add_argument("--runs", default=None, help=f"comma-separated, ddp first; of ddp, {', '.join(RUNS)} "
                        "(--table diloco, memory: of bench/lm_tables.py's)")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--iterations", type=int, default=None, help="(default: 200; diloco 600; memory 100)")
    parser.add_argument("--eval-every", type=int, default=None, help="(default: 10; diloco 50; memory: none)")
    parser.add_argument("--budget", type=int, default=None,
                        help="DDP's iterations that set the target (default: half of --iterations)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--example-args", default="", help="more flags for examples/train_lm.py, quoted")
    parser.add_argument("--out", default="runs/bench-lm")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--cap", default="10mbit", help="--scenario link: tbf rate of host 1's link")
    args = parser.parse_args()
    if args.table != "time":
        run_table(args)
        return
    args.iterations = args.iterations or 200
    args.eval_every = args.eval_every or 10
    budget = args.budget or args.eval_every * max(1, round(0.5 * args.iterations / args.eval_every))
    names = (args.runs or DEFAULT_RUNS[args.scenario]).split(",")
    if names[0] != "ddp" or any(n not in RUNS for n in names[1:]):
        raise SystemExit(f"bench/lm.py: error: --runs must start with ddp and name runs of {', '.join(RUNS)}")
    if args.scenario in LINKED:
        why = unavailable_reason()
        if why is not None:
            raise SystemExit(f"bench/lm.py: error: --scenario {args.scenario} emulates two hosts: {why}")
        if args.nproc % 2:
            raise SystemExit("bench/lm.py: error: --scenario link puts half the workers on each host: an even --nproc")
        with NamespacedHosts(2) as hosts:
            hosts.cap(1, args.cap)
            rows, target = measure(names, budget, args, hosts)
    else:
        rows, target = measure(names, budget, args, None)
    for row in rows:
        print(f"{args.scenario} {row['name']}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                          for k, v in row.items() if k != "name"), flush=True)
    print(f"load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")

    ddp = rows[0]
    linked = args.scenario in LINKED
    print(f"\n| {args.scenario}: run | s / iteration | s to {target:.3f} (all workers) | DDP / this | "
          "iterations to target | final loss (worst worker) | consensus model |" + (" MB across the link |" * linked))
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" * linked))
    for r in rows:
        reached = math.isfinite(r["to_target_s"])
        print(f"| {r['name']} | {r['s_per_iteration']:.3f} | {r['to_target_s']:.1f} | "
              f"{ddp['to_target_s'] / r['to_target_s'] if reached else 0.0:.2f}x | "
              f"{r['iters_to_target'] if reached else 'not reached'} | {r['final_worst']:.4f} | {r['consensus']:.4f} |"
              + (f" {r['link_mb']:.1f} |" * linked))
    if args.json:
        Path(args.json).write_text(json.dumps({"target": target, "budget": budget, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

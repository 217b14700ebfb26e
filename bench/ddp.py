"""hopnet's protocols against torch DDP (gloo): the same model and data, side by side in one run.

    python bench/ddp.py --scenario none        # allreduce, Hop, Hop backup+skip and DDP, no slowdown
    python bench/ddp.py --scenario straggler   # the same with --slowdown rank=0:4 (DDP: the same stretch)
    python bench/ddp.py --scenario random      # the same with --slowdown random:6:0.125
    python bench/ddp.py --runs ddp,allreduce-torch,allreduce   # the all-reduce over gloo and over the ring
    python bench/ddp.py --workload wide --nproc 4 --runs ddp,allreduce,allreduce-b0   # real compute, 51 MB
    python bench/ddp.py --workload wide --device cuda --nproc 2 --runs ddp,allreduce  # a GPU per rank: NCCL

Every run trains examples/train_digits.py's MLP (64-64-10, SGD momentum 0.9, cosine
learning rate, batches of 32 from the rank's shard, held-out accuracy on the shared test
split) on --nproc workers, with --compute-ms of emulated compute per iteration (a sleep
before the forward pass). ``--workload wide`` trains a wide MLP on the same data instead
(``--layers`` layers of ``--hidden`` units: 51 MB of parameters by default, whose backward pass
takes about as long as its all-reduce), with real compute only (``--compute-ms`` 0 unless given):
what the gradient buckets (``--bucket-mb``) overlap; run ``allreduce-b0`` is ``allreduce`` with
``--bucket-mb 0``, one all-reduce after the backward pass. hopnet runs go through ``hopnet launch`` (this file is the
worker script, ``--role hopnet``); DDP runs through torchrun (``--role ddp``), with the
slowdown applied the way hopnet's ``Worker.step`` does it: the time since the previous
step ended is stretched by the rank's factor (hopnet.slowdown.Slowdown, the same seed, so
both slow down exactly the same (rank, iteration) pairs). ``--straggler-ms X`` adds X ms of
compute, each iteration, to exactly one rank, ``straggler(seed, iteration)``, in either role
(bench/eager.py's setting).

Each worker writes ``bench_rank{R}.json`` into its run directory: when each iteration
ended (its monotonic clock, from the start of its first iteration), the held-out accuracy
every --eval-every iterations, and how each iteration split on the trainer's clock into
forward (with the sleep; DDP: and --slowdown), backward (which waits for DDP's gradient
all-reduce, and hopnet's buckets) and the optimizer step (hopnet: with what is left to
reduce, and --slowdown). hopnet's rows add its event log's split (``iteration`` records:
compute_s, wait_updates_s, wait_tokens_s, mix_s). See docs/performance/index.md ("Against DDP:
emulated compute", "Against DDP: real compute", "Time to accuracy against DDP").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

SCENARIOS = {"none": [], "straggler": ["rank=0:4"], "random": ["random:6:0.125"]}
HOP_SKIP_FLAGS = ["--backup-workers", "1", "--skip-threshold", "2", "--max-jump", "10", "--max-ig", "4"]


# ---------------------------------------------------------------------------- workers
def straggler(seed: int, iteration: int, world_size: int) -> int:
    """The one rank that gets ``--straggler-ms`` extra compute in ``iteration``: a pure function
    of (seed, iteration), so every rank (and every run, hopnet or DDP) agrees with no messages."""
    digest = hashlib.blake2b(f"straggler:{seed}:{iteration}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % world_size


def load_shard(rank: int, world_size: int, seed: int) -> tuple["torch.Tensor", ...]:
    """This rank's strided shard of digits' training split, and the whole held-out split (the
    batches are drawn from it with replacement: the figures in the docs were measured so)."""
    from digits_data import digits_split

    x_train, y_train, x_test, y_test = digits_split(seed)
    return x_train[rank::world_size], y_train[rank::world_size], x_test, y_test


def build_model(args: argparse.Namespace) -> "torch.nn.Module":
    import torch

    if args.workload == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    layers: list[torch.nn.Module] = [torch.nn.Linear(64, args.hidden), torch.nn.ReLU()]
    for _ in range(args.layers - 2):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(args.hidden, 10))


def train(role: str, args: argparse.Namespace) -> None:
    import torch

    from train_digits import accuracy

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = build_model(args)
    device = torch.device("cpu")
    if args.device == "cuda":  # one GPU per rank: the rank's local rank among the visible GPUs
        local = os.environ.get("HOPNET_LOCAL_RANK" if role == "hopnet" else "LOCAL_RANK", "0")
        device = torch.device("cuda", int(local) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        model = model.to(device)
    loss_fn = torch.nn.CrossEntropyLoss()
    compute_s = args.compute_ms / 1000.0
    now = time.monotonic
    ends: list[tuple[int, float]] = []
    evals: list[tuple[int, float, float]] = []
    split: list[tuple[float, float, float]] = []

    if role == "hopnet":
        import hopnet

        worker = hopnet.init(model)
        optimizer = hopnet.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                                worker)
        rank, world = worker.rank, worker.graph.n
        steps = worker.iterations(args.iterations)
        forward_model = model
    else:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        from hopnet.slowdown import Slowdown

        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        forward_model = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        optimizer = torch.optim.SGD(forward_model.parameters(), lr=args.lr, momentum=0.9)
        slowdown = Slowdown.from_specs(args.slowdown, seed=args.seed)
        steps = iter(range(args.iterations))

    x_train, y_train, x_test, y_test = (t.to(device) for t in load_shard(rank, world, args.seed))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)  # a split's clock reads done work
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    next_eval = args.eval_every
    t0 = now()
    step_ended = t0
    for step in steps:
        for group in optimizer.param_groups:
            group["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.iterations))
        previous_end = step_ended
        slow = args.straggler_ms / 1000.0 if args.straggler_ms and straggler(args.seed, step, world) == rank else 0.0
        time.sleep(compute_s + slow)
        batch = torch.randint(len(x_train), (args.batch_size,), generator=generator).to(device)
        optimizer.zero_grad()
        loss = loss_fn(forward_model(x_train[batch]), y_train[batch])
        if role == "ddp":
            factor = slowdown.factor(rank, step)
            if factor > 1.0:
                time.sleep((factor - 1.0) * (now() - step_ended))
        sync()
        forward_done = now()
        loss.backward()  # the gradient all-reduce (DDP's, hopnet's buckets) finishes inside
        sync()
        backward_done = now()
        optimizer.step()  # (hopnet: what the backward pass left to reduce, the step, --slowdown)
        sync()
        step_ended = now()
        split.append((forward_done - previous_end, backward_done - forward_done, step_ended - backward_done))
        ends.append((step, step_ended - t0))
        if step + 1 >= next_eval:
            evals.append((step, now() - t0, accuracy(model, x_test, y_test)))
            while next_eval <= step + 1:
                next_eval += args.eval_every
    evals.append((ends[-1][0], now() - t0, accuracy(model, x_test, y_test)))

    run_dir = Path(os.environ.get("HOPNET_RUN_DIR") or args.out)
    (run_dir / f"bench_rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "role": role, "ends": ends, "evals": evals, "split": split}))
    if role == "hopnet":
        worker.close()
    else:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- driver
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_args(args: argparse.Namespace) -> list[str]:
    return ["--iterations", str(args.iterations), "--compute-ms", str(args.compute_ms),
            "--eval-every", str(args.eval_every), "--lr", str(args.lr), "--seed", str(args.seed),
            "--straggler-ms", str(getattr(args, "straggler_ms", 0.0)), "--workload", args.workload,
            "--hidden", str(args.hidden), "--layers", str(args.layers), "--batch-size", str(args.batch_size),
            "--device", args.device]


def run_hopnet(name: str, flags: list[str], slowdown: list[str], run_dir: Path, args: argparse.Namespace) -> float:
    cmd = [sys.executable, "-m", "hopnet.cli.main", "launch", "--nproc", str(args.nproc), "--run-dir", str(run_dir),
           "--overwrite", "--no-progress", "--seed", str(args.seed), *flags]
    for spec in slowdown:
        cmd += ["--slowdown", spec]
    cmd += [str(Path(__file__).resolve()), "--role", "hopnet", *worker_args(args)]
    return _run(name, cmd, run_dir)


def run_ddp(slowdown: list[str], run_dir: Path, args: argparse.Namespace) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(Path(__file__).resolve()), "--role", "ddp", "--out", str(run_dir), *worker_args(args)]
    for spec in slowdown:
        cmd += ["--slowdown", spec]
    return _run("ddp", cmd, run_dir)


def _run(name: str, cmd: list[str], run_dir: Path) -> float:
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("bench_rank*.json"):
        old.unlink()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    start = time.monotonic()
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - start
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise SystemExit(f"{name} failed (exit {result.returncode}):\n{tail}")
    return wall


def summarize(name: str, run_dir: Path, nproc: int, wall: float, args: argparse.Namespace) -> dict:
    ranks = [json.loads((run_dir / f"bench_rank{r}.json").read_text()) for r in range(nproc)]
    warm = args.warmup
    per_iter = []
    reach = []
    reach_iters: list[float] = []
    final = []
    for data in ranks:
        ends = data["ends"]
        before = [t for k, t in ends if k < warm]
        after = [(k, t) for k, t in ends if k >= warm]
        if before and after:
            per_iter.append((after[-1][1] - before[-1]) / (after[-1][0] - ends[len(before) - 1][0]))
        hit = [(t, k + 1) for k, t, acc in data["evals"] if acc >= args.target]
        reach.append(hit[0][0] if hit else math.inf)
        reach_iters.append(hit[0][1] if hit else math.inf)
        final.append(data["evals"][-1][2])
    row = {"name": name, "ms_per_iter": 1e3 * statistics.mean(per_iter), "to_target_max": max(reach),
           "to_target_median": statistics.median(reach), "iters_to_target_max": max(reach_iters),
           "final_acc_min": min(final),
           "final_acc_mean": statistics.mean(final), "train_s": max(d["ends"][-1][1] for d in ranks),
           "process_wall_s": wall}
    row["split_ms"] = split_ms(run_dir, ranks, warm)
    return row


def split_ms(run_dir: Path, ranks: list[dict], warm: int) -> dict[str, float]:
    """Mean per-iteration split over the ranks and the iterations from --warmup on."""
    sums: dict[str, list[float]] = {}
    for data in ranks:  # the trainer's own clock, the same for both roles
        for (k, _), parts in zip(data["ends"], data["split"]):
            if k >= warm:
                for key, value in zip(("forward", "backward+allreduce", "step"), parts):
                    sums.setdefault(key, []).append(value)
    if ranks[0]["role"] == "hopnet":
        for log in sorted(run_dir.glob("rank*.jsonl")):
            for line in log.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("event") == "iteration" and rec.get("iter", -1) >= warm and "compute_s" in rec:
                    for key in ("compute_s", "wait_updates_s", "wait_tokens_s", "mix_s"):
                        sums.setdefault(key.removesuffix("_s"), []).append(rec.get(key, 0.0))
    return {key: 1e3 * statistics.mean(values) for key, values in sums.items()}


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    ddp = next(r for r in rows if r["name"] == "ddp")
    print(f"\n| run | ms / iteration | DDP / this (per iteration) | s to {args.target:.2f} (all workers) | "
          "median worker | DDP / this (to target) | iterations to target (max) | final acc (min) | "
          "split, ms / iteration |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        ratio_target = ddp["to_target_max"] / r["to_target_max"] if math.isfinite(r["to_target_max"]) else 0.0
        split = ", ".join(f"{k} {v:.1f}" for k, v in r["split_ms"].items())
        print(f"| {r['name']} | {r['ms_per_iter']:.1f} | {ddp['ms_per_iter'] / r['ms_per_iter']:.2f}x | "
              f"{r['to_target_max']:.2f} | {r['to_target_median']:.2f} | {ratio_target:.2f}x | "
              f"{r['iters_to_target_max']} | {r['final_acc_min']:.3f} | {split} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["driver", "hopnet", "ddp"], default="driver")
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="none")
    parser.add_argument("--runs", default=None,
                        help="which runs, in order, of ddp, allreduce, allreduce-b0, allreduce-torch, pipe-sgd "
                             "(K=1), hop, hop-skip (default: ddp,allreduce,hop,hop-skip without slowdown, "
                             "ddp,hop,hop-skip with)")
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20, help="iterations left out of ms / iteration")
    parser.add_argument("--compute-ms", type=float, default=None,
                        help="emulated compute per iteration (default 40 for --workload mlp, 0 for wide)")
    parser.add_argument("--workload", choices=["mlp", "wide"], default="mlp",
                        help="mlp: 64-64-10 (154 KB) with emulated compute; wide: --layers x --hidden, real compute")
    parser.add_argument("--hidden", type=int, default=2048, help="(wide) units per hidden layer")
    parser.add_argument("--layers", type=int, default=5, help="(wide) linear layers: 5 x 2048 is 51 MB of fp32")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.9, help="held-out accuracy to reach")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: each rank on the GPU of its local rank (DDP over NCCL; hopnet's --bulk auto "
                             "takes the torch plane, NCCL, for CUDA tensors); needs a GPU per rank")
    parser.add_argument("--slowdown", action="append", default=[], help="(ddp workers) as hopnet's --slowdown")
    parser.add_argument("--straggler-ms", type=float, default=0.0,
                        help="each iteration exactly one rank, straggler(seed, iteration), computes this much longer")
    parser.add_argument("--out", default="runs/bench-ddp", help="where the runs go")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    if args.compute_ms is None:
        args.compute_ms = 40.0 if args.workload == "mlp" else 0.0
    if args.role != "driver":
        train(args.role, args)
        return

    slowdown = SCENARIOS[args.scenario]
    out = Path(args.out).resolve() / args.scenario
    rows = []
    runs = args.runs or ("ddp,allreduce,hop,hop-skip" if args.scenario == "none" else "ddp,hop,hop-skip")
    for name in runs.split(","):
        run_dir = out / name
        if name == "ddp":
            wall = run_ddp(slowdown, run_dir, args)
        elif name == "allreduce":
            wall = run_hopnet(name, ["--protocol", "allreduce"], slowdown, run_dir, args)
        elif name == "allreduce-b0":  # one all-reduce after the backward pass, no buckets
            wall = run_hopnet(name, ["--protocol", "allreduce", "--bucket-mb", "0"], slowdown, run_dir, args)
        elif name == "allreduce-torch":  # the all-reduce over TorchCollective (gloo), not the ring
            wall = run_hopnet(name, ["--protocol", "allreduce", "--bulk", "torch"], slowdown, run_dir, args)
        elif name == "pipe-sgd":  # K=1: each iteration applies its own gradient, like allreduce
            wall = run_hopnet(name, ["--protocol", "pipe-sgd", "--pipeline-k", "1"], slowdown, run_dir, args)
        elif name == "hop":
            wall = run_hopnet(name, [], slowdown, run_dir, args)
        elif name == "hop-skip":
            wall = run_hopnet(name, HOP_SKIP_FLAGS, slowdown, run_dir, args)
        else:
            raise SystemExit(f"bench/ddp.py: error: unknown run {name!r}")
        rows.append(summarize(name, run_dir, args.nproc, wall, args))
        r = rows[-1]
        print(f"{args.scenario} {name}: {r['ms_per_iter']:.1f} ms/it, to {args.target}: {r['to_target_max']:.2f} s, "
              f"final acc min {r['final_acc_min']:.3f}, process wall {wall:.1f} s, split {r['split_ms']}",
              flush=True)
    if any(r["name"] == "ddp" for r in rows):
        print_table(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

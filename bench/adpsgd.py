"""AD-PSGD against allreduce with one worker 5x slower (and without), side by side in one run.

    python bench/adpsgd.py [--sim-workers 16] [--procs 4] [--iterations 300] [--skip-real]

Simulator: ring of --sim-workers (bipartite), 10 MB model over 10 Gbit/s links, 20 ms
compute, homogeneous and with rank 1 (a passive) or rank 0 (an active) 5x slower. Real
processes: `hopnet launch` of examples/train_digits.py on ring:--procs, homogeneous and with
rank 1 5x slower (`--slowdown rank=1:5`). Throughput is the sum over workers of
iterations per second (each worker's iterations over the time from its first iteration's
start to the end of its second-to-last step, from the event logs: a passive's last step
waits for its actives to finish, which is not training time); the ratio is AD-PSGD's over allreduce's
in the same configuration. See bench/README.md ("AD-PSGD") for results.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from hopnet.config import ProtocolConfig  # noqa: E402
from hopnet.graph import Graph  # noqa: E402
from hopnet.sim.engine import ComputeModel, SimSpec, simulate  # noqa: E402
from hopnet.transports.inproc import LinkModel  # noqa: E402

PROTOCOLS = ("allreduce", "ad-psgd")
ACCURACY = re.compile(r"^\[rank (\d+)\] final held-out accuracy ([0-9.]+)", re.MULTILINE)


def simulated(workers: int, slowdown: list[str]) -> dict[str, float]:
    out = {}
    for protocol in PROTOCOLS:
        spec = SimSpec(graph=Graph.ring(workers), config=ProtocolConfig(protocol=protocol, slowdown=slowdown),
                       iterations=60, compute=ComputeModel.parse("20"),
                       link=LinkModel(latency_s=0.0001, bytes_per_s=10e9 / 8), model_bytes=10_000_000)
        out[protocol] = training_rate(simulate(spec).finish_times)
    return out


def training_rate(finish_times: list[list[float]]) -> float:
    """Sum over workers of iterations per second up to each one's second-to-last step: a
    passive's last step waits for its actives to finish, which is not training time."""
    return sum((len(times) - 1) / times[-2] for times in finish_times)


def throughput(run_dir: Path, n: int) -> float:
    total = 0.0
    for rank in range(n):
        records = [json.loads(line) for line in (run_dir / f"rank{rank}.jsonl").read_text().splitlines() if line]
        steps = [r for r in records if r["event"] == "iteration"][:-1]  # as training_rate()
        first = steps[0]["mono"] - steps[0]["compute_s"] - steps[0]["wait_updates_s"] - steps[0]["mix_s"]
        total += len(steps) / (steps[-1]["mono"] - first)
    return total


def real(procs: int, iterations: int, slowdown: list[str]) -> dict[str, tuple[float, float]]:
    out = {}
    for protocol in PROTOCOLS:
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            flags = [f"--slowdown={s}" for s in slowdown]
            result = subprocess.run([sys.executable, "-m", "hopnet.cli.main", "launch", "--protocol", protocol,
                                     "--graph", f"ring:{procs}", "--run-dir", str(run_dir), *flags,
                                     str(ROOT / "examples" / "train_digits.py"), "--iterations", str(iterations)],
                                    capture_output=True, text=True, timeout=600, cwd=ROOT)
            if result.returncode != 0:
                raise SystemExit(f"{protocol}: launch failed:\n{result.stderr}")
            accuracy = min(float(a) for _, a in ACCURACY.findall(result.stdout))
            out[protocol] = (throughput(run_dir, procs), accuracy)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sim-workers", type=int, default=16)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--skip-real", action="store_true")
    args = parser.parse_args()
    print(f"simulator, ring:{args.sim_workers}, 10 MB model, 10 Gbit/s, 20 ms compute (sum of it/s)")
    print(f"{'setting':<22}{'allreduce':>12}{'ad-psgd':>12}{'ratio':>8}")
    for label, slowdown in (("homogeneous", []), ("rank 1 (passive) 5x", ["rank=1:5"]),
                            ("rank 0 (active) 5x", ["rank=0:5"])):
        rates = simulated(args.sim_workers, slowdown)
        print(f"{label:<22}{rates['allreduce']:>12.1f}{rates['ad-psgd']:>12.1f}"
              f"{rates['ad-psgd'] / rates['allreduce']:>8.2f}")
    if args.skip_real:
        return
    print(f"\nreal processes, ring:{args.procs}, digits, {args.iterations} iterations (sum of it/s; lowest accuracy)")
    print(f"{'setting':<22}{'allreduce':>18}{'ad-psgd':>18}{'ratio':>8}")
    for label, slowdown in (("homogeneous", []), ("rank 1 (passive) 5x", ["rank=1:5"])):
        results = real(args.procs, args.iterations, slowdown)
        (ar, ar_acc), (ad, ad_acc) = results["allreduce"], results["ad-psgd"]
        print(f"{label:<22}{ar:>10.1f} ({ar_acc:.3f}){ad:>10.1f} ({ad_acc:.3f}){ad / ar:>8.2f}")


if __name__ == "__main__":
    main()

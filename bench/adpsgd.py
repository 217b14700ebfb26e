"""AD-PSGD against allreduce with one worker 5x slower (and without), side by side in one run.

    python bench/adpsgd.py [--sim-workers 16] [--procs 4] [--iterations 300] [--skip-real]

Simulator: ring of --sim-workers (bipartite), 10 MB model over 10 Gbit/s links, 20 ms
compute, homogeneous and with rank 1 (a passive) or rank 0 (an active) 5x slower. Real
processes: `hopnet launch` of examples/train_digits.py on ring:--procs, homogeneous and with
rank 1 5x slower (`--slowdown rank=1:5`). Throughput is the sum over workers of
iterations per second (each worker's iterations over the time from its first iteration's
start to the end of its second-to-last step, from the event logs: a passive's last step
waits for its actives to finish, which is not training time); the ratio is AD-PSGD's over allreduce's
in the same configuration. See docs/performance/index.md ("AD-PSGD") for results.
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


def throughput(run_dir: Path, n: int) -> tuple[float, float]:
    """Sum of the workers' training rates (as :func:`training_rate`), and the run's length in
    seconds: from the first iteration's start to the last step's end on any worker."""
    total, began, ended = 0.0, float("inf"), 0.0
    for rank in range(n):
        records = [json.loads(line) for line in (run_dir / f"rank{rank}.jsonl").read_text().splitlines() if line]
        steps = [r for r in records if r["event"] == "iteration"]
        first = steps[0]["mono"] - steps[0]["compute_s"] - steps[0]["wait_updates_s"] - steps[0]["mix_s"]
        total += (len(steps) - 1) / (steps[-2]["mono"] - first)
        began, ended = min(began, first), max(ended, steps[-1]["mono"])
    return total, ended - began


def real(procs: int, iterations: int, slowdown: list[str]) -> dict[str, tuple[float, float, float]]:
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
            out[protocol] = (*throughput(run_dir, procs), accuracy)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sim-workers", type=int, default=16)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--skip-real", action="store_true")
    parser.add_argument("--skip-sim", action="store_true")
    args = parser.parse_args()
    if not args.skip_sim:
        simulator_table(args.sim_workers)
    if args.skip_real:
        return
    real_table(args.procs, args.iterations)


def simulator_table(workers: int) -> None:
    print(f"simulator, ring:{workers}, 10 MB model, 10 Gbit/s, 20 ms compute (sum of it/s)")
    print(f"{'setting':<22}{'allreduce':>12}{'ad-psgd':>12}{'ratio':>8}")
    for label, slowdown in (("homogeneous", []), ("rank 1 (passive) 5x", ["rank=1:5"]),
                            ("rank 0 (active) 5x", ["rank=0:5"])):
        rates = simulated(workers, slowdown)
        print(f"{label:<22}{rates['allreduce']:>12.1f}{rates['ad-psgd']:>12.1f}"
              f"{rates['ad-psgd'] / rates['allreduce']:>8.2f}")


def real_table(procs: int, iterations: int) -> None:
    print(f"\nreal processes, ring:{procs}, digits, {iterations} iterations "
          "(sum of it/s, run seconds, lowest accuracy)")
    print(f"{'setting':<22}{'allreduce':>24}{'ad-psgd':>24}{'ratio':>8}")
    for label, slowdown in (("homogeneous", []), ("rank 1 (passive) 5x", ["rank=1:5"]),
                            ("rank 0 (active) 5x", ["rank=0:5"])):
        results = real(procs, iterations, slowdown)
        cells = "".join(f"{rate:>9.1f} {seconds:>6.2f}s ({acc:.3f})" for rate, seconds, acc in results.values())
        ratio = results["ad-psgd"][0] / results["allreduce"][0]
        print(f"{label:<22}{cells}{ratio:>8.2f}")


if __name__ == "__main__":
    main()

"""The simulator's lossy and jittery links against real ones: measured slowdown beside predicted.

    sudo python bench/netsim_check.py [--iterations 1500] [--protocols hop,allreduce] [--repeat 3] [--keep DIR]
    python bench/netsim_check.py --from DIR      # predict again from the runs a --keep kept

Two emulated hosts joined by the user-space forwarder (bench/netem/forwarder.py), ranks 0-1 on
host a and 2-3 on host b (``hopnet launch --nnodes 2 --nproc 4``), train the digits MLP
(examples/train_digits.py) under each protocol: clean, then with both directions losing 1% and 5%
of frames (``--repeat`` runs each), then delayed 50 ms with 20 ms of jitter, then clean again. The
measured slowdown of a fault is its runs' mean training time (first iteration record of any rank
to the last one of any rank, all four logs) over the mean of the two clean runs'.

The prediction: the simulator on the same graph, ranks 0-1 on machine ``a`` and 2-3 on ``b``,
each rank computing its mean step of the clean Hop run (the trainer's compute; Hop's logs time it
apart from the waits) plus the protocol's own mixing, the links inside a host and across taking
the clean Hop run's median per-update transfer times, scaled by one factor that makes the
simulated clean run last as long as the measured one (:func:`fit_latency`); TCP's round trip on the
cross link is the kernel's (the clean Hop run's ``links`` records). The cross link then
gets the fault (its loss, or its delay and jitter, on top) and the predicted slowdown is the
simulated faulty time (the mean over ``--repeat`` seeds for a loss) over the simulated clean time.
Prints one line per protocol and fault: measured, predicted, and the prediction's error.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))
from netem.forwarder import Faults, ForwardedLink, unavailable_reason  # noqa: E402

DIGITS = str(REPO / "examples" / "train_digits.py")
MODEL_BYTES = 4 * (64 * 64 + 64 + 64 * 10 + 10)
"""The digits MLP's parameters (64 hidden units, float32): the bytes of one update."""
ACCURACY = re.compile(r"final held-out accuracy ([0-9.]+)")
TOLERANCE = 0.25


@dataclass(frozen=True)
class Fault:
    name: str
    loss: float = 0.0
    delay_ms: float = 0.0
    jitter_ms: float = 0.0

    def forwarder(self) -> Faults:
        return Faults(loss=self.loss, delay_ms=self.delay_ms, jitter_ms=self.jitter_ms)


CLEAN = Fault("clean")
CLEAN_AGAIN = Fault("clean, again")
"""The clean run once more after the faulty ones: their mean is the slowdowns' base (the load may change)."""
FAULTS = (Fault("loss 1%", loss=0.01), Fault("loss 5%", loss=0.05),
          Fault("delay 50 ms, jitter 20 ms", delay_ms=50, jitter_ms=20))


def _slug(protocol: str, fault: Fault, trial: int = 0) -> str:
    return f"{protocol}-" + re.sub(r"[^a-z0-9]+", "-", fault.name.lower()).strip("-") + (f"-{trial}" if trial else "")


# ---------------------------------------------------------------------------- measuring
def launch_two_hosts(link: ForwardedLink, key: Path, port: int, run_dirs: list[Path], protocol: str,
                     iterations: int) -> list[str]:
    script = [DIGITS, "--iterations", str(iterations), "--eval-every", "100000"]
    procs = []
    for node, host in enumerate(("a", "b")):
        argv = [sys.executable, "-m", "hopnet.cli.main", "launch", "--nnodes", "2", "--node-rank", str(node),
                "--rdzv-endpoint", f"{link.addresses['a']}:{port}", "--bind", link.addresses[host],
                "--nproc", "4", "--key-file", str(key), "--protocol", protocol, "--no-progress",
                "--run-dir", str(run_dirs[node]), *script]
        procs.append(subprocess.Popen(link.command(host, argv), cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin:/usr/sbin:/sbin",
                                           "PYTHONUNBUFFERED": "1"}))
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=1800)[0])
        except subprocess.TimeoutExpired:
            proc.kill()
            outs.append(proc.communicate()[0])
    codes = [p.returncode for p in procs]
    if any(codes):
        raise RuntimeError(f"{protocol}: launchers exited {codes}:\n" + "\n".join(o[-2000:] for o in outs))
    return outs


def training_seconds(run_dirs: list[Path]) -> float:
    """First iteration record of any rank to the last one of any rank (one kernel: one monotonic clock)."""
    from hopnet.runtime.events import read_events

    first, last = [], []
    for run_dir in run_dirs:
        for log in run_dir.glob("rank*.jsonl"):
            monos = [r["mono"] for r in read_events(log) if r.get("event") == "iteration"]
            if monos:
                first.append(min(monos))
                last.append(max(monos))
    return max(last) - min(first)


def measure(args: argparse.Namespace, keep: Path) -> dict[str, dict[str, float]]:
    from hopnet.security import CurveKeys, write_key_file

    measured: dict[str, dict[str, float]] = {}
    key = write_key_file(keep / "run.key", CurveKeys.generate())
    port = 29930
    with ForwardedLink(seed=args.seed) as link:
        for protocol in args.protocols:
            measured[protocol] = {}
            for fault in (CLEAN, *FAULTS, CLEAN_AGAIN):
                link.set_faults(a_to_b=fault.forwarder(), b_to_a=fault.forwarder())
                trials = []
                for trial in range(args.repeat if fault.loss else 1):
                    run_dirs = [keep / _slug(protocol, fault, trial) / f"node{n}" for n in (0, 1)]
                    for d in run_dirs:
                        shutil.rmtree(d, ignore_errors=True)
                    started = time.monotonic()
                    outs = launch_two_hosts(link, key, port, run_dirs, protocol, args.iterations)
                    port += 1
                    trials.append(training_seconds(run_dirs))
                    accuracy = [float(a) for out in outs for a in ACCURACY.findall(out)]
                    print(f"  ran {protocol:<10} {fault.name:<26} training {trials[-1]:7.2f} s (launch "
                          f"{time.monotonic() - started:.0f} s, accuracy {min(accuracy, default=float('nan')):.3f})",
                          flush=True)
                measured[protocol][fault.name] = statistics.fmean(trials)
                (keep / "measured.json").write_text(json.dumps(measured, indent=1))
    return measured


# ---------------------------------------------------------------------------- predicting
def _run_data(run_dirs: list[Path]):  # type: ignore[no-untyped-def]
    """Both launchers' logs as one run (node 0's directory has graph.json and launch.json)."""
    from hopnet.report.rundir import load_run_dir

    run = load_run_dir(run_dirs[0])
    other = load_run_dir(run_dirs[1])
    run.events.update(other.events)
    return run


def mean_of(records: list[dict[str, object]], key: str) -> float:
    """A rank's mean ``key`` per step, the first step (start-up) left out."""
    steps = [r for r in records if r.get("event") == "iteration"][1:]
    return statistics.fmean(float(r.get(key) or 0.0) for r in steps)  # type: ignore[arg-type]


def predict(keep: Path, protocol: str, iterations: int, clean_seconds: float, repeat: int) -> dict[str, float]:
    """Per fault, the simulator's slowdown for this protocol's clean run with the fault on the cross link."""
    from hopnet.graph import Graph
    from hopnet.report.diagnosis import link_times
    from hopnet.sim.engine import ComputeModel, SimSpec, simulate
    from hopnet.transports.inproc import LinkFaults, LinkModel

    run = _run_data([keep / _slug(protocol, CLEAN) / f"node{n}" for n in (0, 1)])
    # Hop's logs time the trainer's compute apart from the waits, and each link's transfers; an
    # all-reduce's compute_s holds its collective too. So every protocol takes both from Hop's clean run.
    hop = _run_data([keep / _slug("hop", CLEAN) / f"node{n}" for n in (0, 1)])
    assert run.graph is not None and run.config is not None
    machines = ["a", "a", "b", "b"]
    graph = Graph(run.graph.n, [(i, j) for i in range(run.graph.n) for j in run.graph.out_peers(i)],
                  name=run.graph.name, machines=machines)
    compute = ComputeModel("const", 0.0)
    for rank in range(graph.n):
        busy = mean_of(hop.events[rank], "compute_s") + mean_of(run.events[rank], "mix_s")
        compute = compute.with_rank(rank, ComputeModel("const", busy))
    measured_links = link_times(hop)
    within = [t for (s, d), t in measured_links.items() if machines[s] == machines[d]]
    across = [t for (s, d), t in measured_links.items() if machines[s] != machines[d]]
    inside_s = statistics.median(within) if within else 0.0
    across_s = statistics.median(across) if across else inside_s
    rtts = [c["rtt_ms"] / 1000 for src, records in hop.events.items() for rec in records if rec.get("event") == "links"
            for dst, c in rec["peers"].items() if machines[src] != machines[int(dst)]]
    rtt_s = statistics.median(rtts) if rtts else None  # the kernel's, on the clean cross link

    def simulated(fault: Fault, scale: float = 1.0, seed: int = 0) -> float:
        cross = LinkFaults(loss=fault.loss, jitter_s=fault.jitter_ms / 1000,
                           rtt_s=None if rtt_s is None else rtt_s + 2 * fault.delay_ms / 1000)
        pairs = {(m1, m2): ((scale * inside_s, 0.0) if m1 == m2 else (scale * across_s + fault.delay_ms / 1000, 0.0))
                 for m1 in "ab" for m2 in "ab"}
        link = LinkModel(latency_s=scale * inside_s, machines=tuple(machines), between_machines=pairs,
                         machine_faults={("a", "b"): cross, ("b", "a"): cross})
        config = run.config.replace(timeout_s=1e5, seed=seed)
        spec = SimSpec(graph=graph, config=config, iterations=iterations, compute=compute, link=link,
                       model_bytes=MODEL_BYTES, gap_matrix=False)
        return simulate(spec).virtual_time

    scale = fit_latency(lambda f: simulated(CLEAN, f), clean_seconds)
    clean = simulated(CLEAN, scale)
    return {fault.name: statistics.fmean(simulated(fault, scale, seed) for seed in range(repeat if fault.loss else 1))
            / clean for fault in FAULTS}


def fit_latency(simulated: Callable[[float], float], measured_s: float) -> float:
    """The factor on the measured link times that makes the simulated clean run last as long as the
    real one did (a real step's transfer overlaps its compute less than a simulated one's)."""
    low, high = 0.0, 1.0
    while simulated(high) < measured_s and high < 64:
        low, high = high, 2 * high
    for _ in range(12):
        middle = (low + high) / 2
        low, high = (middle, high) if simulated(middle) < measured_s else (low, middle)
    return (low + high) / 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=1500)
    parser.add_argument("--protocols", type=lambda s: s.split(","), default=["hop", "allreduce"])
    parser.add_argument("--seed", type=int, default=1, help="the forwarder's seed (which frames it drops)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of each loss fault, and simulator seeds, averaged (a few ~200 ms stalls "
                             "more or less move one run's time by a second; default: 3)")
    parser.add_argument("--keep", default=None, metavar="DIR", help="keep the run directories here")
    parser.add_argument("--from", dest="source", default=None, metavar="DIR",
                        help="no runs: predict from the runs kept in DIR by --keep")
    args = parser.parse_args()
    if args.source is not None:
        keep = Path(args.source)
        measured = json.loads((keep / "measured.json").read_text())
    else:
        why = unavailable_reason()
        if why is not None:
            print(f"bench/netsim_check.py: cannot emulate hosts: {why}", file=sys.stderr)
            return 2
        keep = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="netsim-check-"))
        keep.mkdir(parents=True, exist_ok=True)
        measured = measure(args, keep)
    worst = 0.0
    print(f"{'protocol':<10} {'fault':<26} {'clean s':>8} {'fault s':>8} {'measured':>9} {'predicted':>9} {'error':>7}")
    for protocol, times in measured.items():
        clean = statistics.fmean(times[name] for name in (CLEAN.name, CLEAN_AGAIN.name) if name in times)
        predicted = predict(keep, protocol, args.iterations, clean, args.repeat)
        for fault in FAULTS:
            slowdown = times[fault.name] / clean
            error = predicted[fault.name] / slowdown - 1
            worst = max(worst, abs(error))
            print(f"{protocol:<10} {fault.name:<26} {clean:8.2f} {times[fault.name]:8.2f} "
                  f"{slowdown:8.2f}x {predicted[fault.name]:8.2f}x {100 * error:+6.0f}%")
    print(f"largest error {100 * worst:.0f}% (bound {100 * TOLERANCE:.0f}%); runs in {keep}")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())

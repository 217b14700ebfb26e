"""Network faults against real runs: two emulated hosts joined by a misbehaving link.

Host A runs ranks 0, 1 and host B ranks 2, 3 of one `hopnet launch --nnodes 2` run (digits,
``ring:4``, so two of the ring's four links cross), each host in its own network namespace; the
link between them goes through the user-space forwarder (bench/netem/forwarder.py), which loses,
delays, jitters, reorders or cuts frames, and ``tc tbf`` on the hosts' ends caps the bandwidth.
Each trial picks a protocol, a plane (``--bulk zmq`` or ``--bulk torch``) and a fault, and
injects the fault at a random time once training runs:

    loss1, loss5   1% or 5% of the frames lost, both ways
    jitter         50 ms of delay with 20 ms of jitter, both ways
    reorder        10% of the frames held back 10 ms (overtaken), with 5 ms of delay
    cap            10 mbit each way (tc tbf)
    transient      the link cut both ways for TRANSIENT_S (shorter than --peer-timeout), then healed
    oneway         A -> B cut for good
    permanent      both ways cut for good

What each must give (a trial that does not is printed with its problems):

- loss, jitter, reorder, cap, transient: both launchers exit 0, no peer declared dead, the
  consensus accuracy of a clean run (within ACCURACY_SLACK of it); the slowdown against the
  clean run of the same protocol and plane (measured once per pair, in the same invocation);
- oneway, permanent: the run stops (or, with ``--max-failures`` covering B's ranks, node 0's side
  goes on and finishes alone), a line names ``rank R unreachable from rank S`` within
  --peer-timeout + 2 s of the cut, no launcher line blames a crash, and both launchers exit;
- every trial: no hang (each launcher exits by its deadline), no orphan (no process left in
  either host's namespace), no worker with an update counted lost or mixed twice.

    python bench/netchaos.py [--trials 32] [--seed 0] [--protocols hop,allreduce] [--faults loss5,permanent]
    python bench/netchaos.py --compare jitter   # allreduce against the protocols built for slow links

Needs root and iproute2 (network namespaces); prints a table, then the totals.
"""

from __future__ import annotations

import argparse
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from faults import ROOT, LaunchRun, max_iteration  # noqa: E402
from hopnet.runtime.events import read_events  # noqa: E402
from netem.forwarder import Faults, ForwardedLink, unavailable_reason  # noqa: E402

PROTOCOLS = ("hop", "notify-ack", "ad-psgd", "allreduce", "eager-sgd", "pipe-sgd", "partial-reduce", "prague", "diloco")
SURVIVABLE = ("loss1", "loss5", "jitter", "reorder", "cap", "transient")
PARTITIONS = ("oneway", "permanent")
FAULTS = SURVIVABLE + PARTITIONS
PLANES = ("zmq", "torch")
PEER_TIMEOUT_S = 4.0
TRANSIENT_S = 1.5
"""Shorter than half --peer-timeout: TCP's retransmission backoff may keep a healed link silent up
to about twice the cut (a segment lost at the cut is retried 0.2, 0.6, 1.4, 3.0 s after it)."""
NAMED_WITHIN_S = PEER_TIMEOUT_S + 2.0
FAULT_ITERATIONS = {"jitter": 200}
"""Fewer iterations where each costs a round trip of 100 ms or more (slowdowns are per iteration;
against a clean run of as many)."""
STALL_S = 60.0
"""A run whose launchers are still up but whose ranks logged no new iteration for this long hangs
(the workers' own --timeout is 30 s, and a launcher stops within seconds of a failure)."""
RUN_LIMIT_S = 900.0
ACCURACY_SLACK = 0.03
ITERATIONS = 800
PROTOCOL_FLAGS = {"diloco": ["--local-steps", "10"], "pipe-sgd": ["--pipeline-k", "2"]}
SLOW_LINK_CONFIGS = {
    "allreduce": ("allreduce", []),
    "hop --backup-workers 1 --staleness 4": ("hop", ["--backup-workers", "1", "--staleness", "4"]),
    "ad-psgd": ("ad-psgd", []),
    "diloco --local-steps 10": ("diloco", ["--local-steps", "10"]),
}
"""``--compare FAULT``: the protocols built for slow links against allreduce."""
TOLERANT_FLAGS = ["--graph", "complete:4", "--backup-workers", "2", "--max-failures", "2"]
CONSENSUS = re.compile(r"consensus model held-out accuracy ([0-9.]+)")
FINAL = re.compile(r"final held-out accuracy ([0-9.]+)")
UNREACHABLE = re.compile(r"ranks? [0-9, ]+ unreachable from ranks? \d+")
CRASH_WORDS = ("died (", "killed by", "was lost (")


@dataclass
class Outcome:
    """One run of the pair of launchers, as seen from outside."""

    codes: tuple[int | None, int | None]
    hung: bool
    orphans: int
    accuracy: float | None
    training_s: float | None
    named_s: float | None
    lines: list[str]
    peer_dead: int
    lost_or_twice: int
    iterations: int = ITERATIONS

    @property
    def per_iteration_s(self) -> float | None:
        return self.training_s / self.iterations if self.training_s else None


@dataclass
class Trial:
    protocol: str
    plane: str
    fault: str
    tolerant: bool
    at_s: float
    outcome: Outcome | None = None
    clean_s: float | None = None
    clean_accuracy: float | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def slowdown(self) -> float | None:
        """Time per iteration against the clean run's (a jittery link's runs are shorter)."""
        mine = self.outcome.per_iteration_s if self.outcome is not None else None
        return mine / self.clean_s if mine and self.clean_s else None


def apply_fault(link: ForwardedLink, fault: str) -> None:
    both = {"loss1": Faults(loss=0.01), "loss5": Faults(loss=0.05),
            "jitter": Faults(delay_ms=50, jitter_ms=20),
            "reorder": Faults(delay_ms=5, reorder=0.1, reorder_ms=10),
            "permanent": Faults(cut=True), "transient": Faults(cut=True)}
    if fault == "cap":
        link.cap("10mbit")
    elif fault == "oneway":
        link.set_faults(a_to_b=Faults(cut=True))
    else:
        link.set_faults(both[fault], both[fault])
    if fault == "transient":
        time.sleep(TRANSIENT_S)
        link.set_faults()


def heal(link: ForwardedLink) -> None:
    link.set_faults()
    link.cap(None)


def _records(run_dir: Path, event: str) -> list[dict]:
    return [r for log in sorted(run_dir.glob("rank*.jsonl")) for r in read_events(log) if r.get("event") == event]


def training_seconds(run_dir: Path) -> float | None:
    """From the first iteration record to the last one, over the ranks of one host."""
    monos = [float(r["mono"]) for r in _records(run_dir, "iteration") if isinstance(r.get("mono"), (int, float))]
    return max(monos) - min(monos) if monos else None


def namespace_pids(link: ForwardedLink) -> int:
    count = 0
    for host in ("a", "b"):
        listed = subprocess.run(["ip", "netns", "pids", link.namespaces[host]], capture_output=True, text=True)
        count += len(listed.stdout.split())
    return count


def wait_while_progressing(runs: list[LaunchRun], base: Path) -> tuple[int | None, ...]:
    """Both launchers' exit codes; ``None`` for one still running once no rank has logged a new
    iteration for :data:`STALL_S` (or after :data:`RUN_LIMIT_S`): a hang, not a slow link."""
    started = last_change = time.monotonic()
    seen = -1
    while any(r.proc.poll() is None for r in runs):
        now = time.monotonic()
        reached = max(max_iteration(base / "node0"), max_iteration(base / "node1"))
        if reached != seen:
            seen, last_change = reached, now
        if now - last_change > STALL_S or now - started > RUN_LIMIT_S:
            break
        time.sleep(0.5)
    return tuple(r.wait(0.0) for r in runs)


def run_pair(link: ForwardedLink, key: Path, base: Path, protocol: str, plane: str, fault: str | None,
             tolerant: bool, at_s: float, port: int, extra: Sequence[str] | None = None,
             iterations: int = ITERATIONS) -> Outcome:
    """Both hosts' launchers; ``fault`` (None: a clean run) injected ``at_s`` after training starts.
    ``extra``: the protocol's flags (default: :data:`PROTOCOL_FLAGS`)."""
    flags = ["--nnodes", "2", "--rdzv-endpoint", f"{link.addresses['a']}:{port}", "--nproc", "4",
             "--key-file", str(key), "--protocol", protocol, "--bulk", plane, "--peer-timeout", str(PEER_TIMEOUT_S),
             "--timeout", "30", "--grace", "3", *(PROTOCOL_FLAGS.get(protocol, []) if extra is None else extra),
             *(TOLERANT_FLAGS if tolerant else [])]
    script = [str(ROOT / "examples" / "train_digits.py"), "--iterations", str(iterations), "--eval-every", "100000"]
    runs = [LaunchRun.start([*flags, "--node-rank", str(n), "--bind", link.addresses[host], *script],
                            base / f"node{n}", prefix=link.command(host, []))
            for n, host in enumerate(("a", "b"))]
    cut_at = None
    deadline = time.monotonic() + 90
    try:
        if fault is not None:
            while max_iteration(base / "node1") < 10 and time.monotonic() < deadline \
                    and all(r.proc.poll() is None for r in runs):
                time.sleep(0.05)
            time.sleep(at_s)
            cut_at = time.monotonic()
            apply_fault(link, fault)
        codes = wait_while_progressing(runs, base)
    finally:
        heal(link)
    hung = any(code is None for code in codes)
    for r in runs:
        if r.proc.poll() is None:
            r.end({})
    time.sleep(0.3)
    orphans = namespace_pids(link)
    out = [ln for r in runs for ln in r.lines()]
    texts = [ln.text for ln in out]
    named = [ln.t for ln in out if UNREACHABLE.search(ln.text)]
    consensus = [float(a) for t in texts for a in CONSENSUS.findall(t)]
    finals = [float(a) for t in texts for a in FINAL.findall(t)]
    stops = _records(base / "node0", "stop") + _records(base / "node1", "stop")
    lost_or_twice = sum(int(s.get("dropped", {}).get(k, 0)) for s in stops for k in ("duplicate", "gap"))
    return Outcome(codes=codes, hung=hung, orphans=orphans,
                   accuracy=consensus[0] if consensus else (min(finals) if finals else None),
                   training_s=training_seconds(base / "node0"),
                   named_s=(min(named) - cut_at) if named and cut_at is not None else None,
                   lines=[t for t in texts if t.startswith("hopnet launch: ")],
                   peer_dead=len(_records(base / "node0", "peer_dead") + _records(base / "node1", "peer_dead")),
                   lost_or_twice=lost_or_twice, iterations=iterations)


def judge(trial: Trial) -> None:
    o = trial.outcome
    assert o is not None
    p = trial.problems
    if o.hung:
        p.append("hang")
    if o.orphans:
        p.append(f"{o.orphans} orphan process(es)")
    if o.lost_or_twice:
        p.append(f"{o.lost_or_twice} update(s) lost or mixed twice")
    if trial.fault in SURVIVABLE:
        if o.codes != (0, 0):
            p.append(f"exit codes {o.codes}")
        if o.peer_dead:
            p.append(f"{o.peer_dead} peer(s) declared dead")
        if o.accuracy is None or (trial.clean_accuracy is not None and o.accuracy < trial.clean_accuracy - ACCURACY_SLACK):
            p.append(f"accuracy {o.accuracy} (clean {trial.clean_accuracy})")
        return
    expected = (0, 1) if trial.tolerant else (1, 1)
    if o.codes != expected:
        p.append(f"exit codes {o.codes}, expected {expected}")
    if o.named_s is None:
        p.append("no 'unreachable from' line")
    elif o.named_s > NAMED_WITHIN_S:
        p.append(f"named after {o.named_s:.1f}s")
    blamed_crash = [line for line in o.lines if any(w in line for w in CRASH_WORDS)]
    if blamed_crash:
        p.append(f"wrong blame: {blamed_crash[0][:100]}")


def plan_trials(n: int, rng: random.Random, protocols: list[str], faults: list[str]) -> list[Trial]:
    """Every protocol, plane and fault in turn (shuffled), each at a random time."""
    combos = [(p, pl, f) for f in faults for p in protocols for pl in PLANES]
    rng.shuffle(combos)
    trials = []
    for i in range(n):
        protocol, plane, fault = combos[i % len(combos)]
        tolerant = fault in PARTITIONS and protocol == "hop" and rng.random() < 0.5
        trials.append(Trial(protocol, plane, fault, tolerant, at_s=round(rng.uniform(0.0, 1.0), 2)))
    return trials


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--protocols", default=",".join(PROTOCOLS))
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    parser.add_argument("--iterations", type=int, default=ITERATIONS, help="digits iterations per run")
    parser.add_argument("--compare", metavar="FAULT", choices=SURVIVABLE,
                        help="instead of trials: each of SLOW_LINK_CONFIGS clean and under FAULT, the slowdowns")
    args = parser.parse_args()
    why = unavailable_reason()
    if why is not None:
        raise SystemExit(f"cannot emulate hosts here: {why}")
    from hopnet.security import CurveKeys, write_key_file

    rng = random.Random(args.seed)
    trials = plan_trials(args.trials, rng, args.protocols.split(","), args.faults.split(","))
    base = Path(tempfile.mkdtemp(prefix="netchaos"))
    key = write_key_file(base / "run.key", CurveKeys.generate())
    clean: dict[tuple[str, str, int], Outcome] = {}
    port = 29700 + rng.randrange(100)
    if args.compare:
        with ForwardedLink(seed=args.seed) as link:
            compare(link, key, base, args.compare, port, args.iterations)
        subprocess.run(["rm", "-rf", str(base)], check=False)
        return
    with ForwardedLink(seed=args.seed) as link:
        for i, trial in enumerate(trials):
            iterations = FAULT_ITERATIONS.get(trial.fault, args.iterations)
            pair = (trial.protocol, trial.plane, iterations)
            if trial.fault in SURVIVABLE and pair not in clean:
                port += 1
                clean[pair] = run_pair(link, key, base / f"clean-{trial.protocol}-{trial.plane}-{iterations}",
                                       trial.protocol, trial.plane, None, False, 0.0, port, iterations=iterations)
            if pair in clean:
                trial.clean_s, trial.clean_accuracy = clean[pair].per_iteration_s, clean[pair].accuracy
            port += 1
            trial.outcome = run_pair(link, key, base / f"t{i}", trial.protocol, trial.plane, trial.fault,
                                     trial.tolerant, trial.at_s, port, iterations=iterations)
            judge(trial)
            print(row(i, trial), flush=True)
    print(summary(trials))
    if args.keep:
        print(f"run directories: {base}")
    else:
        subprocess.run(["rm", "-rf", str(base)], check=False)


def compare(link: ForwardedLink, key: Path, base: Path, fault: str, port: int, iterations: int) -> None:
    """Each of :data:`SLOW_LINK_CONFIGS` on the ZeroMQ plane, clean and with ``fault`` from the start
    of training: the training time of both and the slowdown."""
    for i, (name, (protocol, flags)) in enumerate(SLOW_LINK_CONFIGS.items()):
        clean = run_pair(link, key, base / f"c{i}", protocol, "zmq", None, False, 0.0, port + 2 * i, flags,
                         iterations)
        faulty = run_pair(link, key, base / f"f{i}", protocol, "zmq", fault, False, 0.0, port + 2 * i + 1, flags,
                          iterations)
        ratio = (faulty.training_s / clean.training_s) if faulty.training_s and clean.training_s else None
        print(f"{name:40s} clean {clean.training_s or 0:6.2f}s (acc {clean.accuracy})  {fault} "
              f"{faulty.training_s or 0:6.2f}s (acc {faulty.accuracy}, exits {faulty.codes})  "
              f"slowdown {f'{ratio:.2f}x' if ratio else '-'}", flush=True)


def row(i: int, t: Trial) -> str:
    o = t.outcome
    assert o is not None
    slow = f"{t.slowdown:.2f}x" if t.slowdown is not None and t.fault in SURVIVABLE else "-"
    named = f"{o.named_s:.1f}s" if o.named_s is not None else "-"
    acc = f"{o.accuracy:.3f}" if o.accuracy is not None else "-"
    return (f"{i:3d} {t.protocol:14s} {t.plane:5s} {t.fault + (' (tolerant)' if t.tolerant else ''):20s} "
            f"at +{t.at_s:.2f}s  exits {str(o.codes):10s} acc {acc:6s} slowdown {slow:7s} named {named:6s} "
            + ("ok" if not t.problems else "PROBLEMS: " + "; ".join(t.problems)))


def summary(trials: list[Trial]) -> str:
    done = [t for t in trials if t.outcome is not None]
    hangs = sum(t.outcome.hung for t in done if t.outcome)
    orphans = sum(t.outcome.orphans > 0 for t in done if t.outcome)
    blame = sum(any(p.startswith("wrong blame") for p in t.problems) for t in done)
    corrupt = sum(any("lost or mixed" in p or p.startswith("accuracy") for p in t.problems) for t in done)
    ok = sum(not t.problems for t in done)
    lines = [f"{ok} of {len(done)} trials ok; hangs {hangs}, orphans {orphans}, wrong blame {blame}, "
             f"lost/mixed-twice updates or lost accuracy {corrupt}"]
    by_fault: dict[str, list[float]] = {}
    for t in done:
        if t.slowdown is not None and t.fault in SURVIVABLE:
            by_fault.setdefault(f"{t.fault} {t.protocol}", []).append(t.slowdown)
    for name, values in sorted(by_fault.items()):
        lines.append(f"  slowdown {name}: " + ", ".join(f"{v:.2f}x" for v in values))
    return "\n".join(lines)


if __name__ == "__main__":
    main()

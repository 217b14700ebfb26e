"""Chaos battery (issue 17, "No hang, ever"): one fault in one of 4 workers, at a random time,
under every protocol, as a user would meet it.

Each trial starts ``hopnet launch --nproc 4 --protocol P --peer-timeout 3 --timeout 20``
on ``examples/synthetic.py`` (sleep-emulated compute, a small real parameter vector; the
gradient-averaging protocols, which need a model, on ``examples/train_digits.py``), with
the protocol's tolerant configuration where it has one (:data:`CONFIGS`), waits until the
ranks log iterations, waits a random 0.5-3 s more, and hits a random rank with one fault:

* ``SIGKILL``;
* ``SIGSTOP``, never continued;
* ``SIGSTOP+CONT``: SIGSTOP, then SIGCONT 3 s later (as long as --peer-timeout: it may or
  may not be declared dead first).

Then it waits for the launcher to exit, at most ``--hang-after`` seconds (90) after the
fault; past that the trial is a HANG and everything is killed (the launcher's process
group, and the recorded worker pids, SIGCONT first). Per trial it records:

* ``exit``: the launcher's exit status; ``exit_s``: seconds from the fault to its exit;
* ``named``: a launcher line after the fault names the victim (``rank V`` / ``worker V``),
  ``named_s`` seconds after the fault (stderr read line by line, stamped on arrival);
* ``orphans``: recorded worker pids, or other members of the launcher's process group,
  still alive (not zombies) 2 s after the launcher exited;
* ``ok``: no hang, no orphans, the victim named (a SIGSTOP+CONT victim that came back
  in time and let the run finish with exit 0 needs no naming), and exit 0 where the
  configuration is expected to survive the loss (:data:`CONFIGS`).

    python bench/chaos.py                          # 24 trials: 8 protocols x 3 faults, then 4 churn trials
    python bench/chaos.py --trials 8 --seed 2 --json chaos.json
    python bench/chaos.py --protocols hop,partial-reduce --faults SIGSTOP --trials 4
    python bench/chaos.py --trials 0 --churn-trials 4 --seed 3     # churn trials only

After them, ``--churn-trials`` churn trials (bench/churn.py): an elastic run (``--max-nproc 6
--min-nproc 2``) that ``hopnet join --nproc 1`` grows and SIGTERMs (leaves) shrink at random
times; expected: no hang, no orphan, and the launcher, every join and every leaver exit 0.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from churn import CHURN_PROTOCOLS, ChurnTrial, churn_summary, run_churn_trial  # noqa: E402
from faults import FAULTS, NEEDS_A_MODEL, LaunchRun, alive, first_naming, group_members, inject, max_iteration, workload  # noqa: E402

NPROC = 4


@dataclass(frozen=True)
class Config:
    flags: tuple[str, ...]
    expect: str
    """What the docs promise (docs/guides/failures.md, docs/design/checkpoints.md) when one worker is lost:
    ``exit 0`` (the others finish, a 'lost rank' line), ``exit 0 or named`` (the others
    finish unless the victim was inside a group/averaging in progress, which fails with
    it), ``named`` (a strict protocol: the run stops naming the victim)."""

    @property
    def tolerant(self) -> bool:
        return self.expect != "named"


CONFIGS: dict[str, Config] = {
    # ring:4 gives each worker 2 in-neighbours; one backup worker lets it go on with one.
    "hop": Config(("--backup-workers", "1", "--max-failures", "1"), "exit 0"),
    "notify-ack": Config((), "named"),
    # docs/protocols/ad-psgd.md: an averaging a dead passive broke is skipped; a group a dead member broke is
    # rolled back on the others, who carry on.
    "ad-psgd": Config(("--max-failures", "1"), "exit 0"),
    "prague": Config(("--max-failures", "1"), "exit 0"),
    "eager-sgd": Config((), "named"),
    # docs/design/checkpoints.md: killed while computing or queued, it is dropped; inside a group, the group is rolled back.
    "partial-reduce": Config(("--max-failures", "1"), "exit 0"),
    "pipe-sgd": Config((), "named"),
    "allreduce": Config((), "named"),
}
PROTOCOLS = tuple(CONFIGS)


@dataclass
class Trial:
    protocol: str
    fault: str
    victim: int
    flags: str
    expect: str
    at_iter: int = -1
    exit: int | None = None
    exit_s: float | None = None
    named: bool = False
    named_s: float | None = None
    naming_line: str = ""
    lost_line: bool = False
    orphans: int = 0
    hang: bool = False
    ok: bool = False
    note: str = ""


def run_trial(protocol: str, fault: str, victim: int, rng: random.Random, run_dir: Path,
              args: argparse.Namespace) -> Trial:
    config = CONFIGS[protocol]
    trial = Trial(protocol, fault, victim, " ".join(config.flags), config.expect)
    run = LaunchRun.start(["--nproc", str(NPROC), "--protocol", protocol, "--peer-timeout", str(args.peer_timeout),
                           "--timeout", str(args.timeout), "--seed", str(rng.randrange(1 << 16)), *config.flags,
                           *workload(protocol, args.iterations, args.compute_ms)], run_dir)
    pids: dict[int, int] = {}
    try:
        setup_deadline = time.monotonic() + args.start_timeout
        pids = run.worker_pids(NPROC, setup_deadline)
        if len(pids) < NPROC or not run.wait_training(setup_deadline):
            trial.note = "never started training: " + " / ".join(ln.text for ln in run.lines()[-3:])
            return trial
        time.sleep(rng.uniform(0.5, 3.0))
        if run.proc.poll() is not None:
            trial.note = "finished before the fault"
            return trial
        trial.at_iter = max_iteration(run_dir)
        last = (4 if protocol in NEEDS_A_MODEL else 1) * args.iterations - 1
        if trial.at_iter >= last:
            trial.note = "training was over before the fault (more --iterations)"
            return trial
        timer = inject(fault, pids[victim])
        t_fault = time.monotonic()
        trial.exit = run.wait(t_fault + args.hang_after - time.monotonic())
        if trial.exit is None:
            trial.hang = True
            if timer is not None:
                timer.cancel()
            run.end(pids)
        else:
            trial.exit_s = time.monotonic() - t_fault
            if timer is not None:
                timer.cancel()
            time.sleep(2.0)
        left = set(alive(pids).values()) | set(group_members(run.proc.pid))
        trial.orphans = len(left)
        lines = run.launcher_lines()
        naming = first_naming(lines, victim, t_fault)
        if naming is not None:
            trial.named, trial.named_s, trial.naming_line = True, naming.t - t_fault, naming.text
        trial.lost_line = any(f"lost rank {victim} " in ln.text for ln in lines)
        came_back = fault == "SIGSTOP+CONT" and trial.exit == 0 and not trial.named
        trial.ok = (not trial.hang and trial.orphans == 0 and (trial.named or came_back)
                    and (config.expect != "exit 0" or trial.exit == 0))
        return trial
    finally:
        run.end(pids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=24, help="trials, cycling protocol x fault (default: 24)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--protocols", default=",".join(PROTOCOLS))
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--peer-timeout", type=float, default=3.0)
    parser.add_argument("--timeout", type=float, default=20.0, help="the workers' --timeout")
    parser.add_argument("--iterations", type=int, default=400)
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--hang-after", type=float, default=90.0, help="seconds after the fault that make a HANG")
    parser.add_argument("--start-timeout", type=float, default=90.0, help="seconds the workers get to start training")
    parser.add_argument("--churn-trials", type=int, default=4, help="churn trials after the fault trials (default: 4)")
    parser.add_argument("--churn-events", type=int, default=4, help="joins and leaves per churn trial (default: 4)")
    parser.add_argument("--churn-iterations", type=int, default=1000,
                        help="a churn trial's --iterations (long enough for its events; default: 1000)")
    parser.add_argument("--churn-protocols", default="hop,allreduce", help=f"of {', '.join(CHURN_PROTOCOLS)}")
    parser.add_argument("--json", type=Path, default=None, help="write every fault trial here (churn trials: NAME.churn.json)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories under this directory")
    args = parser.parse_args()
    protocols = args.protocols.split(",")
    faults = args.faults.split(",")
    unknown = ([p for p in protocols if p not in CONFIGS] + [f for f in faults if f not in FAULTS]
               + [p for p in args.churn_protocols.split(",") if p not in CHURN_PROTOCOLS])
    if unknown:
        parser.error(f"unknown protocol or fault: {', '.join(unknown)}")
    rng = random.Random(args.seed)
    print(f"{NPROC} workers, examples/synthetic.py --compute-ms {args.compute_ms:g} --iterations {args.iterations} "
          f"(allreduce, eager-sgd, pipe-sgd: examples/train_digits.py --iterations {4 * args.iterations}), "
          f"--peer-timeout {args.peer_timeout:g} --timeout {args.timeout:g}, hang after {args.hang_after:g} s, "
          f"seed {args.seed}", flush=True)
    header = ("protocol", "flags", "fault", "victim", "at iter", "exit", "fault->exit s", "named", "fault->named s",
              "orphans", "hang", "expect", "ok")
    if args.trials:
        print("| " + " | ".join(header) + " |\n|" + " --- |" * len(header), flush=True)
    trials: list[Trial] = []
    base = args.keep or Path(tempfile.mkdtemp(prefix="hopnet-chaos-"))
    for i in range(args.trials):
        protocol = protocols[i % len(protocols)]
        fault = faults[(i // len(protocols)) % len(faults)]
        victim = rng.randrange(NPROC)
        t = run_trial(protocol, fault, victim, rng, base / f"{i:03d}-{protocol}-{fault}", args)
        trials.append(t)
        cells = (t.protocol, t.flags or "-", t.fault, str(t.victim), str(t.at_iter), str(t.exit),
                 _f(t.exit_s), "yes" if t.named else "no", _f(t.named_s), str(t.orphans),
                 "HANG" if t.hang else "-", t.expect, "ok" if t.ok else "FAIL")
        print("| " + " | ".join(cells) + " |" + (f"  ({t.note})" if t.note else ""), flush=True)
        if args.json:
            args.json.write_text(json.dumps([asdict(x) for x in trials], indent=1))
    if trials:
        print(summary(trials), flush=True)
    churns = run_churn_trials(args, rng, base)
    if churns:
        print(churn_summary(churns), flush=True)
    if not args.keep:
        import shutil
        shutil.rmtree(base, ignore_errors=True)


def run_churn_trials(args: argparse.Namespace, rng: random.Random, base: Path) -> list[ChurnTrial]:
    protocols = args.churn_protocols.split(",")
    if args.churn_trials:
        print(f"\nchurn: --nproc 4 --max-nproc 6 --min-nproc 2, {args.churn_events} events a trial, "
              f"--iterations {args.churn_iterations} (digits: {4 * args.churn_iterations}), hang: no rank logs "
              f"for {args.hang_after:g} s", flush=True)
        print("\n| protocol | events | exit | join exits | joiners entered | leaver exits | orphans | hang | ok |\n|"
              + " --- |" * 9,
              flush=True)
    churns: list[ChurnTrial] = []
    for i in range(args.churn_trials):
        protocol = protocols[i % len(protocols)]
        t = run_churn_trial(protocol, rng, base / f"churn{i:03d}-{protocol}", args)
        churns.append(t)
        leavers = ", ".join(f"{r}: {c}" for r, c in t.leave_exits.items()) or "-"
        cells = (t.protocol, ", ".join(t.events) or "-", str(t.exit), ", ".join(map(str, t.join_exits)) or "-",
                 str(t.entered), leavers, str(t.orphans), "HANG" if t.hang else "-", "ok" if t.ok else "FAIL")
        print("| " + " | ".join(cells) + " |" + (f"  ({t.note})" if t.note else ""), flush=True)
        if args.json:
            churn_json = args.json.with_suffix(".churn.json")
            churn_json.write_text(json.dumps([asdict(x) for x in churns], indent=1))
    return churns


def summary(trials: list[Trial]) -> str:
    ran = [t for t in trials if not t.note]
    must_name = [t for t in ran if not (t.fault == "SIGSTOP+CONT" and t.exit == 0 and not t.named)]
    tolerant = [t for t in ran if CONFIGS[t.protocol].tolerant]
    named_s = [t.named_s for t in ran if t.named_s is not None and t.fault != "SIGSTOP+CONT"]
    spread = (f"{min(named_s):.1f} / {statistics.median(named_s):.1f} / {max(named_s):.1f}" if named_s else "-")
    return (f"summary: {len(ran)} of {len(trials)} trials ran; {sum(t.hang for t in ran)} hangs; "
            f"{sum(t.orphans for t in ran)} orphans; victim named {sum(t.named for t in must_name)} of {len(must_name)} "
            f"(the others came back from SIGSTOP+CONT and the run finished); tolerant configs exited 0 "
            f"{sum(t.exit == 0 for t in tolerant)} of {len(tolerant)} (hop, which promises it: "
            f"{sum(t.exit == 0 for t in tolerant if t.protocol == 'hop')} of "
            f"{sum(t.protocol == 'hop' for t in tolerant)}); fault -> naming line (SIGKILL, SIGSTOP) "
            f"min / median / max {spread} s; trials ok {sum(t.ok for t in ran)} of {len(ran)}")


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    main()

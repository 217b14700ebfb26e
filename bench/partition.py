"""A partition of an elastic run, timed (as root: emulated hosts in network namespaces,
bench/netns_hosts.py): 3 workers launched on host A (``--max-nproc 4 --min-nproc 2
--max-failures 1 --backup-workers 1``), a 4th joined from host B with ``hopnet join
--rendezvous``, then B's link cut for good once it trained. Prints the exit codes, the time
from the cut to the view without the 4th (committed, entered, the members' stall), to the
4th's stop and its line, and to its ``hopnet join``'s exit. tests/test_elastic_partition.py
checks the same story.

    python bench/partition.py [--peer-timeout 3] [--iterations 1000]
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from faults import ROOT, clean_env  # noqa: E402
from netns_hosts import NamespacedHosts, unavailable_reason  # noqa: E402

HOPNET = (sys.executable, "-m", "hopnet.cli.main")


def _events(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line half written
    return out


def _count(path: Path, event: str) -> int:
    return sum(r.get("event") == event for r in _events(path))


def _wait(what: str, ready: Any, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer-timeout", type=float, default=3.0)
    parser.add_argument("--iterations", type=int, default=1000)
    args = parser.parse_args()
    why_not = unavailable_reason()
    if why_not is not None:
        raise SystemExit(f"no emulated hosts: {why_not}")
    base = Path(tempfile.mkdtemp(prefix="hopnet-partition-"))
    from hopnet.security import CurveKeys, write_key_file

    key = str(write_key_file(base / "run.key", CurveKeys.generate()))
    dir_a, dir_b = base / "A", base / "B"
    env = clean_env()
    with NamespacedHosts(2) as hosts:
        address_a, address_b = hosts.addresses
        procs = []
        try:
            procs.append(subprocess.Popen(hosts.command(0, [
                *HOPNET, "launch", "--nproc", "3", "--max-nproc", "4", "--min-nproc", "2", "--max-failures", "1",
                "--backup-workers", "1", "--peer-timeout", str(args.peer_timeout), "--timeout", "20",
                "--bind", address_a, "--key-file", key, "--no-progress", "--run-dir", str(dir_a),
                str(ROOT / "examples" / "synthetic.py"), "--compute-ms", "20", "--model-mb", "0.01",
                "--iterations", str(args.iterations), "--warmup", "0", "--quiet"]), cwd=ROOT, env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
            _wait("host A's workers to train", lambda: _count(dir_a / "rank0.jsonl", "iteration") > 0)
            rendezvous = json.loads((dir_a / "launch.json").read_text())["rendezvous"]
            with (base / "B.out").open("w") as out_b:
                procs.append(subprocess.Popen(hosts.command(1, [
                    *HOPNET, "join", str(dir_b), "--rendezvous", rendezvous, "--key-file", key, "--bind", address_b,
                    "--nproc", "1"]), cwd=ROOT, env=env, stdout=out_b, stderr=subprocess.STDOUT,
                    start_new_session=True))
            _wait("rank 3 on host B to train", lambda: _count(dir_b / "rank3.jsonl", "iteration") >= 10)
            subprocess.run(["ip", "link", "set", hosts.outer[1], "down"], check=True, timeout=30)
            cut = time.monotonic()
            launcher, joiner = procs
            joiner_code = joiner.wait(timeout=120)
            joiner_s = time.monotonic() - cut
            launcher_code = launcher.wait(timeout=300)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)
    print(f"launcher on A: exit {launcher_code}; hopnet join on B: exit {joiner_code}, {joiner_s:.1f} s after the cut")
    for rank in (0, 1, 2):
        records = _events(dir_a / f"rank{rank}.jsonl")
        committed = [r for r in records if r.get("event") == "view_committed" and 3 in r.get("died", [])]
        entered = [r for r in records if r.get("event") == "view_entered" and committed
                   and r.get("view") == committed[0]["view"]]
        if committed and entered:
            print(f"rank {rank}: view {committed[0]['view']} without rank 3 committed {committed[0]['mono'] - cut:.2f} s "
                  f"after the cut, entered {entered[0]['mono'] - cut:.2f} s (stall {entered[0]['stall_s'] * 1000:.0f} ms)")
        else:
            print(f"rank {rank}: no view without rank 3")
    stopped = [r for r in _events(dir_b / "rank3.jsonl") if r.get("event") == "membership_stopped"]
    if stopped:
        print(f"rank 3: stopped {stopped[0]['mono'] - cut:.2f} s after the cut: {stopped[0]['line']}")
    print("hopnet join's output:\n" + (base / "B.out").read_text().rstrip())
    import shutil
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()

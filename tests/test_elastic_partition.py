"""A partition of an elastic run, on two emulated hosts (network namespaces on a bridge, as in
test_netns_hosts.py): 3 workers launched on host A, a 4th joined from host B, then B's link cut
for good. The 3 commit a view without the 4th (taken for dead) and finish; the 4th stops with
the membership's one "cut off" line, and `hopnet join` on B exits non-zero.

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.env import clean_env
from support.launch import LAUNCH
from support.paths import ROOT
from support.records import records
from support.wait import wait_until

sys.path.insert(0, str(ROOT / "bench"))
from netns_hosts import NamespacedHosts, unavailable_reason  # noqa: E402

SYNTHETIC = str(ROOT / "examples" / "synthetic.py")
JOIN = (sys.executable, "-m", "hopnet.cli.main", "join")
ITERATIONS = 1000  # about 25 s at 20 ms an iteration: time for the join and the cut before the end
WHY_NOT = unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=f"no emulated hosts: {WHY_NOT}")]


@pytest.fixture
def hosts() -> Iterator[NamespacedHosts]:
    with NamespacedHosts(2) as made:
        yield made


def _start(argv: list[str], out: Path) -> subprocess.Popen[bytes]:
    with out.open("wb") as sink:
        return subprocess.Popen(argv, cwd=ROOT, env=clean_env(PYTHONUNBUFFERED="1"), stdin=subprocess.DEVNULL,
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)


def _end(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_a_host_cut_off_stops_its_worker_and_the_others_go_on(hosts: NamespacedHosts, tmp_path: Path) -> None:
    from hopnet.security import CurveKeys, write_key_file

    key = str(write_key_file(tmp_path / "run.key", CurveKeys.generate()))
    dir_a, dir_b = tmp_path / "hostA", tmp_path / "hostB"
    address_a, address_b = hosts.addresses
    launcher = _start(hosts.command(0, [
        *LAUNCH, "--nproc", "3", "--max-nproc", "4", "--min-nproc", "2", "--max-failures", "1",
        "--backup-workers", "1", "--peer-timeout", "3", "--timeout", "20", "--bind", address_a,
        "--key-file", key, "--no-progress", "--run-dir", str(dir_a),
        SYNTHETIC, "--compute-ms", "20", "--model-mb", "0.01", "--iterations", str(ITERATIONS), "--warmup", "0",
        "--quiet"]), tmp_path / "A.out")
    procs = [launcher]
    try:
        wait_until(lambda: bool(records(dir_a, 0, "iteration")), 120, what="host A's workers to train")
        rendezvous = json.loads((dir_a / "launch.json").read_text())["rendezvous"]
        joiner = _start(hosts.command(1, [*JOIN, str(dir_b), "--rendezvous", rendezvous, "--key-file", key,
                                          "--bind", address_b, "--nproc", "1"]), tmp_path / "B.out")
        procs.append(joiner)
        wait_until(lambda: len(records(dir_b, 3, "iteration")) >= 10, 120, what="rank 3 on host B to train")
        subprocess.run(["ip", "link", "set", hosts.outer[1], "down"], check=True, timeout=30)
        assert joiner.wait(timeout=120) != 0
        assert launcher.wait(timeout=180) == 0, (tmp_path / "A.out").read_text()[-3000:]
    finally:
        for proc in procs:
            _end(proc)
    out_b = (tmp_path / "B.out").read_text()
    assert re.search(r"^hopnet: rank 3 is cut off from ranks 0, 1, 2 of view \d+ \(a majority\): it stops; "
                     r"the other side goes on$", out_b, re.M), out_b
    assert "Traceback" not in out_b and re.search(r"^hopnet join: rank 3 exited [1-9]", out_b, re.M), out_b
    views = json.loads((dir_a / "launch.json").read_text())["views"]
    assert views[-1]["members"] == [0, 1, 2] and views[-1]["died"] == [3], views
    assert [3] in [view["joined"] for view in views], views
    for rank in (0, 1, 2):
        assert records(dir_a, rank, "stop")[-1]["iter"] == ITERATIONS - 1

"""A transient partition shorter than --peer-timeout, between two emulated hosts joined by the
user-space forwarder (bench/netem/forwarder.py): nothing is declared dead, every rank finishes,
and no message is lost or taken twice (the receivers' link numbers: no ``gap``, no ``duplicate``).

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import pytest

from hopnet.runtime.events import read_events

from support.env import clean_env
from support.launch import LAUNCH
from support.wait import WaitTimedOut, wait_until

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from netem.forwarder import Faults, ForwardedLink, unavailable_reason  # noqa: E402

DIGITS = str(REPO / "examples" / "train_digits.py")
WHY_NOT = unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=f"no emulated hosts: {WHY_NOT}")]
ITERATIONS = 100
CUT_S = 2.0
PEER_TIMEOUT_S = 5


@pytest.fixture
def link() -> Iterator[ForwardedLink]:
    with ForwardedLink(seed=3) as made:
        yield made


def _launch(link: ForwardedLink, host: str, node: int, port: int, run_dir: Path) -> list[str]:
    return link.command(host, [*LAUNCH, "--nnodes", "2", "--node-rank", str(node), "--insecure",
                               "--rdzv-endpoint", f"{link.addresses['a']}:{port}", "--bind", link.addresses[host],
                               "--no-progress", "--run-dir", str(run_dir), "--graph", "ring:4",
                               "--peer-timeout", str(PEER_TIMEOUT_S), "--timeout", "60",
                               DIGITS, "--iterations", str(ITERATIONS), "--hidden", "256", "--eval-every", "100000"])


def _iterations(log: Path) -> int:
    return len(re.findall(r'"event": ?"iteration"', log.read_text())) if log.exists() else 0


def test_a_partition_shorter_than_the_peer_timeout_loses_nothing(link: ForwardedLink, tmp_path: Path) -> None:
    run_dirs = {"a": tmp_path / "node0", "b": tmp_path / "node1"}
    procs = [subprocess.Popen(_launch(link, host, node, 29871, run_dirs[host]), cwd=tmp_path,
                              env=clean_env(PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for node, host in enumerate(("a", "b"))]
    cut_at: int | None = None
    try:
        with suppress(WaitTimedOut):  # then the cut comes where the run is: the checks below still hold
            wait_until(lambda: _iterations(run_dirs["b"] / "rank2.jsonl") >= 20, 120, interval=0.1,
                       what="rank 2's iteration 20")
        cut_at = _iterations(run_dirs["b"] / "rank2.jsonl")
        link.set_faults(Faults(cut=True), Faults(cut=True))
        time.sleep(CUT_S)
        link.set_faults()
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate(timeout=30)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert cut_at is not None and cut_at < ITERATIONS - 10, f"the cut came after the training ({cut_at})"
    records = {int(log.stem[4:]): read_events(log) for d in run_dirs.values() for log in d.glob("rank*.jsonl")}
    assert sorted(records) == [0, 1, 2, 3]
    steps = [r["mono"] for r in records[0] if r["event"] == "iteration"]
    assert max(b - a for a, b in zip(steps, steps[1:])) >= CUT_S * 0.8, "the cut held nothing back"
    for rank, events in records.items():
        assert not [r for r in events if r["event"] in ("peer_dead", "link_gap")], (rank, events[-5:])
        stop = [r for r in events if r["event"] == "stop"][-1]
        assert stop["iter"] == ITERATIONS - 1, (rank, stop)
        dropped = stop.get("dropped", {})
        assert not dropped.get("gap") and not dropped.get("duplicate"), (rank, dropped)

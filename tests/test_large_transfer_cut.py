"""A large transfer cut in the middle, between two emulated hosts joined by the user-space forwarder
(bench/netem/forwarder.py), on ZeroMQ frames with CURVE keys and on a payload stream at once
(tests/workers/big_transfer.py: two ZmqTransport links, one process at each end).

A cut healed within ``send_timeout`` lets the transfer finish, bit-exact (TCP retransmits); a cut
for good ends the send within ``send_timeout``, counted ``send_timeout``, and the receiver never
delivers the partial tensor. 16 MiB per link: 100 MB (what the issue names) took 5-10 s per link
through the forwarder (about 40 MB/s for both links together), too long for the suite; the numbers
for 100 MB are in docs/design/transports.md ("Numbered messages").

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hopnet.security import KEY_ENV, CurveKeys

from support.env import clean_env

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from netem.forwarder import Faults, ForwardedLink, unavailable_reason  # noqa: E402

WORKER = str(REPO / "tests" / "workers" / "big_transfer.py")
WHY_NOT = unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=f"no emulated hosts: {WHY_NOT}")]
NUMEL = int(os.environ.get("HOPNET_BIG_TRANSFER_NUMEL", 4 << 20))  # float32: 16 MiB per link
SEND_TIMEOUT_S = float(os.environ.get("HOPNET_BIG_TRANSFER_TIMEOUT_S", 8.0))
CUT_S = 1.0  # TCP resends 1.4 s after the cut began: well within SEND_TIMEOUT_S, also on a busy machine
WAIT_S = 60.0


class End:
    """One worker process inside a host, and the JSON lines it prints."""

    def __init__(self, link: ForwardedLink, host: str, args: list[str], env: dict[str, str]) -> None:
        self.process = subprocess.Popen(link.command(host, [sys.executable, WORKER, *args]), env=env, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))

    def tell(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def expect(self, want: Callable[[dict[str, Any]], bool], timeout: float = WAIT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no such line within {timeout} s; seen: {self.seen[-6:]}") from None
            self.seen.append(line)
            if want(line):
                return line

    def drain(self, quiet_s: float = 0.5) -> list[dict[str, Any]]:
        """What it printed until ``quiet_s`` passed without a line."""
        got = []
        while True:
            try:
                got.append(self.lines.get(timeout=quiet_s))
            except queue.Empty:
                self.seen.extend(got)
                return got

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)


@pytest.fixture
def ends() -> Iterator[tuple[ForwardedLink, End, End]]:
    env = clean_env(PYTHONUNBUFFERED="1", **{KEY_ENV: CurveKeys.generate().to_text()})
    with ForwardedLink(seed=5) as link:
        receiver = End(link, "b", ["receive", link.addresses["b"], "29901", "29902"], env)
        sender = None
        try:
            addresses = receiver.expect(lambda line: "addresses" in line)["addresses"]
            sender = End(link, "a", ["send", *addresses, str(NUMEL), str(SEND_TIMEOUT_S)], env)
            yield link, sender, receiver
        finally:
            for end in (sender, receiver):
                if end is not None:
                    end.stop()


def received_bytes(process: subprocess.Popen[str]) -> int:
    """Bytes the host of ``process`` received so far (its network namespace's interfaces)."""
    lines = Path(f"/proc/{process.pid}/net/dev").read_text().splitlines()[2:]
    return sum(int(line.split(":", 1)[1].split()[0]) for line in lines if not line.strip().startswith("lo:"))


def cut_mid_transfer(link: ForwardedLink, sender: End, receiver: End, it: int) -> None:
    """Start a transfer on both links and cut the link both ways once a third of it crossed."""
    before = received_bytes(receiver.process)
    sender.tell(f"send {it}")
    total = 2 * NUMEL * 4
    deadline = time.monotonic() + WAIT_S
    while received_bytes(receiver.process) - before < total // 3:
        assert time.monotonic() < deadline, "the transfer did not start"
        time.sleep(0.005)
    link.set_faults(Faults(cut=True), Faults(cut=True))
    assert received_bytes(receiver.process) - before < total, "the transfer ended before the cut"


def deliveries(lines: list[dict[str, Any]], kind: str) -> dict[int, list[tuple[int, bool | None]]]:
    got: dict[int, list[tuple[int, bool | None]]] = {1: [], 3: []}
    for line in lines:
        if line.get("kind") == kind:
            got[line["rank"]].append((line["iter"], line["exact"]))
    return got


def test_a_cut_in_the_middle_of_a_large_transfer_heals_or_ends_the_send_and_delivers_no_partial_tensor(
        ends: tuple[ForwardedLink, End, End]) -> None:
    link, sender, receiver = ends
    sender.tell("token 0")  # both links connected (and the CURVE handshake done) before the timing starts
    for _ in range(2):
        receiver.expect(lambda line: line.get("kind") == "token")

    # A cut shorter than send_timeout: TCP retransmits once it heals, and the transfer completes.
    cut_mid_transfer(link, sender, receiver, 1)
    time.sleep(CUT_S)
    link.set_faults()
    sent = sender.expect(lambda line: "sent" in line)["sent"]
    assert [s["dropped"] for s in sent] == [{}, {}], sent
    assert [s["streamed"] for s in sent] == [0, 1], sent  # rank 0: ZeroMQ frames (CURVE); rank 2: the stream
    sender.tell("token 2")
    receiver.expect(lambda line: line.get("kind") == "token" and line["iter"] == 2)
    receiver.expect(lambda line: line.get("kind") == "token" and line["iter"] == 2)
    assert deliveries(receiver.seen, "update") == {1: [(1, True)], 3: [(1, True)]}

    # A cut for good: each send ends within send_timeout (a margin for the loop's rounds), dropped and
    # counted; or, on a busy machine where the cut came late, with every byte already in the sender's
    # kernel, which then delivers the rest once the link heals: whole, or not at all.
    cut_mid_transfer(link, sender, receiver, 3)
    sent = sender.expect(lambda line: "sent" in line, timeout=SEND_TIMEOUT_S + WAIT_S)["sent"]
    assert all(s["dropped"] in ({"send_timeout": 1}, {}) for s in sent), sent
    assert all(s["seconds"] <= SEND_TIMEOUT_S + 2.0 for s in sent), sent
    dropped = {{0: 1, 2: 3}[s["rank"]]: bool(s["dropped"]) for s in sent}  # by receiving rank
    # The receivers keep nothing of it: no partial tensor is delivered, also once the link heals, and
    # the next message gets through (the stream's: it waits for no message of the stream cut short).
    link.set_faults()
    sender.tell("token 4")
    for _ in range(2):
        receiver.expect(lambda line: line.get("kind") == "token" and line["iter"] == 4)
    receiver.drain(quiet_s=1.0)
    assert deliveries(receiver.seen, "update") == {
        rank: [(1, True)] + ([] if dropped[rank] else [(3, True)]) for rank in (1, 3)}
    assert deliveries(receiver.seen, "token") == {1: [(0, None), (2, None), (4, None)],
                                                  3: [(0, None), (2, None), (4, None)]}
    receiver.tell("stats")
    stats = receiver.expect(lambda line: "stats" in line)["stats"]
    assert all(not s["dropped"].get("duplicate") for s in stats.values()), stats
    # The stream's link kept its connection: the message cut short is a gap there. The ZeroMQ link was
    # reset (a new epoch): what it had queued was dropped and counted by the sender, not a gap.
    assert stats["3"]["dropped"].get("gap", 0) == int(dropped[3]) and not stats["1"]["dropped"].get("gap"), stats

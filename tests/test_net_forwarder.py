"""The user-space forwarder (bench/netem/forwarder.py) between two emulated hosts: frames pass,
and each direction's delay, loss and one-way cut act as configured.

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from netem.forwarder import Direction, Faults, ForwardedLink, unavailable_reason  # noqa: E402

WHY_NOT = unavailable_reason()
needs_namespaces = pytest.mark.skipif(WHY_NOT is not None, reason=f"no emulated hosts: {WHY_NOT}")
PORT = 40100

# One small tool run inside a host: `receive ADDR N IDLE_S` counts datagrams until IDLE_S passes
# without one (or N came) and prints the count; `send ADDR N` sends N datagrams; `echo ADDR IDLE_S`
# returns each datagram to its sender; `ping ADDR N` prints the round trips of N echoed datagrams;
# over TCP, `sink ADDR` prints how many bytes one connection brought, `stream ADDR N` sends N bytes.
UDP_TOOL = r"""
import json, socket, sys, time
mode, addr = sys.argv[1], sys.argv[2]
sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM if mode in ("sink", "stream") else socket.SOCK_DGRAM)
if mode == "sink":
    sock.bind((addr, PORT))
    sock.listen(1)
    print("ready", flush=True)
    conn, _ = sock.accept()
    total = 0
    while chunk := conn.recv(65536):
        total += len(chunk)
    print(total, flush=True)
elif mode == "stream":
    sock.connect((addr, PORT))
    sock.sendall(b"x" * int(sys.argv[3]))
    sock.close()
if mode in ("receive", "echo"):
    sock.bind((addr, PORT))
    print("ready", flush=True)
if mode == "receive":
    want, idle = int(sys.argv[3]), float(sys.argv[4])
    sock.settimeout(idle)
    count = 0
    try:
        while count < want:
            sock.recv(2048)
            count += 1
    except socket.timeout:
        pass
    print(count, flush=True)
elif mode == "send":
    for i in range(int(sys.argv[3])):
        sock.sendto(b"x" * 64, (addr, PORT))
        time.sleep(0.002)
elif mode == "echo":
    sock.settimeout(float(sys.argv[3]))
    try:
        while True:
            data, sender = sock.recvfrom(2048)
            sock.sendto(data, sender)
    except socket.timeout:
        pass
elif mode == "ping":
    sock.settimeout(2.0)
    rtts = []
    for i in range(int(sys.argv[3])):
        start = time.monotonic()
        sock.sendto(b"%d" % i, (addr, PORT))
        sock.recv(2048)
        rtts.append(time.monotonic() - start)
    print(json.dumps(rtts), flush=True)
""".replace("PORT", str(PORT))


@pytest.fixture
def link() -> Iterator[ForwardedLink]:
    with ForwardedLink(seed=7) as made:
        yield made


class Listener:
    """A `receive` or `echo` tool in one host, started and ready, ended on exit."""

    def __init__(self, link: ForwardedLink, host: str, args: list[str]) -> None:
        self.process = subprocess.Popen(link.command(host, [sys.executable, "-c", UDP_TOOL, *args]),
                                        stdout=subprocess.PIPE, text=True, start_new_session=True)

    def __enter__(self) -> Listener:
        assert self.process.stdout is not None
        assert self.process.stdout.readline().strip() == "ready"
        return self

    def output(self, timeout: float = 10) -> str:
        return self.process.communicate(timeout=timeout)[0]

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.communicate(timeout=10)


def run_tool(link: ForwardedLink, host: str, args: list[str]) -> str:
    result = subprocess.run(link.command(host, [sys.executable, "-c", UDP_TOOL, *args]),
                            capture_output=True, text=True, timeout=20, check=True)
    return result.stdout


def datagrams_received(link: ForwardedLink, sender: str, receiver: str, count: int, idle_s: float = 0.5) -> int:
    with Listener(link, receiver, ["receive", link.addresses[receiver], str(count), str(idle_s)]) as listener:
        run_tool(link, sender, ["send", link.addresses[receiver], str(count)])
        return int(listener.output())


def round_trips(link: ForwardedLink, probes: int) -> list[float]:
    with Listener(link, "b", ["echo", link.addresses["b"], "3"]):
        return json.loads(run_tool(link, "a", ["ping", link.addresses["b"], str(probes)]))


@needs_namespaces
def test_datagrams_cross_the_forwarder_both_ways(link: ForwardedLink) -> None:
    assert datagrams_received(link, "a", "b", 5) == 5
    assert datagrams_received(link, "b", "a", 5) == 5
    assert len(round_trips(link, 3)) == 3


@needs_namespaces
def test_delay_each_way_lengthens_the_round_trip(link: ForwardedLink) -> None:
    delay_ms = 50
    link.set_faults(a_to_b=Faults(delay_ms=delay_ms), b_to_a=Faults(delay_ms=delay_ms))
    rtts = round_trips(link, 3)
    assert min(rtts) >= 2 * delay_ms / 1000 * 0.95, rtts


@needs_namespaces
def test_a_one_way_cut_drops_one_direction_until_healed(link: ForwardedLink) -> None:
    link.set_faults(a_to_b=Faults(cut=True))
    assert datagrams_received(link, "a", "b", 5) == 0
    assert datagrams_received(link, "b", "a", 5) == 5
    link.set_faults()
    assert datagrams_received(link, "a", "b", 5) == 5


@needs_namespaces
def test_loss_drops_about_the_configured_fraction(link: ForwardedLink) -> None:
    link.set_faults(a_to_b=Faults(loss=0.3))
    sent = 200
    lost = sent - datagrams_received(link, "a", "b", sent)
    assert 0.1 * sent <= lost <= 0.5 * sent, lost
    link.set_faults()  # reports the counters at once
    assert link.counters()["a_to_b"]["dropped"] >= lost  # with the hosts' own IPv6 chatter


@needs_namespaces
def test_a_tcp_stream_crosses_with_delay_and_reordering(link: ForwardedLink) -> None:
    """Checksum offload is off on the hosts, so re-sent segments arrive intact and within the MTU."""
    link.set_faults(a_to_b=Faults(delay_ms=2, reorder=0.05, reorder_ms=5), b_to_a=Faults(delay_ms=2))
    size = 2_000_000
    with Listener(link, "b", ["sink", link.addresses["b"]]) as sink:
        run_tool(link, "a", ["stream", link.addresses["b"], str(size)])
        assert int(sink.output(timeout=20)) == size


def delays_ms(faults: Faults, frames: int = 2000, seed: int = 1) -> list[float | None]:
    direction = Direction(faults, random.Random(seed))
    return [None if (d := direction.delay_s()) is None else d * 1000 for _ in range(frames)]


def test_jitter_stays_within_its_spread_and_never_below_zero() -> None:
    uniform = delays_ms(Faults(delay_ms=10, jitter_ms=4))
    assert all(d is not None and 6 <= d <= 14 for d in uniform)
    assert max(d for d in uniform if d is not None) - min(d for d in uniform if d is not None) > 6
    normal = delays_ms(Faults(delay_ms=1, jitter_ms=5, jitter="normal"))
    assert all(d is not None and d >= 0 for d in normal)
    assert sum(d == 0 for d in normal) > 100  # the clamped negative draws


def test_reordering_holds_back_about_its_fraction() -> None:
    held = sum(d is not None and d >= 20 for d in delays_ms(Faults(delay_ms=1, reorder=0.2, reorder_ms=20)))
    assert 300 <= held <= 500, held


def test_loss_and_cut_are_seeded_and_cut_drops_all() -> None:
    assert delays_ms(Faults(loss=0.3)) == delays_ms(Faults(loss=0.3))
    assert all(d is None for d in delays_ms(Faults(cut=True), frames=50))
    with pytest.raises(ValueError):
        Faults.from_json({"los": 0.1})

"""A user-space packet forwarder that emulates a misbehaving link, for kernels without netem.

Two emulated hosts, ``hA`` and ``hB``, each in its own network namespace with one veth whose
peer end lives in a third, "router" namespace. The forwarder runs there: it reads every
Ethernet frame arriving on one router end (AF_PACKET raw sockets) and writes it out the other,
so the hosts talk at layer 2 on one /24 as if cabled together, while each direction
independently loses, delays, jitters, reorders or drops everything (a one-way cut)::

    with ForwardedLink(seed=1) as link:          # needs root and `ip`
        link.set_faults(a_to_b=Faults(delay_ms=50, jitter_ms=5), b_to_a=Faults(loss=0.1))
        subprocess.run(link.command("a", ["python", "client.py", link.addresses["b"]]))
        link.set_faults(a_to_b=Faults(cut=True))  # applied once this returns
        link.set_faults()                           # healed: no faults either way

Faults change while the forwarder runs: :meth:`ForwardedLink.set_faults` rewrites a JSON
control file that the forwarder polls and waits until the forwarder reports it applied.
The hosts have static neighbour entries, so a one-way cut does not also break ARP the other way.
Every namespace, link and process is removed on exit, also after a failure; names are unique
per use, so several can exist at once.

Limits: one Python process forwards frames one by one: one TCP stream reached about 40 MB/s
(35,000 frames/s both ways) on a shared 2-core VM. The hosts' transmit checksum (and so
segmentation) offload is off, so every frame fits the MTU.

Run alone (what :class:`ForwardedLink` starts in the router namespace)::

    python bench/netem/forwarder.py --a IFACE --b IFACE --control FILE --status FILE [--seed N]
    python bench/netem/forwarder.py --checksum-offload-off IFACE   # in each host, before
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import fcntl
import heapq
import json
import os
import random
import secrets
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

ETH_P_ALL = 0x0003
SIOCETHTOOL = 0x8946
ETHTOOL_STXCSUM = 0x17
IFREQ_SIZE = 40
MAX_FRAME = 65536
CONTROL_POLL_S = 0.02
STATUS_EVERY_S = 0.5
FRAMES_PER_WAKEUP = 256
DIRECTIONS = ("a_to_b", "b_to_a")
Jitter = Literal["uniform", "normal"]


@dataclass(frozen=True)
class Faults:
    """What one direction of the link does to each frame.

    ``loss``: probability a frame is dropped. ``delay_ms`` plus a jitter of ``jitter_ms`` drawn
    ``uniform`` in [-jitter, +jitter] or ``normal`` with that standard deviation (never below 0).
    ``reorder``: fraction of frames held back ``reorder_ms`` more, so later ones overtake them.
    ``cut``: drop everything. A change acts on frames arriving after it; held ones keep their time.
    """

    loss: float = 0.0
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    jitter: Jitter = "uniform"
    reorder: float = 0.0
    reorder_ms: float = 10.0
    cut: bool = False

    @classmethod
    def from_json(cls, raw: dict[str, object] | None) -> Faults:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw or {}) - known
        if unknown:
            raise ValueError(f"unknown fault settings: {sorted(unknown)}")
        return cls(**(raw or {}))  # type: ignore[arg-type]

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclass
class Direction:
    """One way through the forwarder: its faults, its own seeded RNG, and what it did."""

    faults: Faults
    rng: random.Random
    forwarded: int = 0
    dropped: int = 0

    def delay_s(self) -> float | None:
        """Seconds to hold the next frame, or ``None`` to drop it."""
        faults = self.faults
        if faults.cut or (faults.loss > 0 and self.rng.random() < faults.loss):
            return None
        delay = faults.delay_ms + self._jitter_ms()
        if faults.reorder > 0 and self.rng.random() < faults.reorder:
            delay += faults.reorder_ms
        return max(delay, 0.0) / 1000

    def _jitter_ms(self) -> float:
        spread = self.faults.jitter_ms
        if spread <= 0:
            return 0.0
        if self.faults.jitter == "normal":
            return self.rng.gauss(0.0, spread)
        return self.rng.uniform(-spread, spread)


@dataclass(order=True)
class Pending:
    due: float
    sequence: int  # ties by arrival, so equal delays keep frames in order
    frame: bytes = field(compare=False)
    out: socket.socket = field(compare=False)


def open_raw_socket(interface: str) -> socket.socket:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.bind((interface, 0))
    sock.setblocking(False)
    return sock


class Forwarder:
    """Bridges frames between two interfaces, applying each direction's :class:`Faults`."""

    def __init__(self, iface_a: str, iface_b: str, control: Path, status: Path, seed: int) -> None:
        self.sock_a = open_raw_socket(iface_a)
        self.sock_b = open_raw_socket(iface_b)
        self.control = control
        self.status = status
        self.directions = {name: Direction(Faults(), random.Random(f"{seed}:{name}")) for name in DIRECTIONS}
        self.queue: list[Pending] = []
        self.sequence = 0
        self.control_stamp: tuple[int, int] | None = None
        self.applied_version = -1
        self.status_written = 0.0
        self.parent = os.getppid()
        self.running = True

    def run(self) -> None:
        self.reload_control()
        while self.running and os.getppid() == self.parent:  # ends with whoever started it
            readable, _, _ = select.select([self.sock_a, self.sock_b], [], [], self.wait_s())
            for sock in readable:
                self.drain(sock)
            self.release_due()
            self.reload_control()
            if time.monotonic() - self.status_written > STATUS_EVERY_S:
                self.write_status()

    def stop(self, *_: object) -> None:
        self.running = False

    def wait_s(self) -> float:
        if not self.queue:
            return CONTROL_POLL_S
        return min(max(self.queue[0].due - time.monotonic(), 0.0), CONTROL_POLL_S)

    def drain(self, sock: socket.socket) -> None:
        inbound, out = ("a_to_b", self.sock_b) if sock is self.sock_a else ("b_to_a", self.sock_a)
        direction = self.directions[inbound]
        for _ in range(FRAMES_PER_WAKEUP):
            try:
                frame, address = sock.recvfrom(MAX_FRAME)
            except BlockingIOError:
                return
            if address[2] == socket.PACKET_OUTGOING:  # our own sends, seen again on the way out
                continue
            delay = direction.delay_s()
            if delay is None:
                direction.dropped += 1
                continue
            self.sequence += 1
            heapq.heappush(self.queue, Pending(time.monotonic() + delay, self.sequence, frame, out))

    def release_due(self) -> None:
        now = time.monotonic()
        while self.queue and self.queue[0].due <= now:
            pending = heapq.heappop(self.queue)
            direction = self.directions["a_to_b" if pending.out is self.sock_b else "b_to_a"]
            try:
                pending.out.send(pending.frame)
                direction.forwarded += 1
            except OSError:  # above the MTU, or the link's queue is full: the frame is lost
                direction.dropped += 1

    def reload_control(self) -> None:
        try:
            stat = self.control.stat()
        except FileNotFoundError:
            return
        stamp = (stat.st_ino, stat.st_mtime_ns)
        if stamp == self.control_stamp:
            return
        self.control_stamp = stamp
        settings = json.loads(self.control.read_text())
        for name in DIRECTIONS:
            self.directions[name].faults = Faults.from_json(settings.get(name))
        self.applied_version = int(settings.get("version", 0))
        self.write_status()

    def write_status(self) -> None:
        report = {"applied": self.applied_version,
                  **{name: {"forwarded": d.forwarded, "dropped": d.dropped} for name, d in self.directions.items()}}
        write_atomically(self.status, json.dumps(report))
        self.status_written = time.monotonic()


def write_atomically(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never half of it."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def disable_checksum_offload(interface: str) -> None:
    """Have the kernel fill in checksums before frames leave ``interface`` (``ethtool -K tx off``).

    A veth otherwise passes frames on with the checksum still to be computed, and a frame
    re-sent from a raw socket arrives at the far host with it wrong. Segmentation offload
    depends on checksum offload, so this also keeps frames within the MTU.
    """
    command = ctypes.create_string_buffer(struct.pack("II", ETHTOOL_STXCSUM, 0))
    ifreq = struct.pack("16sP", interface.encode(), ctypes.addressof(command)).ljust(IFREQ_SIZE, b"\0")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        fcntl.ioctl(sock.fileno(), SIOCETHTOOL, ifreq)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable_reason() -> str | None:
    """``None`` when :class:`ForwardedLink` can be made here, else why not (one line)."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces and raw sockets need root"
    probe = f"fwprobe{secrets.token_hex(3)}"
    result = _ip("netns", "add", probe, check=False)
    if result.returncode != 0:
        return f"cannot create a network namespace: {result.stderr.strip() or result.returncode}"
    _ip("netns", "del", probe, check=False)
    return None


class ForwardedLink:
    """Hosts ``a`` and ``b`` joined through a :class:`Forwarder` (see the module docstring)."""

    SUBNET = "10.78.0"
    READY_TIMEOUT_S = 10.0

    def __init__(self, seed: int = 0) -> None:
        tag = secrets.token_hex(3)  # interface names are at most 15 characters
        self.seed = seed
        self.namespaces = {"a": f"fw{tag}hA", "b": f"fw{tag}hB", "router": f"fw{tag}r"}
        self.host_ends = {"a": f"fw{tag}a", "b": f"fw{tag}b"}
        self.router_ends = {"a": f"fw{tag}ra", "b": f"fw{tag}rb"}
        self.addresses = {"a": f"{self.SUBNET}.1", "b": f"{self.SUBNET}.2"}
        self.workdir = Path(tempfile.mkdtemp(prefix=f"fw{tag}"))
        self.control = self.workdir / "control.json"
        self.status = self.workdir / "status.json"
        self.version = 0
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ForwardedLink:
        try:
            self._make_topology()
            self._start_forwarder()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside host ``host`` (``"a"`` or ``"b"``)."""
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def set_faults(self, a_to_b: Faults = Faults(), b_to_a: Faults = Faults()) -> None:
        """Replace both directions' faults; returns once the forwarder applies them."""
        self.version += 1
        write_atomically(self.control, json.dumps(
            {"version": self.version, "a_to_b": a_to_b.to_json(), "b_to_a": b_to_a.to_json()}))
        self._wait_applied(self.version)

    def cap(self, rate: str | None, burst: str = "64kb", latency: str = "200ms") -> None:
        """Cap each host's sending at ``rate`` (``tc ... tbf`` on its end of the link), or remove
        the cap (``None``)."""
        for host in ("a", "b"):
            args = ["tc", "-n", self.namespaces[host], "qdisc"]
            end = self.host_ends[host]
            if rate is None:
                subprocess.run([*args, "del", "dev", end, "root"], capture_output=True, text=True, timeout=30)
            else:
                subprocess.run([*args, "replace", "dev", end, "root", "tbf", "rate", rate, "burst", burst,
                                "latency", latency], check=True, capture_output=True, text=True, timeout=30)

    def counters(self) -> dict[str, dict[str, int]]:
        """Frames forwarded and dropped per direction so far (reported twice a second)."""
        report = json.loads(self.status.read_text())
        return {name: report[name] for name in DIRECTIONS}

    def _make_topology(self) -> None:
        router = self.namespaces["router"]
        _ip("netns", "add", router)
        for host in ("a", "b"):
            namespace, host_end, router_end = self.namespaces[host], self.host_ends[host], self.router_ends[host]
            _ip("netns", "add", namespace)
            _ip("link", "add", host_end, "netns", namespace, "type", "veth", "peer", "name", router_end, "netns", router)
            _ip("-n", namespace, "addr", "add", f"{self.addresses[host]}/24", "dev", host_end)
            _ip("-n", namespace, "link", "set", host_end, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", router, "link", "set", router_end, "promisc", "on", "up")
            self._run_here(namespace, "--checksum-offload-off", host_end)
        self._add_static_neighbours()

    def _add_static_neighbours(self) -> None:
        for host, peer in (("a", "b"), ("b", "a")):
            peer_mac = self._mac(peer)
            _ip("-n", self.namespaces[host], "neigh", "replace", self.addresses[peer], "lladdr", peer_mac,
                "dev", self.host_ends[host], "nud", "permanent")

    def _run_here(self, namespace: str, *args: str) -> None:
        """This module run with ``args`` inside ``namespace``."""
        subprocess.run(["ip", "netns", "exec", namespace, sys.executable, str(Path(__file__).resolve()), *args],
                       check=True, capture_output=True, text=True, timeout=30)

    def _mac(self, host: str) -> str:
        shown = json.loads(_ip("-j", "-n", self.namespaces[host], "link", "show", self.host_ends[host]).stdout)
        return str(shown[0]["address"])

    def _start_forwarder(self) -> None:
        write_atomically(self.control, json.dumps({"version": 0}))
        argv = [sys.executable, str(Path(__file__).resolve()), "--a", self.router_ends["a"], "--b",
                self.router_ends["b"], "--control", str(self.control), "--status", str(self.status),
                "--seed", str(self.seed)]
        self.process = subprocess.Popen(["ip", "netns", "exec", self.namespaces["router"], *argv],
                                        start_new_session=True)
        self._wait_applied(0)

    def _wait_applied(self, version: int) -> None:
        deadline = time.monotonic() + self.READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"the forwarder exited with {self.process.returncode}")
            try:
                if json.loads(self.status.read_text())["applied"] >= version:
                    return
            except (FileNotFoundError, json.JSONDecodeError):
                pass
            time.sleep(0.01)
        raise TimeoutError(f"the forwarder did not apply control version {version} in {self.READY_TIMEOUT_S} s")

    def _stop_forwarder(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=5)

    def close(self) -> None:
        self._stop_forwarder()
        for namespace in self.namespaces.values():
            _ip("netns", "del", namespace, check=False)  # takes its veth ends, and so the pairs, with it
        shutil.rmtree(self.workdir, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Forward frames between two interfaces with faults.")
    parser.add_argument("--a", help="interface towards host A")
    parser.add_argument("--b", help="interface towards host B")
    parser.add_argument("--control", type=Path, help="JSON file of faults, polled")
    parser.add_argument("--status", type=Path, help="where the applied version is reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checksum-offload-off", metavar="IFACE",
                        help="only turn off IFACE's transmit checksum offload, and exit")
    args = parser.parse_args(argv)
    if args.checksum_offload_off:
        disable_checksum_offload(args.checksum_offload_off)
        return
    if None in (args.a, args.b, args.control, args.status):
        parser.error("--a, --b, --control and --status are required to forward")
    forwarder = Forwarder(args.a, args.b, args.control, args.status, args.seed)
    signal.signal(signal.SIGTERM, forwarder.stop)
    signal.signal(signal.SIGINT, forwarder.stop)
    forwarder.run()


if __name__ == "__main__":
    main()


__all__ = ["Faults", "ForwardedLink", "Forwarder", "unavailable_reason"]

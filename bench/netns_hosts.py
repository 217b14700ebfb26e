"""Emulated hosts for multi-machine tests and benchmarks: network namespaces on a bridge.

``with NamespacedHosts(2) as hosts:`` makes a bridge and, per host, a namespace joined to it
by a veth pair, with its own address (``hosts.addresses[i]``, 10.77.X.(i+1)/24); ``hosts.command(i, argv)``
is ``argv`` run inside host ``i``. ``hosts.cap(i, "20mbit")`` caps the host's link both ways
with ``tc ... tbf``. Everything is removed on exit, also after a failure.
:func:`unavailable_reason` says why namespaces cannot be made here (not root, no ``ip``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable_reason() -> str | None:
    """``None`` when namespaces can be made here, else why not (one line)."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"hnprobe{os.getpid() % 100000}"
    result = _ip("netns", "add", probe, check=False)
    if result.returncode != 0:
        return f"cannot create a network namespace: {result.stderr.strip() or result.returncode}"
    _ip("netns", "del", probe, check=False)
    return None


class NamespacedHosts:
    """``n`` emulated hosts on one bridge (see the module docstring)."""

    def __init__(self, n: int, subnet: int | None = None) -> None:
        tag = os.getpid() % 10000
        self.n = n
        self.subnet = subnet if subnet is not None else 100 + os.getpid() % 150
        self.bridge = f"hnbr{tag}"
        self.namespaces = [f"hn{tag}h{i}" for i in range(n)]
        self.outer = [f"hn{tag}v{i}" for i in range(n)]   # the bridge's end of each veth pair
        self.inner = [f"hn{tag}p{i}" for i in range(n)]   # the host's end
        self.addresses = [f"10.77.{self.subnet}.{i + 1}" for i in range(n)]

    def __enter__(self) -> NamespacedHosts:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for ns, outer, inner, addr in zip(self.namespaces, self.outer, self.inner, self.addresses):
                _ip("netns", "add", ns)
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                _ip("link", "set", inner, "netns", ns)
                _ip("link", "set", outer, "master", self.bridge)
                _ip("link", "set", outer, "up")
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
                _ip("-n", ns, "link", "set", inner, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def cap(self, host: int, rate: str, burst: str = "64kb", latency: str = "100ms") -> None:
        """Cap host ``host``'s link at ``rate`` both ways (token bucket filter on each veth end)."""
        for args in ((self.outer[host],), ("-n", self.namespaces[host], self.inner[host])):
            *prefix, dev = args
            subprocess.run(["tc", *(["-n", prefix[1]] if prefix else []), "qdisc", "replace", "dev", dev, "root",
                            "tbf", "rate", rate, "burst", burst, "latency", latency],
                           check=True, capture_output=True, text=True, timeout=30)

    def uncap(self, host: int) -> None:
        """Remove :meth:`cap`'s limit from host ``host``'s link."""
        for args in ((self.outer[host],), ("-n", self.namespaces[host], self.inner[host])):
            *prefix, dev = args
            subprocess.run(["tc", *(["-n", prefix[1]] if prefix else []), "qdisc", "del", "dev", dev, "root"],
                           check=False, capture_output=True, text=True, timeout=30)

    def close(self) -> None:
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)  # takes the host's end of the veth, and the pair, with it
        for outer in self.outer:
            _ip("link", "del", outer, check=False)
        _ip("link", "del", self.bridge, check=False)

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["NamespacedHosts", "unavailable_reason"]

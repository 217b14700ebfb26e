"""What the kernel counted on this process's TCP connections to each peer: round trip and retransmissions.

libzmq keeps its sockets' descriptors to itself, so this asks the kernel instead: one netlink
``SOCK_DIAG`` dump of the TCP sockets (IPv4 and IPv6) with their ``tcp_info``, kept to the
sockets this process holds (the inodes behind ``/proc/self/fd``) whose remote end is a peer's
advertised address (``tcp://HOST:PORT``, and its ``?data=PORT``): the connections this rank
opened to send to that peer. Linux only; elsewhere, or when netlink is refused, nothing is
measured (an empty answer), never an error.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Mapping
from urllib.parse import parse_qs, urlsplit

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST_DUMP = 0x1 | 0x300
NLMSG_DONE, NLMSG_ERROR = 3, 2
INET_DIAG_INFO = 2
ALL_STATES = 0xFFF
_HEADER = struct.Struct("=IHHII")
_REQUEST = struct.Struct("=BBBBI48s")
_DIAG_MSG = struct.Struct("=BBBBHH16s16sIQIIIII")  # family, state, timer, retrans, sockid..., uid, inode
# offsets into struct tcp_info (include/uapi/linux/tcp.h)
_RTT, _RTTVAR, _TOTAL_RETRANS, _DATA_SEGS_OUT = 68, 72, 100, 156
_BYTES_SENT, _BYTES_RETRANS = 200, 208


def _own_socket_inodes() -> set[int]:
    inodes: set[int] = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return inodes
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _peer_endpoints(addresses: Mapping[int, str]) -> dict[tuple[str, int], int]:
    """``(ip, port) -> rank`` for each peer's ``tcp://`` address and its data port."""
    endpoints: dict[tuple[str, int], int] = {}
    for rank, address in addresses.items():
        if not isinstance(address, str) or not address.startswith("tcp://"):
            continue
        parts = urlsplit(address)
        try:
            ip = str(ipaddress.ip_address(socket.gethostbyname(parts.hostname or "")))
            ports = [parts.port, *(int(p) for p in parse_qs(parts.query).get("data", []))]
        except (OSError, ValueError):
            continue
        for port in ports:
            if port:
                endpoints[(ip, port)] = rank
    return endpoints


def _dump(family: int) -> list[tuple[str, int, int, bytes]]:
    """Every TCP socket of ``family`` in this network namespace: (remote ip, remote port, inode, tcp_info)."""
    request = _REQUEST.pack(family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), 0, ALL_STATES, bytes(48))
    message = _HEADER.pack(_HEADER.size + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST_DUMP, 1, 0) + request
    found: list[tuple[str, int, int, bytes]] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as sock:
        sock.settimeout(1.0)
        sock.send(message)
        while True:
            data = sock.recv(1 << 16)
            offset = 0
            while offset + _HEADER.size <= len(data):
                length, kind = _HEADER.unpack_from(data, offset)[:2]
                if kind in (NLMSG_DONE, NLMSG_ERROR) or length < _HEADER.size:
                    return found
                body = data[offset + _HEADER.size:offset + length]
                found.append(_parse(body, family))
                offset += (length + 3) & ~3
            if not data:
                return found


def _parse(body: bytes, family: int) -> tuple[str, int, int, bytes]:
    fields = _DIAG_MSG.unpack_from(body)
    dport, dst, inode = socket.ntohs(fields[5]), fields[7], fields[14]
    ip = str(ipaddress.ip_address(dst[:4] if family == socket.AF_INET else dst))
    info = b""
    offset = _DIAG_MSG.size
    while offset + 4 <= len(body):
        length, kind = struct.unpack_from("=HH", body, offset)
        if length < 4:
            break
        if kind == INET_DIAG_INFO:
            info = body[offset + 4:offset + length]
        offset += (length + 3) & ~3
    return ip, dport, inode, info


def _u32(info: bytes, offset: int) -> int | None:
    return struct.unpack_from("=I", info, offset)[0] if len(info) >= offset + 4 else None


def _u64(info: bytes, offset: int) -> int | None:
    return struct.unpack_from("=Q", info, offset)[0] if len(info) >= offset + 8 else None


def link_counters(addresses: Mapping[int, str]) -> dict[int, dict[str, float]]:
    """Per peer rank, over this process's connections to its addresses: ``rtt_ms`` and ``rttvar_ms``
    (the kernel's smoothed round trip and its variation; the largest of the connections'),
    ``retransmits`` and ``segments`` (data segments sent), ``bytes_sent`` and ``bytes_retransmitted``
    (kernels from 4.19). Empty where the kernel cannot be asked."""
    endpoints = _peer_endpoints(addresses)
    if not endpoints or not hasattr(socket, "AF_NETLINK"):
        return {}
    own = _own_socket_inodes()
    try:
        sockets = _dump(socket.AF_INET) + _dump(socket.AF_INET6)
    except OSError:
        return {}
    counters: dict[int, dict[str, float]] = {}
    for ip, port, inode, info in sockets:
        rank = endpoints.get((ip.removeprefix("::ffff:"), port))
        if rank is None or inode not in own or len(info) < _DATA_SEGS_OUT + 4:
            continue
        peer = counters.setdefault(rank, {"rtt_ms": 0.0, "rttvar_ms": 0.0, "retransmits": 0, "segments": 0})
        peer["rtt_ms"] = max(peer["rtt_ms"], (_u32(info, _RTT) or 0) / 1000)
        peer["rttvar_ms"] = max(peer["rttvar_ms"], (_u32(info, _RTTVAR) or 0) / 1000)
        peer["retransmits"] += _u32(info, _TOTAL_RETRANS) or 0
        peer["segments"] += _u32(info, _DATA_SEGS_OUT) or 0
        sent, retransmitted = _u64(info, _BYTES_SENT), _u64(info, _BYTES_RETRANS)
        if sent is not None and retransmitted is not None:
            peer["bytes_sent"] = peer.get("bytes_sent", 0) + sent
            peer["bytes_retransmitted"] = peer.get("bytes_retransmitted", 0) + retransmitted
    return counters


__all__ = ["link_counters"]

"""Who a worker is when another launcher started it: torchrun or SLURM's ``srun``.

:func:`detect` reads the variables those launchers set and returns an :class:`ExternalEnv`
(``None`` when neither did). Precedence: ``hopnet launch``'s own ``HOPNET_RANK`` (not read
here), then torchrun's ``RANK``/``WORLD_SIZE``, then SLURM's ``SLURM_PROCID``/``SLURM_NTASKS``.

=================  ============================  ===========================================
                   torchrun                      srun
=================  ============================  ===========================================
rank               ``RANK``                      ``SLURM_PROCID``
world size         ``WORLD_SIZE``                ``SLURM_NTASKS``
local rank         ``LOCAL_RANK``                ``SLURM_LOCALID``
node rank          ``GROUP_RANK`` (else 0)       ``SLURM_NODEID``
master host        ``MASTER_ADDR``               ``MASTER_ADDR``, else the first host of
                                                 ``SLURM_STEP_NODELIST`` / ``SLURM_JOB_NODELIST``
master port        ``MASTER_PORT``               ``MASTER_PORT``, else
                                                 ``20000 + SLURM_JOB_ID % 20000``
the run's store    torchrun's agent store at     hosted by rank 0 at master host:port
                   master host:port
=================  ============================  ===========================================

Under torchrun's c10d rendezvous (``TORCHELASTIC_USE_AGENT_STORE=True``) the agent of
node 0 already serves a TCPStore at ``MASTER_ADDR:MASTER_PORT``: every worker opens it as a
client and hopnet's keys live under a prefix naming the run and the restart. Otherwise
rank 0 hosts the store there itself (``HOPNET_STORE_PORT`` picks another port).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from hopnet.errors import ConfigError

STORE_PORT = "HOPNET_STORE_PORT"
SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 20000


@dataclass(frozen=True)
class ExternalEnv:
    """Rank, world and the run's store as torchrun or SLURM described them."""

    launcher: str
    """``"torchrun"`` or ``"slurm"``."""
    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    master_addr: str
    master_port: int
    agent_store: bool
    """True when torchrun's agent already serves a TCPStore at ``master_addr:master_port``."""
    run_id: str
    """Names this run (and restart) in the store's keys."""

    @property
    def store_endpoint(self) -> str:
        from hopnet.rendezvous.store import format_endpoint

        return format_endpoint(self.master_addr, self.master_port)

    @property
    def hosts_store(self) -> bool:
        """This process must host the run's store (rank 0 when no agent serves one)."""
        return not self.agent_store and self.rank == 0

    @property
    def key_prefix(self) -> str:
        return f"hopnet/{self.run_id}/"


def _int(environ: Mapping[str, str], name: str, why: str) -> int:
    text = environ.get(name, "").strip()
    if not text:
        raise ConfigError(f"{name} is not set ({why})")
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not an integer") from None


def _port(environ: Mapping[str, str], name: str, why: str) -> int:
    port = _int(environ, name, why)
    if not 0 < port < 65536:
        raise ConfigError(f"{name}={port} is not a TCP port (1-65535)")
    return port


def _check(launcher: str, rank: int, world: int, local: int, node: int, names: tuple[str, ...]) -> None:
    rank_name, world_name, local_name, node_name = names
    if world < 1:
        raise ConfigError(f"{world_name}={world} must be >= 1 ({launcher})")
    if not 0 <= rank < world:
        raise ConfigError(f"{rank_name}={rank} is out of range ({world_name}={world}, {launcher})")
    if not 0 <= local < world:
        raise ConfigError(f"{local_name}={local} is out of range ({world_name}={world}, {launcher})")
    if node < 0:
        raise ConfigError(f"{node_name}={node} must be >= 0 ({launcher})")


_RANGE_PART = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets: ``a[1-2],b`` -> ``["a[1-2]", "b"]``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"node list {text!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ConfigError(f"node list {text!r}: unbalanced '['")
    parts.append(text[start:])
    return parts


def _expand(item: str, whole: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", item)
    if match is None:
        if "[" in item or "]" in item:
            raise ConfigError(f"node list {whole!r}: bad brackets in {item!r}")
        return [item]
    head, tail = item[:match.start()], item[match.end():]
    names: list[str] = []
    for part in match.group(1).split(","):
        m = _RANGE_PART.match(part.strip())
        if m is None:
            raise ConfigError(f"node list {whole!r}: {part!r} is not a number or a range like 01-03")
        low, high = m.group(1), m.group(2) or m.group(1)
        if int(high) < int(low):
            raise ConfigError(f"node list {whole!r}: range {part!r} runs backwards")
        width = len(low)  # zero padding is kept: node[08-10] -> node08 node09 node10
        for n in range(int(low), int(high) + 1):
            for rest in _expand(tail, whole):  # a second bracket group: rack[1-2]-n[1-2]
                names.append(f"{head}{n:0{width}d}{rest}")
    return names


def parse_nodelist(text: str) -> list[str]:
    """Expand SLURM's compact host list: ``node[01-03,07],gpu5`` -> node01 node02 node03 node07 gpu5."""
    whole = text.strip()
    if not whole:
        raise ConfigError("node list is empty")
    hosts: list[str] = []
    for item in _split_top(whole):
        item = item.strip()
        if not item:
            raise ConfigError(f"node list {whole!r}: empty entry")
        hosts.extend(_expand(item, whole))
    return hosts


def _torchrun(environ: Mapping[str, str]) -> ExternalEnv:
    why = "torchrun sets it; hopnet reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT"
    rank = _int(environ, "RANK", why)
    world = _int(environ, "WORLD_SIZE", why)
    local = _int(environ, "LOCAL_RANK", why)
    node = _int(environ, "GROUP_RANK", why) if environ.get("GROUP_RANK", "").strip() else 0
    _check("torchrun", rank, world, local, node, ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK"))
    addr = environ.get("MASTER_ADDR", "").strip()
    if not addr:
        raise ConfigError(f"MASTER_ADDR is not set ({why})")
    port = _port(environ, "MASTER_PORT", why)
    agent = environ.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() == "true"
    if not agent and environ.get(STORE_PORT, "").strip():
        port = _port(environ, STORE_PORT, "the port rank 0 hosts the run's store on")
    run = environ.get("TORCHELASTIC_RUN_ID", "none").strip() or "none"
    restart = environ.get("TORCHELASTIC_RESTART_COUNT", "0").strip() or "0"
    return ExternalEnv("torchrun", rank, world, local, node, addr, port, agent, f"{run}.{restart}")


def _slurm(environ: Mapping[str, str]) -> ExternalEnv:
    why = "srun sets it for every task"
    rank = _int(environ, "SLURM_PROCID", why)
    world = _int(environ, "SLURM_NTASKS", why)
    local = _int(environ, "SLURM_LOCALID", why)
    node = _int(environ, "SLURM_NODEID", why)
    _check("slurm", rank, world, local, node, ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID"))
    addr = environ.get("MASTER_ADDR", "").strip()
    if not addr:
        nodelist = (environ.get("SLURM_STEP_NODELIST", "").strip()
                    or environ.get("SLURM_JOB_NODELIST", "").strip())
        if not nodelist:
            raise ConfigError("neither MASTER_ADDR nor SLURM_STEP_NODELIST / SLURM_JOB_NODELIST is set "
                              "(hopnet needs the host of rank 0)")
        addr = parse_nodelist(nodelist)[0]
    job = environ.get("SLURM_JOB_ID", "").strip()
    if environ.get(STORE_PORT, "").strip():
        port = _port(environ, STORE_PORT, "the port rank 0 hosts the run's store on")
    elif environ.get("MASTER_PORT", "").strip():
        port = _port(environ, "MASTER_PORT", why)
    elif job:
        port = SLURM_PORT_BASE + _int(environ, "SLURM_JOB_ID", why) % SLURM_PORT_SPAN
    else:
        raise ConfigError("neither MASTER_PORT nor SLURM_JOB_ID is set (hopnet needs a port for the run's store)")
    step = environ.get("SLURM_STEP_ID", "0").strip() or "0"
    return ExternalEnv("slurm", rank, world, local, node, addr, port, False, f"slurm{job or 'x'}.{step}")


def detect(environ: Mapping[str, str]) -> ExternalEnv | None:
    """torchrun's or SLURM's description of this process, or ``None`` when neither started it."""
    if environ.get("RANK", "").strip() or environ.get("WORLD_SIZE", "").strip():
        return _torchrun(environ)
    if environ.get("SLURM_PROCID", "").strip():
        return _slurm(environ)
    return None


def route_address(master_addr: str, master_port: int) -> str:
    """The local IP address the route to the master leaves from (what peers can reach)."""
    try:
        infos = socket.getaddrinfo(master_addr, master_port, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot resolve the master host {master_addr!r}: {exc.strerror}") from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(sockaddr)  # UDP: no packet is sent, only the route is looked up
        except OSError as exc:
            raise ConfigError(f"no route to the master host {master_addr!r}: {exc.strerror}") from None
        return str(probe.getsockname()[0])


__all__ = ["ExternalEnv", "detect", "parse_nodelist", "route_address"]

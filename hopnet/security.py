"""CurveZMQ for hopnet's ZeroMQ sockets: the run's key, servers, clients, refused handshakes.

Every socket of a run (worker transports, the rendezvous, the coordinator) shares one
CURVE keypair, the *run key*. A server socket takes the run key as its own, and its
ZAP handler admits exactly one client key: the run's public key. A client presents
the run key and expects the server to hold it too. So a connection is made only
between two holders of the run's secret key; every message on it is encrypted and
authenticated by libzmq. A process without the key cannot complete the handshake, so
it gets no message into any socket (its attempts are counted, see
:class:`HandshakeWatch`). CURVE tells members from outsiders, not one rank from
another: within the run, the routing-id check of the transport names the sender.

Where the key comes from (``hopnet launch`` decides, see :func:`resolve_run_key`):
a fresh keypair per run, or the file the user gives with ``--key-file``, in the
ZeroMQ certificate format (:func:`load_key_file`). The launcher hands it to its workers
in the environment variable :data:`KEY_ENV` (``"PUBLIC SECRET"``, Z85), never through
the run's c10d store, which is not authenticated.

For a socket, one call each::

    make_curve_server(router, keys)   # before bind()
    make_curve_client(dealer, keys)   # before connect()
    watch = HandshakeWatch(router)    # optional: count refused handshakes

or, for a process that may or may not have a run key (``keys_from_environ()`` is
``None`` on plain runs), :func:`secure_server` / :func:`secure_client`, which do nothing
without one.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from hopnet.errors import ConfigError

log = logging.getLogger(__name__)

KEY_ENV = "HOPNET_CURVE_KEY"
"""The run key for a worker: ``"PUBLIC SECRET"``, both Z85 (40 characters). Unset: plain sockets."""
KEY_FILE_ENV = "HOPNET_KEY_FILE"
"""A key file for workers started by another launcher (torchrun, srun): read when
:data:`KEY_ENV` is unset."""

ZAP_DOMAIN = "hopnet"
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP specification (RFC 27)
_Z85_KEY_LENGTH = 40

_LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "")

HANDSHAKE_FAILED_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
"""Monitor events of a connection refused at the handshake: no CURVE or a wrong server
key (protocol), or a client key the ZAP handler refused (auth). Not counted: a
connection dropped mid-handshake (``HANDSHAKE_FAILED_NO_DETAIL``: a peer that died, a
port scan), which is not evidence of a missing key."""


# ------------------------------------------------------------------------------ keys
def require_curve() -> None:
    """Raise :class:`ConfigError` when this libzmq cannot do CURVE (built without libsodium/tweetnacl)."""
    if not zmq.has("curve"):
        raise ConfigError(f"libzmq {zmq.zmq_version()} (pyzmq {zmq.__version__}) was built without CURVE "
                          "security; install a pyzmq wheel (which bundles it) or run with --insecure")


@dataclass(frozen=True, repr=False)
class CurveKeys:
    """A CURVE keypair, both halves Z85-encoded (40 ASCII bytes each)."""

    public: bytes
    secret: bytes

    def __repr__(self) -> str:  # never print the secret
        return f"CurveKeys(public={self.public.decode('ascii', 'replace')!r})"

    @classmethod
    def generate(cls) -> CurveKeys:
        require_curve()
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def from_pair(cls, public: bytes | str, secret: bytes | str, where: str) -> CurveKeys:
        """Check a pair read from ``where`` (named in the one-line error): Z85, 40 characters,
        and the public key is the one the secret key gives."""
        require_curve()
        pub = public.encode("ascii", "replace") if isinstance(public, str) else bytes(public)
        sec = secret.encode("ascii", "replace") if isinstance(secret, str) else bytes(secret)
        for name, key in (("public", pub), ("secret", sec)):
            if len(key) != _Z85_KEY_LENGTH:
                raise ConfigError(f"{where}: the {name} key must be {_Z85_KEY_LENGTH} Z85 characters "
                                  f"(got {len(key)})")
        try:
            derived = zmq.curve_public(sec)
        except (ValueError, zmq.ZMQError, TypeError):
            raise ConfigError(f"{where}: the secret key is not valid Z85") from None
        if derived != pub:
            raise ConfigError(f"{where}: the public key does not belong to the secret key")
        return cls(pub, sec)

    def to_text(self) -> str:
        """``"PUBLIC SECRET"``: the value of :data:`KEY_ENV`."""
        return f"{self.public.decode('ascii')} {self.secret.decode('ascii')}"

    @classmethod
    def from_text(cls, text: str, where: str = KEY_ENV) -> CurveKeys:
        parts = text.split()
        if len(parts) != 2:
            raise ConfigError(f"{where}: expected 'PUBLIC SECRET' (two Z85 keys)")
        return cls.from_pair(parts[0], parts[1], where)


def keys_from_environ(environ: Mapping[str, str] | None = None) -> CurveKeys | None:
    """The run key the launcher gave this worker (:data:`KEY_ENV`), else the one in the file
    :data:`KEY_FILE_ENV` names (other launchers), else ``None`` (plain sockets)."""
    env = os.environ if environ is None else environ
    text = env.get(KEY_ENV, "").strip()
    if text:
        return CurveKeys.from_text(text)
    path = env.get(KEY_FILE_ENV, "").strip()
    if path:
        try:
            return load_key_file(path)
        except ConfigError as exc:
            raise ConfigError(str(exc).replace("--key-file", KEY_FILE_ENV, 1)) from None
    return None


KEY_FILE_FORMAT = """\
#   hopnet run key (ZeroMQ CURVE certificate). Keep it secret: whoever holds it
#   can join the run. Made by `hopnet keygen`; zmq.auth.create_certificates writes
#   the same format (use its .key_secret file).
metadata
curve
    public-key = "{public}"
    secret-key = "{secret}"
"""


def write_key_file(path: str | os.PathLike[str], keys: CurveKeys) -> Path:
    """Write ``keys`` in the ZeroMQ certificate format, readable by the owner only."""
    target = Path(path)
    text = KEY_FILE_FORMAT.format(public=keys.public.decode("ascii"), secret=keys.secret.decode("ascii"))
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(text)
    return target


def load_key_file(path: str | os.PathLike[str]) -> CurveKeys:
    """Read a key file: a ZeroMQ CURVE certificate holding both keys::

        curve
            public-key = "<40 Z85 characters>"
            secret-key = "<40 Z85 characters>"

    (lines starting with ``#`` and other sections are ignored). Raises a one-line
    :class:`ConfigError` for a file that cannot be read or is ill-formed.
    """
    where = f"--key-file {os.fspath(path)}"
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not a text key file (non-ASCII bytes)") from None
    found: dict[str, str] = {}
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or "=" not in stripped:
            continue
        name, _, value = stripped.partition("=")
        name = name.strip()
        if name in ("public-key", "secret-key"):
            if name in found:
                raise ConfigError(f"{where}: {name} appears twice")
            found[name] = value.strip().strip("'\"")
    missing = [n for n in ("public-key", "secret-key") if n not in found]
    if missing:
        raise ConfigError(f"{where}: no {' and no '.join(missing)} line (expected a ZeroMQ CURVE "
                          "certificate with both keys, as `hopnet keygen` writes)")
    return CurveKeys.from_pair(found["public-key"], found["secret-key"], where)


# --------------------------------------------------------------------------- policy
def host_of(address: str) -> str:
    """The host part of ``tcp://HOST:PORT`` / ``HOST:PORT`` / ``HOST`` (brackets removed)."""
    text = address.strip()
    if text.startswith(("ipc://", "inproc://")):
        return "localhost"  # a local socket file or an in-process endpoint
    text = text.removeprefix("tcp://")
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text[1:]
    if text.count(":") == 1:
        return text.rsplit(":", 1)[0]
    return text


def is_loopback(host: str) -> bool:
    """Whether binding to ``host`` keeps a socket on this machine's loopback interface.

    Wildcards (``0.0.0.0``, ``*``, ``::``) and names other than localhost are not
    loopback (a name could resolve anywhere: the safe answer is no)."""
    name = host_of(host)
    if name in _WILDCARD_HOSTS:
        return False
    if name.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class RunSecurity:
    """What `hopnet launch` decided: the run key (``None``: plain sockets) and why."""

    keys: CurveKeys | None
    source: str
    """``"generated"``, ``"key file PATH"``, ``"off: loopback"`` or ``"off: --insecure"``."""
    warning: str | None = None


def resolve_run_key(bind: str, *, insecure: bool = False, secure: bool = False,
                    key_file: str | os.PathLike[str] | None = None) -> RunSecurity:
    """Decide whether a run's sockets use CURVE, and with which key.

    CURVE is on when the sockets leave loopback, when ``secure`` forces it, or when a
    ``key_file`` is given; ``insecure`` turns it off (with a warning when the sockets
    are reachable from other machines). Loopback-only runs are plain by default:
    nothing off this machine can reach them, and encryption would cost every message
    (see docs/design/transports.md, "Security").
    """
    if insecure and (secure or key_file is not None):
        raise ConfigError("--insecure cannot be combined with --secure or --key-file")
    local = is_loopback(bind)
    if insecure:
        warning = None if local else (f"--insecure: sockets bound to {bind} are neither authenticated nor "
                                      "encrypted; anyone who can reach them can join the run and inject updates")
        return RunSecurity(None, "off: --insecure", warning)
    if key_file is not None:
        return RunSecurity(load_key_file(key_file), f"key file {os.fspath(key_file)}")
    if secure or not local:
        return RunSecurity(CurveKeys.generate(), "generated")
    return RunSecurity(None, "off: loopback")


# --------------------------------------------------------------------------- sockets
class _ZapHandler(threading.Thread):
    """Answers libzmq's ZAP requests for one context: admits the CURVE client keys in
    ``allowed`` (Z85), refuses everything else.

    It stops by itself when the context is terminated (its blocking receive fails with
    ETERM; it closes its socket, which lets ``term()`` return), so owners of a context
    need not know it exists.
    """

    def __init__(self, context: zmq.Context, key: int) -> None:
        super().__init__(name="hopnet-zap", daemon=True)
        self._key = key
        self.allowed: set[bytes] = set()
        self.refused = 0
        self._sock = context.socket(zmq.REP, socket_class=zmq.Socket)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(_ZAP_ENDPOINT)

    def run(self) -> None:
        sock = self._sock
        try:
            while True:
                try:
                    request = sock.recv_multipart()
                except zmq.ContextTerminated:
                    return
                except zmq.ZMQError as exc:
                    if exc.errno in (zmq.ENOTSOCK,):
                        return
                    continue
                try:
                    sock.send_multipart(self._answer(request))
                except zmq.ContextTerminated:
                    return
                except zmq.ZMQError:
                    continue
        finally:
            with _zap_lock:
                if _zap_handlers.get(self._key) is self:
                    del _zap_handlers[self._key]
            sock.close(0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        # [version, request id, domain, address, routing id, mechanism, credentials...]
        if len(request) < 6:
            version, request_id = (request + [b"1.0", b""])[:2]
            return [version, request_id, b"500", b"malformed ZAP request", b"", b""]
        version, request_id, domain, address, _identity, mechanism, *credentials = request
        ok = (mechanism == b"CURVE" and len(credentials) == 1 and len(credentials[0]) == 32
              and z85.encode(credentials[0]) in self.allowed)
        if ok:
            return [version, request_id, b"200", b"OK", b"hopnet-run", b""]
        self.refused += 1
        log.debug("refused a %s client from %s (domain %r)", mechanism.decode("ascii", "replace"),
                  address.decode("ascii", "replace"), domain)
        return [version, request_id, b"400", b"not a member of this run", b"", b""]


_zap_lock = threading.Lock()
_zap_handlers: dict[int, _ZapHandler] = {}


def _zap_handler(context: zmq.Context) -> _ZapHandler:
    """The ZAP handler of ``context``'s libzmq context, started on first use."""
    key = int(context.underlying)
    with _zap_lock:
        handler = _zap_handlers.get(key)
        if handler is None:
            handler = _ZapHandler(zmq.Context.shadow(key), key)
            _zap_handlers[key] = handler
            handler.start()
        return handler


def make_curve_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` (before it binds) a CURVE server that admits only holders of ``keys``."""
    require_curve()
    _zap_handler(sock.context).allowed.add(keys.public)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode("ascii"))
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)


def make_curve_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` (before it connects) a CURVE client of a server holding ``keys``."""
    require_curve()
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


def secure_server(sock: zmq.Socket, keys: CurveKeys | None) -> HandshakeWatch | None:
    """With ``keys``: :func:`make_curve_server` and a :class:`HandshakeWatch` on ``sock``
    (before bind; close the watch before the socket's context). Without: nothing, ``None``."""
    if keys is None:
        return None
    make_curve_server(sock, keys)
    return HandshakeWatch(sock)


def secure_client(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """With ``keys``: :func:`make_curve_client` (before connect). Without: nothing."""
    if keys is not None:
        make_curve_client(sock, keys)


_watch_ids = itertools.count()


class HandshakeWatch:
    """Counts the connections a server socket refused at the handshake (libzmq's monitor).

    A client without CURVE, with the wrong server key or with a key the ZAP handler
    refuses never gets a message through; this is where those attempts become visible.
    The count is a lower bound: a client refused for a protocol mismatch (no CURVE, a wrong
    server key) does not retry, and when it hangs up before this side has read its greeting,
    libzmq reports a plain disconnect here, not a failed handshake. :attr:`fd` is edge-triggered like any ZeroMQ socket's: call
    :meth:`poll` when it fires (it drains everything pending).
    """

    def __init__(self, sock: zmq.Socket) -> None:
        address = f"inproc://hopnet-handshakes-{os.getpid()}-{next(_watch_ids)}"
        sock.monitor(address, HANDSHAKE_FAILED_EVENTS)
        self._watched = sock
        self._mon = sock.context.socket(zmq.PAIR, socket_class=zmq.Socket)
        self._mon.setsockopt(zmq.LINGER, 0)
        self._mon.connect(address)
        self.refused = 0

    @property
    def socket(self) -> zmq.Socket:
        return self._mon

    @property
    def fd(self) -> int:
        return self._mon.getsockopt(zmq.FD)

    def poll(self) -> int:
        """Read every pending event; return how many refused handshakes they add."""
        added = 0
        mon = self._mon
        if mon.closed:
            return 0
        try:
            while mon.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                try:
                    frames = mon.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    event = parse_monitor_message(frames)["event"]
                except Exception:  # noqa: BLE001 - a malformed monitor message is libzmq's bug, not ours
                    continue
                if event & HANDSHAKE_FAILED_EVENTS:
                    added += 1
        except zmq.ZMQError:
            pass
        self.refused += added
        return added

    def close(self) -> None:
        """Stop watching (call before closing the watched socket's context)."""
        try:
            if not self._watched.closed:
                self._watched.disable_monitor()
        except zmq.ZMQError:
            pass
        self._mon.close(0)


__all__ = [
    "HANDSHAKE_FAILED_EVENTS",
    "KEY_ENV",
    "KEY_FILE_ENV",
    "CurveKeys",
    "HandshakeWatch",
    "RunSecurity",
    "is_loopback",
    "keys_from_environ",
    "load_key_file",
    "make_curve_client",
    "make_curve_server",
    "require_curve",
    "resolve_run_key",
    "secure_client",
    "secure_server",
    "write_key_file",
]

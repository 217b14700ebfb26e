"""CurveZMQ: only holders of the run key get a message into a worker or the rendezvous."""

from __future__ import annotations

import asyncio
import json
import stat
from pathlib import Path

import pytest
import torch
import zmq

from hopnet.cli.main import main as cli_main
from hopnet.errors import ConfigError, WaitTimeout
from hopnet.rendezvous.client import exchange_addresses
from hopnet.rendezvous.server import RendezvousServer
from hopnet.security import (
    KEY_ENV,
    KEY_FILE_ENV,
    CurveKeys,
    is_loopback,
    keys_from_environ,
    load_key_file,
    make_curve_client,
    resolve_run_key,
    secure_client,
    secure_server,
    write_key_file,
)
from hopnet.transports.zmq import ZmqTransport, zmq_endpoint
from hopnet.wire import Message, encode_header

from support.paths import WORKERS
from support.launch import kill, start_launch
from support.records import records
from support.wait import wait_until, wait_until_async

SECURE_WORKER = str(WORKERS / "secure_worker.py")


class _Inbox:
    def __init__(self) -> None:
        self.messages: list[Message] = []

    def buffers_for(self, header: object) -> None:
        return None

    def deliver(self, msg: Message) -> None:
        self.messages.append(msg)


def _update_frames(src: int, dst: int, value: float) -> list[bytes]:
    """A validly framed update, as a member's transport would send it."""
    tensor = torch.full((4,), value, dtype=torch.float64)
    header = encode_header(Message("update", src, dst, 0, tensors=[tensor]))
    return [header, tensor.numpy().tobytes()]


def _rogue_dealer(ctx: zmq.Context, address: str, *, as_rank: int, keys: CurveKeys | None,
                  server_key: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, str(as_rank).encode())
    if keys is not None:
        make_curve_client(sock, keys)
        if server_key is not None:  # its own key pair, but it learned the server's public key
            sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
    sock.connect(zmq_endpoint(address))
    return sock


# ----------------------------------------------------------------------------- policy
@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("localhost", True), ("::1", True), ("tcp://[::1]:*", True),
    ("tcp://127.0.0.1:5555", True), ("ipc:///tmp/x", True),
    ("0.0.0.0", False), ("*", False), ("::", False), ("10.0.0.5", False), ("tcp://192.168.1.2:*", False),
    ("node7.cluster", False),
])
def test_loopback_is_recognised_and_everything_else_is_not(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_curve_is_on_off_loopback_and_where_asked() -> None:
    assert resolve_run_key("127.0.0.1").keys is None
    off_host = resolve_run_key("0.0.0.0")
    assert off_host.keys is not None and off_host.source == "generated" and off_host.warning is None
    assert resolve_run_key("127.0.0.1", secure=True).keys is not None
    a, b = resolve_run_key("10.1.2.3").keys, resolve_run_key("10.1.2.3").keys
    assert a is not None and b is not None and a.public != b.public  # a fresh key per run
    insecure = resolve_run_key("0.0.0.0", insecure=True)
    assert insecure.keys is None and "--insecure" in insecure.warning and "\n" not in insecure.warning
    assert resolve_run_key("127.0.0.1", insecure=True).warning is None  # plain there anyway
    with pytest.raises(ConfigError, match="--insecure cannot be combined"):
        resolve_run_key("0.0.0.0", insecure=True, secure=True)


def test_a_libzmq_without_curve_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zmq, "has", lambda capability: capability != "curve")
    with pytest.raises(ConfigError, match="built without CURVE.*--insecure"):
        resolve_run_key("0.0.0.0")
    assert resolve_run_key("127.0.0.1").keys is None  # plain runs do not need it
    assert resolve_run_key("0.0.0.0", insecure=True).keys is None


def test_the_run_key_travels_in_one_variable_and_never_shows_its_secret() -> None:
    keys = CurveKeys.generate()
    assert keys_from_environ({KEY_ENV: keys.to_text()}) == keys
    assert keys_from_environ({}) is None
    assert keys.secret.decode() not in repr(keys)


def test_workers_of_other_launchers_read_the_key_file_their_environment_names(tmp_path: Path) -> None:
    keys = CurveKeys.generate()
    write_key_file(tmp_path / "run.key", keys)
    assert keys_from_environ({KEY_FILE_ENV: str(tmp_path / "run.key")}) == keys
    with pytest.raises(ConfigError, match=f"^{KEY_FILE_ENV} .*missing.key"):
        keys_from_environ({KEY_FILE_ENV: str(tmp_path / "missing.key")})
    with pytest.raises(ConfigError, match=KEY_ENV):
        keys_from_environ({KEY_ENV: "not a key"})


# ---------------------------------------------------------------------------- key file
def test_keygen_writes_a_private_key_file_that_launch_reads(tmp_path: Path, capsys) -> None:
    from zmq.auth import create_certificates, load_certificate

    path = tmp_path / "run.key"
    assert cli_main(["keygen", str(path)]) == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    keys = load_key_file(path)
    assert zmq.curve_public(keys.secret) == keys.public
    capsys.readouterr()
    assert cli_main(["keygen", str(path)]) == 2
    assert "exists" in capsys.readouterr().err
    assert load_key_file(path) == keys  # not overwritten
    # zmq.auth's own certificates are the same format
    _, secret_file = create_certificates(str(tmp_path), "zmqcert")
    assert load_key_file(secret_file).public == load_certificate(secret_file)[0]


@pytest.mark.parametrize("content,message", [
    (None, "No such file"),
    ("curve\n    public-key = \"abc\"\n", "no secret-key"),
    ("hello\n", "no public-key and no secret-key"),
    ("curve\n    public-key = \"{other}\"\n    secret-key = \"{secret}\"\n", "does not belong"),
    ("curve\n    public-key = \"{public}\"\n    secret-key = \"short\"\n", "40 Z85 characters"),
    (b"\xff\xfe binary", "non-ASCII"),
])
def test_an_unreadable_or_ill_formed_key_file_is_one_line_and_exit_2(
        tmp_path: Path, capsys, content: str | bytes | None, message: str) -> None:
    path = tmp_path / "bad.key"
    keys, other = CurveKeys.generate(), CurveKeys.generate()
    if isinstance(content, str):
        path.write_text(content.format(public=keys.public.decode(), secret=keys.secret.decode(),
                                       other=other.public.decode()))
    elif content is not None:
        path.write_bytes(content)
    run_dir = tmp_path / "run"
    code = cli_main(["launch", "--key-file", str(path), "--nproc", "2", "--run-dir", str(run_dir),
                     str(WORKERS / "hop_worker.py")])
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hopnet launch: error: --key-file") and message in lines[0]
    assert not run_dir.exists()


def test_insecure_with_secure_is_refused_before_anything_starts(tmp_path: Path, capsys) -> None:
    code = cli_main(["launch", "--insecure", "--secure", "--run-dir", str(tmp_path / "run"),
                     str(WORKERS / "hop_worker.py")])
    assert code == 2 and "--insecure cannot be combined" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ sockets, one process
SOCKET_WAIT_S = 20.0
"""How long a one-process test waits for what its sockets bring about."""


def test_a_rogue_gets_no_update_into_a_worker_and_is_counted_as_dropped() -> None:
    """Rogues frame their updates exactly as rank 1 would; only the key holder gets in."""

    async def control() -> None:
        """Against a plain transport the same rogue frames get in: they are valid updates."""
        plain, inbox = ZmqTransport(0, frozenset({1})), _Inbox()
        address = await plain.start(inbox)
        ctx = zmq.Context()
        rogue = _rogue_dealer(ctx, address, as_rank=1, keys=None)
        try:
            rogue.send_multipart(_update_frames(1, 0, 1e6))
            await wait_until_async(lambda: inbox.messages, SOCKET_WAIT_S, interval=0.02,
                                   what="the rogue's update on a plain transport")
            assert inbox.messages[0].tensors[0].tolist() == [1e6] * 4
        finally:
            rogue.close(0)
            ctx.term()
            await plain.close()

    async def scenario() -> None:
        keys = CurveKeys.generate()
        worker, member = ZmqTransport(0, frozenset({1}), curve=keys), ZmqTransport(1, frozenset({0}), curve=keys)
        outsider = ZmqTransport(1, frozenset({0}), curve=CurveKeys.generate())  # another run's key
        inbox = _Inbox()
        address = await worker.start(inbox)
        await member.start(_Inbox())
        await outsider.start(_Inbox())
        ctx = zmq.Context()
        rogues = [_rogue_dealer(ctx, address, as_rank=1, keys=None),
                  _rogue_dealer(ctx, address, as_rank=1, keys=CurveKeys.generate(), server_key=keys.public)]
        try:
            for sock in rogues:
                sock.send_multipart(_update_frames(1, 0, 1e6))
            await outsider.connect({0: address})
            await outsider.send(Message("update", 1, 0, 0, tensors=[torch.full((4,), 1e6, dtype=torch.float64)]))
            # each of the three attackers fails its handshake at least once
            await wait_until_async(lambda: worker.stats.dropped["unauthenticated"] >= 3, SOCKET_WAIT_S, interval=0.02,
                                   what="three refused handshakes")
            await member.connect({0: address})
            await member.send(Message("update", 1, 0, 0, tensors=[torch.full((4,), 2.0, dtype=torch.float64)]))
            await wait_until_async(lambda: inbox.messages, SOCKET_WAIT_S, interval=0.02,
                                   what="the member's update")
            await asyncio.sleep(0.3)  # anything a rogue got in would have arrived by now
            assert len(inbox.messages) == 1
            assert inbox.messages[0].tensors[0].tolist() == [2.0] * 4
            assert worker.stats.received_messages == 1
            assert set(worker.stats.dropped) == {"unauthenticated"}
        finally:
            for sock in rogues:
                sock.close(0)
            ctx.term()
            for t in (worker, member, outsider):
                await t.close()

    asyncio.run(control())
    asyncio.run(scenario())


def test_the_rendezvous_answers_only_holders_of_the_run_key() -> None:
    keys = CurveKeys.generate()
    with RendezvousServer(1, curve=keys) as server:
        for rogue_keys in (None, CurveKeys.generate()):
            with pytest.raises(WaitTimeout, match="does not answer"):
                exchange_addresses(server.endpoint, 0, 1, "tcp://10.9.9.9:1", timeout_s=0.5, curve=rogue_keys)
        assert server.registered_ranks() == []
        wait_until(lambda: server.refused_handshakes >= 2, 10.0, interval=0.02, what="two refused handshakes")
        table = exchange_addresses(server.endpoint, 0, 1, "tcp://127.0.0.1:7", timeout_s=10.0, curve=keys)
        assert table == {0: "tcp://127.0.0.1:7"}


def test_the_one_line_helpers_secure_a_service_socket_only_when_there_is_a_key() -> None:
    """What the coordinator service calls: a REQ with the key is answered, one without is not."""
    keys = CurveKeys.generate()
    ctx = zmq.Context()
    service = ctx.socket(zmq.ROUTER)
    assert secure_server(ctx.socket(zmq.ROUTER), None) is None  # plain run: nothing to do
    watch = secure_server(service, keys)
    port = service.bind_to_random_port("tcp://127.0.0.1")
    clients = []
    try:
        for client_keys in (keys, None):
            req = ctx.socket(zmq.REQ)
            req.setsockopt(zmq.LINGER, 0)
            secure_client(req, client_keys)
            req.connect(f"tcp://127.0.0.1:{port}")
            req.send(b"ping")
            clients.append(req)
        assert service.poll(5000, zmq.POLLIN)
        identity, empty, body = service.recv_multipart()
        service.send_multipart([identity, empty, b"pong"])
        assert clients[0].poll(5000, zmq.POLLIN) and clients[0].recv() == b"pong"
        wait_until(lambda: watch.poll() != 0 or watch.refused != 0, 10.0, interval=0.02,
                   what="the watch to see an event")
        assert watch.refused >= 1
        assert service.poll(300, zmq.POLLIN) == 0  # the keyless request never arrived
    finally:
        for sock in clients:
            sock.close(0)
        watch.close()
        ctx.destroy(0)


def test_the_coordinator_answers_only_holders_of_the_run_key() -> None:
    """The coordinator service with the run key: a worker's link with the key gets its pong,
    a rogue DEALER presenting a worker's routing id gets nothing, and the summary counts it."""
    import threading

    from hopnet import Graph, ProtocolConfig
    from hopnet.coordinator import make_coordinator
    from hopnet.coordinator import wire as coordinator_wire
    from hopnet.coordinator.client import COORDINATOR_ENV, client_from_environ
    from hopnet.coordinator.server import CoordinatorServer

    keys = CurveKeys.generate()
    machine = make_coordinator(ProtocolConfig(protocol="prague", group_generator="random"), Graph.ring(2))
    server = CoordinatorServer(machine, curve=keys)
    serving = threading.Thread(target=server.run, daemon=True)
    serving.start()
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.setsockopt(zmq.ROUTING_ID, coordinator_wire.routing_id(1))
    refused = rogue.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
    try:
        rogue.connect(server.address)
        rogue.send(coordinator_wire.encode({"t": "ping"}))
        assert refused.poll(20_000, zmq.POLLIN), "the rogue's handshake never failed"  # then the server saw it too

        async def member() -> dict:
            client = client_from_environ(0, 5.0, {COORDINATOR_ENV: server.address, KEY_ENV: keys.to_text()})
            assert client is not None and client.link.curve == keys
            got: asyncio.Queue = asyncio.Queue()
            client.link.start(got.put_nowait)
            try:
                client.link.send({"t": "ping"})
                return await asyncio.wait_for(got.get(), 20.0)
            finally:
                client.link.close()

        assert asyncio.run(member())["t"] == "pong"
        assert rogue.poll(500, zmq.POLLIN) == 0
    finally:
        server.stop()
        serving.join(20.0)
        rogue.disable_monitor()
        refused.close(0)
        rogue.close(0)
        ctx.term()
    assert not serving.is_alive()
    # Not asserted >= 1: the rogue tries once, and when it hangs up first the server sees a
    # plain disconnect, not a refused handshake (HandshakeWatch: the count is a lower bound).
    assert isinstance(server.summary()["refused_handshakes"], int)
    assert server.host.joined == {0}  # the rogue never counted as a worker


# --------------------------------------------------------------------- real processes
@pytest.mark.slow
def test_a_secured_launch_keeps_rogues_out_and_shows_them_in_the_stop_record(tmp_path: Path) -> None:
    """`hopnet launch --secure` on loopback: rogues that frame valid updates (of huge values)
    are refused, the refusals reach rank 0's ``stop`` record, and the run averages as if
    they were not there. (That such frames do get into a plain transport is shown above.)"""
    run_dir = tmp_path / "run"
    proc = start_launch(["--secure", "--bulk", "zmq", "--graph", "ring:2", "--run-dir", str(run_dir), "--no-progress",
                         SECURE_WORKER], new_session=True)
    ctx = zmq.Context()
    rogues: list[zmq.Socket] = []
    try:
        wait_until(lambda: all((run_dir / f"address_rank{r}.txt").exists() for r in (0, 1)), 120.0,
                   what="the workers to publish their addresses", while_running=proc)
        launch_info = json.loads((run_dir / "launch.json").read_text())
        assert launch_info["security"] == "curve"
        assert KEY_ENV not in json.dumps(launch_info)
        address = (run_dir / "address_rank0.txt").read_text()
        rogues = [_rogue_dealer(ctx, address, as_rank=1, keys=None),
                  _rogue_dealer(ctx, address, as_rank=1, keys=CurveKeys.generate())]
        for sock in rogues:
            for i in range(3):
                sock.send_multipart(_update_frames(1, 0, 1e6 + i))
        # the rendezvous (a thread of the launcher) answers no request without the key
        req = ctx.socket(zmq.REQ)
        rogues.append(req)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(launch_info["rendezvous"])
        req.send(b'{"status": true}')
        assert req.poll(1500, zmq.POLLIN) == 0
        (run_dir / "go").touch()
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
    finally:
        for sock in rogues:
            sock.close(0)
        ctx.term()
        kill(proc)
    # (the rendezvous's count of refused handshakes is checked where it can be waited for:
    # test_the_rendezvous_answers_only_holders_of_the_run_key; here it raced the run's end)
    stop = records(run_dir, 0, "stop")[-1]
    assert stop["dropped"].get("unauthenticated", 0) >= 2
    initial = torch.stack([torch.load(run_dir / f"initial_rank{r}.pt") for r in (0, 1)])
    final = torch.stack([torch.load(run_dir / f"final_rank{r}.pt") for r in (0, 1)])
    assert (final - initial.mean(dim=0)).abs().max() < 1e-6  # no rogue value was averaged in

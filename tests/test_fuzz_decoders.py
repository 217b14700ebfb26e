"""Every decoder of what arrives off the network survives 100,000 fuzzed frames.

Hypothesis draws well-formed messages and a seed; each example expands, with a seeded
``random.Random``, into :data:`PER_EXAMPLE` mutants (fields replaced by values of the
wrong type or out of range, bytes flipped, cut or inserted, tensor frames dropped, added
or resized), so many frames are decoded for the price of a few hundred examples:
:data:`TOTAL` (100,000) whole messages through a worker's real receive path (the
network surface every peer reaches), and :data:`SIDE_TOTAL` each through the decoders
behind it (the torch plane's bulk entry, coordinator messages through the coordinator
host and Prague's Group Generator, rendezvous requests).
Each decoder either returns a value that obeys its contract or raises its own error
type; nothing malformed reaches the code behind it.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from typing import Any

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hopnet import Graph, ProtocolConfig
from hopnet.coordinator import make_coordinator
from hopnet.coordinator import wire as coordinator_wire
from hopnet.coordinator.host import CoordinatorHost
from hopnet.rendezvous.client import _unpack_reply
from hopnet.rendezvous.server import RendezvousServer
from hopnet.rendezvous.wire import RendezvousError
from hopnet.transports.torchdist import decode_bulk
from hopnet.transports.zmq import ZmqTransport, zmq_endpoint
from hopnet.wire import (
    DTYPES,
    MAX_TENSOR_BYTES,
    DecodeError,
    Header,
    Message,
    decode_header,
    encode_header,
    known_kinds,
)

from support.wait import wait_until_async

EXAMPLES = 100
PER_EXAMPLE = 1000
TOTAL = EXAMPLES * PER_EXAMPLE
SIDE_EXAMPLES = 50
SIDE_PER_EXAMPLE = 500
SIDE_TOTAL = SIDE_EXAMPLES * SIDE_PER_EXAMPLE
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))
SIDE_FUZZ = settings(FUZZ, max_examples=SIDE_EXAMPLES)
DECODE_REASONS = {"bad_header", "unknown_kind", "bad_dtype", "bad_shape"}

# values of every msgpack type, including the edges of the integer range
ODD_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 0.5, float("nan"), float("inf"),
    "", "x", "update", "float32", "\u00e9\u0000", b"", b"\xff" * 3, [], [1], [[1, 2]], ["float32", [2]],
    [["float32", [-1]]], [["float32", [2**63]]], [["float32", [2**46, 2**46, 0]]], [["nope", [1]]],
    [["float32", [True]]], [["float32", [1.0]]], [["float32", [1] * 9]], [["float32", [2]]] * 65,
    {}, {"a": 1}, {"": None}, {"t": ["x"]}, {"b": "gloo", "x": [["float32", [3]]]},
]
HEADER_KEYS = ["k", "s", "d", "i", "t", "m", "x"]


def _odd(rng: random.Random, depth: int = 0) -> Any:
    """A value of an arbitrary msgpack type: one of the edge cases, or a nested container."""
    roll = rng.random()
    if depth < 3 and roll < 0.15:
        return [_odd(rng, depth + 1) for _ in range(rng.randrange(4))]
    if depth < 3 and roll < 0.25:
        return {rng.choice(["k", "s", "x", "t", "m", "b", "rank", "address"]): _odd(rng, depth + 1)
                for _ in range(rng.randrange(4))}
    if roll < 0.35:
        return rng.randrange(-(2**63), 2**64)
    return rng.choice(ODD_VALUES)


def _mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(6)
        if op == 0 and buf:  # flip a bit
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1 and buf:  # cut
            del buf[rng.randrange(len(buf)):]
        elif op == 2:  # insert random bytes
            i = rng.randrange(len(buf) + 1)
            buf[i:i] = rng.randbytes(rng.randrange(1, 9))
        elif op == 3 and buf:  # overwrite with a msgpack type byte (huge lengths, the never-used 0xc1)
            buf[rng.randrange(len(buf))] = rng.choice([0xc1, 0xdd, 0xdf, 0xdb, 0xc6, 0xcf, 0xd3, 0x90, 0x80, 0xff])
        elif op == 4:  # a header that claims 2**32-1 elements
            buf[0:0] = rng.choice([b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff"])
        else:  # duplicate a slice
            if buf:
                i = rng.randrange(len(buf))
                buf[i:i] = buf[i:i + rng.randrange(1, 16)]
    return bytes(buf)


# --------------------------------------------------------------------------- messages
DTYPE_NAMES = sorted(DTYPES)
shapes = st.lists(st.integers(0, 5), max_size=3)
tensors = st.lists(st.tuples(st.sampled_from(DTYPE_NAMES), shapes), max_size=3)
messages = st.fixed_dictionaries({
    "kind": st.sampled_from(sorted(known_kinds())),
    "src": st.sampled_from([1, 2, 3, 7]),
    "dst": st.sampled_from([0, 0, 0, 4]),
    "iter": st.integers(-2, 2**40),
    "tag": st.one_of(st.none(), st.text(max_size=8), st.integers(0, 100)),
    "meta": st.one_of(st.none(), st.dictionaries(st.sampled_from(["f", "c", "w"]), st.integers(-5, 5), max_size=2)),
    "tensors": tensors,
})


def _message_frames(m: dict[str, Any]) -> tuple[dict[str, Any], list[bytes]]:
    """The header as a dict and the tensor frames of a well-formed message."""
    ts = [torch.zeros(shape, dtype=DTYPES[name]) for name, shape in m["tensors"]]
    for t in ts:
        t.view(-1).view(torch.uint8).random_(0, 256)
    msg = Message(m["kind"], m["src"], m["dst"], m["iter"], m["tag"], m["meta"], ts)
    head = msgpack.unpackb(encode_header(msg), raw=False)
    return head, [t.view(-1).view(torch.uint8).numpy().tobytes() for t in ts]


def _mutant(rng: random.Random, head: dict[str, Any], frames: list[bytes]) -> list[bytes]:
    """One multipart message: [header, frames...], mutated (or, one time in ten, intact)."""
    head = dict(head)
    frames = list(frames)
    roll = rng.random()
    if roll < 0.1:
        pass
    elif roll < 0.45:  # structure: a field of the wrong type, missing, or an extra one
        for _ in range(rng.randrange(1, 3)):
            key = rng.choice(HEADER_KEYS + ["zz"])
            if rng.random() < 0.2:
                head.pop(key, None)
            else:
                head[key] = _odd(rng)
    elif roll < 0.55:  # a spec that differs from the frames sent
        head["x"] = [[rng.choice(DTYPE_NAMES), [rng.randrange(0, 4) for _ in range(rng.randrange(3))]]
                     for _ in range(rng.randrange(3))]
    elif roll < 0.75:  # the frames: dropped, added, resized
        op = rng.randrange(3)
        if op == 0 and frames:
            del frames[rng.randrange(len(frames))]
        elif op == 1:
            frames.insert(rng.randrange(len(frames) + 1), rng.randbytes(rng.randrange(0, 40)))
        elif frames:
            i = rng.randrange(len(frames))
            frames[i] = frames[i] + b"\x00" if rng.random() < 0.5 else frames[i][:-1]
    try:
        header = msgpack.packb(head, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        header = b"\x80"
    if roll >= 0.75:
        header = _mutate_bytes(rng, header)
    return [header, *frames]


# ------------------------------------------------------------------- wire headers
def _check_header(h: Header) -> None:
    assert h.kind in known_kinds()
    assert 0 <= h.src < 2**31 and 0 <= h.dst < 2**31 and -(2**63) <= h.iter < 2**63
    assert h.tag is None or isinstance(h.tag, (str, int))
    assert h.meta is None or isinstance(h.meta, dict)
    for spec in h.specs:
        assert spec.nbytes <= MAX_TENSOR_BYTES
        torch.empty(spec.shape, dtype=spec.dtype, device="meta")  # torch accepts the shape


class _Inbox:
    def __init__(self) -> None:
        self.messages: list[Message] = []

    def buffers_for(self, header: Header) -> None:
        return None

    def deliver(self, msg: Message) -> None:
        self.messages.append(msg)


class _Fuzzed:
    """A started ZmqTransport (rank 0, neighbours 1 and 2, a run of 4) and a DEALER posing as rank 1."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.inbox = _Inbox()
        self.transport = ZmqTransport(0, frozenset({1, 2}))
        self.transport.admit_run(4)
        address = self.loop.run_until_complete(self.transport.start(self.inbox))
        self.ctx = zmq.Context()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.ROUTING_ID, b"1")
        self.dealer.setsockopt(zmq.SNDHWM, 0)
        self.dealer.connect(zmq_endpoint(address))
        self.sent = 0

    def accounted(self) -> int:
        stats = self.transport.stats
        return stats.received_messages + stats.dropped_total

    def push(self, batch: list[list[bytes]]) -> None:
        for parts in batch:
            self.dealer.send_multipart(parts)
        self.sent += len(batch)

        self.loop.run_until_complete(wait_until_async(
            lambda: self.accounted() >= self.sent, 60.0, interval=0.002,
            what=lambda: f"the transport to account for {self.sent} fuzzed messages (it did for {self.accounted()})"))

    def close(self) -> None:
        self.dealer.close(0)
        self.ctx.term()
        self.loop.run_until_complete(self.transport.close())
        self.loop.close()


def test_the_transport_survives_100k_fuzzed_messages_and_delivers_only_well_formed_ones() -> None:
    """Real path: a DEALER sends each mutant to a started ZmqTransport; every message is
    either delivered intact or dropped with a reason, and the drops for undecodable headers
    are exactly the mutants that :func:`decode_header` rejects."""
    fuzz = _Fuzzed()
    expected_drops: Counter[str] = Counter()
    decodable: list[tuple[Header, list[bytes]]] = []
    try:
        @FUZZ
        @given(message=messages, seed=st.integers(0, 2**32 - 1))
        def run(message: dict[str, Any], seed: int) -> None:
            rng = random.Random(seed)
            head, frames = _message_frames(message)
            batch = [_mutant(rng, head, frames) for _ in range(PER_EXAMPLE)]
            for parts in batch:
                try:
                    header = decode_header(parts[0])
                except DecodeError as exc:
                    expected_drops[exc.reason] += 1
                    continue
                _check_header(header)
                decodable.append((header, parts[1:]))
            fuzz.push(batch)

        run()
        stats = fuzz.transport.stats
        assert fuzz.sent >= TOTAL
        assert stats.dropped["internal_error"] == 0  # nothing crashed inside the receive path
        assert {r: stats.dropped[r] for r in DECODE_REASONS if stats.dropped[r]} == dict(expected_drops)
        assert stats.received_messages == len(fuzz.inbox.messages)
        assert 0 < len(fuzz.inbox.messages) < len(decodable) < fuzz.sent  # some of each kind of outcome
        # every delivery is one of the decodable mutants, intact, in the order sent
        pending = iter(decodable)
        for msg in fuzz.inbox.messages:
            for header, frames in pending:
                if _fields(header) == _fields(msg) and _same_payload(msg, frames):
                    break
            else:
                raise AssertionError(f"delivered a message that was not sent intact: {msg.kind} from {msg.src}")
            assert msg.dst == 0 and (msg.src in (1, 2) or msg.kind == "bye")
    finally:
        fuzz.close()


def _fields(m: Header | Message) -> bytes:
    """What a delivery must keep of its header, as bytes (a NaN in meta equals itself here)."""
    return msgpack.packb([m.kind, m.src, m.dst, m.iter, m.tag, m.meta], use_bin_type=True)


def _same_payload(msg: Message, frames: list[bytes]) -> bool:
    data = b"".join(frames)
    got = b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in msg.tensors)
    return got == data


def test_bulk_headers_survive_fuzzed_values() -> None:
    """The torch plane's ``meta["_bulk"]`` entry: a (backend, specs) pair torch accepts, or None."""
    count = 0

    @SIDE_FUZZ
    @given(message=messages, seed=st.integers(0, 2**32 - 1))
    def run(message: dict[str, Any], seed: int) -> None:
        nonlocal count
        rng = random.Random(seed)
        specs = [[name, list(shape)] for name, shape in message["tensors"]] or [["float32", [1]]]
        for _ in range(SIDE_PER_EXAMPLE):
            value: Any = {"b": rng.choice(["gloo", "nccl", "mpi", _odd(rng)]), "x": [list(s) for s in specs]}
            roll = rng.random()
            if roll < 0.4:
                value[rng.choice(["b", "x"])] = _odd(rng)
            elif roll < 0.8 and value["x"]:
                entry = value["x"][rng.randrange(len(value["x"]))]
                entry[rng.randrange(2)] = _odd(rng)
            elif roll < 0.9:
                value = _odd(rng)
            decoded = decode_bulk(value)
            count += 1
            if decoded is not None:
                backend, got = decoded
                assert backend in ("gloo", "nccl") and got
                for spec in got:
                    assert spec.nbytes <= MAX_TENSOR_BYTES
                    torch.empty(spec.shape, dtype=spec.dtype, device="meta")

    run()
    assert count >= SIDE_TOTAL


# -------------------------------------------------------------------- coordinator messages
controls = st.fixed_dictionaries({
    "t": st.sampled_from(["req", "ack", "ready", "hello", "ping", "beat", "bye"]),
    "iter": st.integers(0, 1000),
    "gid": st.integers(0, 1000),
})


def _prague_host() -> CoordinatorHost:
    machine = make_coordinator(ProtocolConfig(protocol="prague", group_generator="random"), Graph.ring(4))
    assert machine is not None
    return CoordinatorHost(machine, now=0.0, peer_timeout_s=None)


def test_coordinator_messages_survive_fuzzed_frames() -> None:
    """The coordinator's decoder returns a map of plain values or raises BadFrame; what it
    returns goes through the coordinator host and Prague's random Group Generator, which
    drop what they cannot act on (counted) and never raise."""
    count = rejected = 0

    @SIDE_FUZZ
    @given(message=controls, seed=st.integers(0, 2**32 - 1))
    def run(message: dict[str, Any], seed: int) -> None:
        nonlocal count, rejected
        rng = random.Random(seed)
        host = _prague_host()
        for step in range(SIDE_PER_EXAMPLE):
            mutated = dict(message)
            if rng.random() < 0.7:
                mutated[rng.choice(list(mutated) + ["members", "failed", "zz"])] = _odd(rng)
            try:
                data = coordinator_wire.encode(mutated)
            except (OverflowError, ValueError, TypeError):
                data = b"\x81"
            if rng.random() < 0.4:
                data = _mutate_bytes(rng, data)
            count += 1
            try:
                decoded = coordinator_wire.decode(data)
            except coordinator_wire.BadFrame:
                rejected += 1
                continue
            assert isinstance(decoded, dict) and isinstance(decoded["t"], str) and decoded["t"]
            sends = host.handle(rng.randrange(4), decoded, float(step))  # raises nothing
            assert all(0 <= send.to < 4 and isinstance(send.message.get("t"), str) for send in sends)
            for send in sends:
                coordinator_wire.decode(coordinator_wire.encode(send.message))  # what it sends is well-formed

    run()
    assert count >= SIDE_TOTAL and 0 < rejected < count


# -------------------------------------------------------------------------- rendezvous
class _RecordingSocket:
    """Stands in for the rendezvous ROUTER: records the replies."""

    def __init__(self) -> None:
        self.replies: list[list[bytes]] = []

    def send_multipart(self, frames: list[bytes]) -> None:
        self.replies.append(frames)


requests = st.one_of(
    st.fixed_dictionaries({"rank": st.integers(0, 3), "world_size": st.just(3),
                           "address": st.sampled_from(["tcp://127.0.0.1:5000", "ipc:///tmp/x"]),
                           "config": st.one_of(st.none(), st.just({"protocol": "hop"}))}),
    st.fixed_dictionaries({"rank": st.integers(0, 3), "barrier": st.sampled_from(["done", "start"])}),
    st.just({"status": True}),
)


def _state(server: RendezvousServer) -> tuple[Any, ...]:
    status = server.status()
    return server.addresses, status["barriers"], server.config


def test_rendezvous_requests_survive_fuzzed_frames() -> None:
    """Every request gets a well-formed reply or waits for the others; one that is not a
    map, or not msgpack/JSON at all, is refused and changes nothing."""
    count = 0

    @SIDE_FUZZ
    @given(request=requests, seed=st.integers(0, 2**32 - 1))
    def run(request: dict[str, Any], seed: int) -> None:
        nonlocal count
        rng = random.Random(seed)
        server = RendezvousServer(3)
        sock = _RecordingSocket()
        for _ in range(SIDE_PER_EXAMPLE):
            mutated = dict(request)
            if rng.random() < 0.6:
                mutated[rng.choice(list(mutated) + ["address", "barrier", "status", "config"])] = _odd(rng)
            as_json = rng.random() < 0.2
            try:
                payload = (json.dumps(mutated).encode() if as_json else msgpack.packb(mutated, use_bin_type=True))
            except (OverflowError, ValueError, TypeError):
                payload = b"{"
            if rng.random() < 0.4:
                payload = _mutate_bytes(rng, payload)
            is_map = _is_map(payload)
            before, replies = (None if is_map else _state(server)), len(sock.replies)
            server._handle(sock, [b"peer", b"", payload])  # the serving thread's own entry point
            count += 1
            if not is_map:
                assert len(sock.replies) == replies + 1 and _state(server) == before
            for frames in sock.replies[replies:]:
                assert frames[0] == b"peer" or len(frames) == 3
                reply = _decode_reply(frames[-1])
                assert len(set(reply) & {"error", "addresses", "barrier", "status"}) == 1
        addresses = server.addresses
        assert set(addresses) <= {0, 1, 2} and all(isinstance(a, str) and a for a in addresses.values())
        assert all(isinstance(name, str) and name for name in server.status()["barriers"])

    run()
    assert count >= SIDE_TOTAL


def _is_map(payload: bytes) -> bool:
    try:
        value = json.loads(payload) if payload[:1] == b"{" else msgpack.unpackb(payload, raw=False,
                                                                               strict_map_key=False)
    except Exception:  # noqa: BLE001 - whatever the parsers raise, it is not a request
        return False
    return isinstance(value, dict)


def _decode_reply(data: bytes) -> dict[str, Any]:
    reply = json.loads(data) if data[:1] == b"{" else msgpack.unpackb(data, raw=False, strict_map_key=False)
    assert isinstance(reply, dict)
    return reply


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x91\x01", b"{", b'{"error": "no"}', b"\xdd\xff\xff\xff\xff",
                                  msgpack.packb({"addresses": 5})])
def test_a_malformed_rendezvous_reply_is_a_rendezvous_error_or_a_map(data: bytes) -> None:
    try:
        reply = _unpack_reply(data, "tcp://127.0.0.1:1")
    except RendezvousError:
        return
    assert isinstance(reply, dict)

"""Two ZmqTransport links carrying large tensors, for tests/test_large_transfer_cut.py: run one end
in each emulated host.

    big_transfer.py receive HOST PORT_CURVE PORT_STREAM      # ranks 1 and 3; prints their addresses
    big_transfer.py send ADDRESS_1 ADDRESS_3 NUMEL SEND_TIMEOUT_S   # ranks 0 and 2

Link 0 -> 1 is ZeroMQ with CURVE keys (``HOPNET_CURVE_KEY``): the tensor goes as ZeroMQ frames. Link
2 -> 3 is plain, so the tensor goes over the payload stream. Commands come one a line on stdin:
``send ITER`` (the sender sends one float32 tensor of NUMEL elements, ``arange(NUMEL) + ITER``, on
both links at once, and prints each send's seconds and drops), ``token ITER`` (a control message on
each link), ``stats`` (both ends print their transports' counters). The receiver prints one JSON line
per delivered message: its rank, kind, iter, and whether its tensor is bit-exact. Each receiver
receives into one preallocated slot, filled with -1 before each message, as Hop's update pool would.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import torch

from hopnet.security import keys_from_environ
from hopnet.transports.zmq import ZmqTransport
from hopnet.wire import Header, Message


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def expected(numel: int, it: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) + it


class SlotReceiver:
    """Receives into one slot; checks every delivered tensor against what the sender sent."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.slot: torch.Tensor | None = None

    def buffers_for(self, header: Header) -> list[torch.Tensor] | None:
        (spec,) = header.specs
        if self.slot is None or self.slot.numel() != spec.numel:
            self.slot = torch.empty(spec.shape, dtype=spec.dtype)
        self.slot.fill_(-1.0)
        return [self.slot]

    def hold(self, header: Header) -> bool:
        return False

    def deliver(self, msg: Message) -> None:
        exact = None
        if msg.tensors:
            got = msg.tensors[0]
            exact = bool(torch.equal(got.view(torch.int32), expected(got.numel(), msg.iter).view(torch.int32)))
        say(rank=self.rank, kind=msg.kind, iter=msg.iter, exact=exact, at=time.monotonic())

    def peer_lost(self, failure: Any) -> None:
        pass


async def lines() -> Any:
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        yield line.split()


async def receive(host: str, port_curve: int, port_stream: int) -> None:
    links = [ZmqTransport(1, frozenset({0}), bind=f"tcp://{host}:{port_curve}", curve=keys_from_environ()),
             ZmqTransport(3, frozenset({2}), bind=f"tcp://{host}:{port_stream}")]
    addresses = [await t.start(SlotReceiver(t.rank)) for t in links]
    say(addresses=addresses)
    async for words in lines():
        if words == ["stats"]:
            say(stats={t.rank: t.stats.as_dict() for t in links})
    for t in links:
        await t.close()


async def send(address_1: str, address_3: str, numel: int, send_timeout: float) -> None:
    links = [ZmqTransport(0, frozenset({1}), curve=keys_from_environ(), send_timeout=send_timeout),
             ZmqTransport(2, frozenset({3}), send_timeout=send_timeout)]
    for t, (dst, address) in zip(links, ((1, address_1), (3, address_3))):
        await t.start(SlotReceiver(t.rank))
        await t.connect({dst: address})

    async def timed(t: ZmqTransport, msg: Message) -> dict[str, Any]:
        start = time.monotonic()
        await t.send(msg)
        return {"rank": t.rank, "seconds": round(time.monotonic() - start, 3), "dropped": dict(t.stats.dropped),
                "streamed": t.streamed_messages}

    async for words in lines():
        if words[0] == "send":
            it = int(words[1])
            say(started=time.monotonic())
            tensor = expected(numel, it)
            say(sent=await asyncio.gather(*(timed(t, Message("update", t.rank, t.rank + 1, it, tensors=[tensor]))
                                            for t in links)))
        elif words[0] == "token":
            for t in links:
                await t.send(Message("token", t.rank, t.rank + 1, int(words[1])))
            say(tokens=int(words[1]))
        elif words == ["stats"]:
            say(stats={t.rank: t.stats.as_dict() for t in links})
    for t in links:
        await t.close()


def main() -> None:
    role, *args = sys.argv[1:]
    if role == "receive":
        asyncio.run(receive(args[0], int(args[1]), int(args[2])))
    else:
        asyncio.run(send(args[0], args[1], int(args[2]), float(args[3])))


if __name__ == "__main__":
    main()

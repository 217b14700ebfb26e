"""The fault-injecting transport itself (tests/support/faults.py), on the in-process network."""

from __future__ import annotations

import asyncio

import torch

from hopnet.transports.inproc import InprocNetwork
from hopnet.wire import Message

from support.faults import FaultyTransport
from support.transport_checks import Recorder


async def _pair() -> tuple[list[FaultyTransport], list[Recorder]]:
    network = InprocNetwork()
    transports = [FaultyTransport(network.transport(r, frozenset({1 - r}))) for r in (0, 1)]
    receivers = [Recorder(), Recorder()]
    for t, r in zip(transports, receivers):
        await t.start(r)
    return transports, receivers


async def test_a_drop_rule_takes_only_what_it_names_until_healed() -> None:
    (a, b), (_, rb) = await _pair()
    rule = a.drop(kinds={"update"}, direction="out")
    await a.send(Message("update", 0, 1, 0, tensors=[torch.ones(3)]))
    await a.send(Message("token", 0, 1, 1))
    assert (await rb.get()).iter == 1
    a.heal(rule)
    await a.send(Message("update", 0, 1, 2, tensors=[torch.ones(3)]))
    assert (await rb.get()).iter == 2
    assert a.injected == {("drop", "update"): 1}
    await rb.nothing_more()


async def test_inbound_drops_discard_tensors_before_the_receiver_reserves_buffers() -> None:
    (a, b), (_, rb) = await _pair()
    b.drop(peers={0}, direction="in")
    await a.send(Message("update", 0, 1, 0, tensors=[torch.ones(3)]))
    await a.send(Message("token", 0, 1, 1))
    await rb.nothing_more()
    assert rb.asked == []  # the receiver was never asked for buffers
    assert b.injected == {("drop", "update"): 1, ("drop", "token"): 1}
    assert b.stats.dropped["discarded"] == 1  # the transport read the tensors' bytes and dropped them


async def test_a_silenced_rank_neither_sends_nor_hears() -> None:
    (a, b), (ra, rb) = await _pair()
    a.silence()
    await a.send(Message("beat", 0, 1, 0))
    await b.send(Message("beat", 1, 0, 0))
    await rb.nothing_more()
    await ra.nothing_more()
    assert a.injected == {("drop", "beat"): 2}


async def test_delayed_messages_arrive_late_and_keep_their_order() -> None:
    (a, _), (_, rb) = await _pair()
    loop = asyncio.get_running_loop()
    a.delay(0.2, kinds={"update"})
    sent = loop.time()
    tensor = torch.ones(3)
    first = asyncio.create_task(a.send(Message("update", 0, 1, 0, tensors=[tensor])))
    await asyncio.sleep(0)
    tensor.zero_()  # a held message keeps its own copy once send has taken it
    await asyncio.gather(first, a.send(Message("token", 0, 1, 1)))
    got = [await rb.get(), await rb.get()]
    assert [m.iter for m in got] == [0, 1]  # the token waited behind the held update
    assert loop.time() - sent >= 0.2
    assert torch.equal(got[0].tensors[0], torch.ones(3))

"""What every protocol offers its Node, and what it may ask of it.

A protocol is pure algorithm: it reacts to messages the Node hands it and sends
through the Node. It never sees a socket, so the same object runs over ZeroMQ, over
the in-process transport, and inside the virtual-time simulator.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from hopnet.collectives.ring import RingCollective
from hopnet.config import ProtocolConfig
from hopnet.errors import ConfigError, PeerFailure
from hopnet.model_state import ModelState
from hopnet.registry import lookup, specs
from hopnet.runtime.services import AllReduce, ApplyFn, NodeServices, ReduceOp, Stateful
from hopnet.wire import BYE_FINAL_ITER, Header, Message


class Protocol(abc.ABC):
    """A training protocol bound to one worker: implements
    :class:`hopnet.runtime.services.TrainingProtocol`, uses its node only through
    :class:`hopnet.runtime.services.NodeServices`."""

    name: str = "protocol"
    node: NodeServices
    config: ProtocolConfig

    def __init__(self) -> None:
        self.iteration = 0
        self.model: ModelState | None = None  # set by make_protocol: the tensors holding the model
        self.final_iteration: int | None = None  # set by the trainer when it knows where it stops
        # What the simulator sums over its workers; protocols that skip or drop updates count them.
        self.skip_log: list[dict[str, Any]] = []
        self.late_updates_dropped = 0
        self.updates_not_sent = 0

    def bind(self, node: NodeServices) -> None:
        """Called once by the Node before :meth:`start`; set up per-rank state here."""
        self.node = node

    def make_collective(self, node: NodeServices) -> AllReduce:
        """The node's collective when the assembly chose none: the ring over the node's messages."""
        return RingCollective(node)

    def start_record(self) -> dict[str, Any]:
        """Fields for the node's ``start`` record: the options this protocol runs with."""
        return {"config": json.loads(self.config.to_json())}

    def model_tensors(self) -> list[torch.Tensor]:
        """The flat tensors holding this worker's model: its trainable parameters and floating
        buffers, one tensor per dtype (see :class:`hopnet.model_state.ModelState`); empty when the
        worker has no model (the simulator's gradient protocols)."""
        return list(self.model.flats) if self.model is not None else []

    def resume_at(self, iteration: int) -> None:
        """Start at ``iteration`` instead of 0 (every rank resuming from a checkpoint of
        ``iteration - 1``, with empty queues): called before :meth:`start`, only for the
        protocols whose declaration says ``resumable``."""
        if not lookup(self.config.protocol).resumable:
            takers = ", ".join(spec.name for spec in specs() if spec.resumable)
            raise ConfigError(f"--protocol {self.name} cannot resume from a checkpoint yet ({takers} can)")
        self.iteration = iteration

    async def after_resume(self) -> None:
        """Every rank loaded its checkpoint (after :meth:`resume_at` and :meth:`start`), before its
        trainer computes anything: what the protocol must do with the others first. Called on every
        rank of a resumed run (a collective here is met by all of them)."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Enter iteration 0 (grant what must be granted). Nothing read from the model may be sent
        here: the trainer may still load weights into it (see :meth:`begin`)."""

    async def begin(self) -> None:
        """Send what iteration 0 needs from the model. The node calls it once, when the trainer starts
        its loop (``Worker.iterations``) or at its first step, whichever comes first: weights loaded
        between ``hopnet.init`` and then are what the protocol sends."""

    @abc.abstractmethod
    async def finish_iteration(self, apply: ApplyFn | None, *, last: bool = False) -> None:
        """Finish the current iteration: exchange, mix, call ``apply`` (the optimizer step)
        where the protocol says, and unless ``last``, enter the next iteration."""

    async def synchronize(self) -> None:
        """Average the current iteration's gradient now, into the ``.grad`` the optimizer reads,
        ahead of :meth:`finish_iteration` (which then does not average it again): what a trainer
        calls to clip or unscale the averaged gradient. Nothing to do for a protocol that averages
        models: its gradient stays local."""

    def defer_gradient_sync(self, deferred: bool) -> None:
        """``no_sync()``, called on the trainer's thread: while ``deferred``, backward passes only
        accumulate into ``.grad``; a protocol that reduces during the backward pass starts no
        reduction in them (the step, or the next backward pass outside, reduces the sum). Nothing
        to do for a protocol that reduces at its step only."""

    def gradient_of(self, iteration: int) -> int:
        """The iteration whose gradient the step finishing ``iteration`` applies: the same one,
        except under a pipeline (pipe-sgd applies ``K-1`` iterations late)."""
        return iteration

    async def quiesce(self) -> None:
        """Training is over (the trainer's last step returned) and the consensus begins: finish
        or answer the exchanges still in flight, and start none from here on, so that no peer
        waits on this worker for one. The node then tells the neighbours ``done``
        (:meth:`on_peer_done` on their side) and stays open until it closes.

        By default there is nothing to do: the protocol's last step left nothing in flight."""

    def on_peer_done(self, peer: int) -> None:
        """Neighbour ``peer`` finished training and quiesced: it starts no exchange any more
        (it still answers collectives and says ``bye`` when it closes)."""

    async def stop(self) -> None:
        """Leave: tell the peers this worker sends nothing after its current iteration
        (:meth:`say_goodbye` to the peers that wait on it)."""

    async def say_goodbye(self, peers: Iterable[int], *, final_iteration: bool = True) -> None:
        """Send ``bye`` for the current iteration to each of ``peers``, connecting to those not
        yet connected, and wait until the goodbyes have left. ``final_iteration``: carry the
        planned last iteration (``BYE_FINAL_ITER``) when the trainer set one."""
        node = self.node
        final = self.final_iteration if final_iteration else None
        meta = {BYE_FINAL_ITER: final} if final is not None else None
        for peer in list(peers):  # who is told is decided now, not between the sends
            await node.connect_to([peer])
            node.post(Message("bye", node.rank, peer, self.iteration, meta=meta))
        await node.flush()

    @abc.abstractmethod
    def buffers_for(self, header: Header) -> Any:
        """See :meth:`hopnet.transports.base.Receiver.buffers_for`."""

    def hold(self, header: Header) -> bool:
        """See :meth:`hopnet.transports.base.Receiver.hold`: by default every message is read as it comes."""
        return False

    @abc.abstractmethod
    def on_message(self, msg: Message) -> None:
        """A validated message from a neighbour, on the event loop."""

    def on_peer_departed(self, peer: int, last_iteration: int) -> None:
        """``peer`` will send nothing for iterations after ``last_iteration``."""

    def on_peer_rejoined(self, peer: int) -> None:
        """A new process took over ``peer``'s rank (``--max-restarts``; it was handled as dead
        before): take it back. Only protocols whose declaration says ``restartable`` are called."""

    def handover_state(self) -> dict[str, Any]:
        """What a replacement needs of this protocol's state besides the model and the iteration,
        taken at a step boundary (plain values: it travels in a message's metadata)."""
        return {}

    def rejoin_at(self, iteration: int, state: Mapping[str, Any]) -> None:
        """This process replaces a dead worker: start at ``iteration`` with a neighbour's model and
        the neighbour's :meth:`handover_state` (called before :meth:`start`)."""
        if not lookup(self.config.protocol).restartable:
            raise ConfigError(f"--protocol {self.name} cannot replace a dead worker yet")
        self.iteration = iteration

    async def after_rejoin(self) -> None:
        """This replacement loaded its neighbour's state (after :meth:`rejoin_at`), before its trainer
        computes anything: what the protocol must do with the others first."""

    def on_peer_dead(self, peer: int) -> None:
        """``peer`` went silent and was declared dead: it will send nothing more.

        By default a departure after the previous iteration; a protocol that knows what it
        last received from the peer says so instead."""
        self.on_peer_departed(peer, self.iteration - 1)

    def view_change_iteration(self, candidate: int) -> int:
        """The first iteration at or after ``candidate`` where an elastic run's next view may begin:
        every worker then starts it as a run resumed there would (:meth:`resume_at`). Any iteration,
        unless the protocol has rounds longer than one step."""
        return candidate

    def checkpoint_state(self) -> Stateful | None:
        """The protocol's own state to save in checkpoints beside the model and to load on resume
        (``state_dict``/``load_state_dict``), or None: it has none a resume needs."""
        return None

    def snapshot(self) -> dict[str, Any]:
        """Small state summary for each iteration's record (queue depth, tokens...)."""
        return {}

    def summary(self) -> dict[str, Any]:
        """End-of-run counters for the ``stop`` record (high-water marks, skips...)."""
        return {}


T = TypeVar("T")


class ModelSnapshot:
    """A copy of a model's flat tensors, to put back when a group a dead member was in broke half-way
    (``--max-restarts``); the copies are allocated once and reused."""

    def __init__(self) -> None:
        self._copies: list[torch.Tensor] | None = None

    def take(self, tensors: Sequence[torch.Tensor]) -> None:
        if self._copies is None:
            self._copies = [torch.empty_like(t) for t in tensors]
        for copy, tensor in zip(self._copies, tensors):
            copy.copy_(tensor)

    def restore(self, tensors: Sequence[torch.Tensor]) -> None:
        assert self._copies is not None, "restore() before take()"
        for copy, tensor in zip(self._copies, tensors):
            tensor.copy_(copy)


async def reduce_or_roll_back(node: NodeServices, snapshot: ModelSnapshot, tensors: Sequence[torch.Tensor],
                              reduce: Awaitable[T]) -> T | PeerFailure:
    """Run a group's ``reduce`` of ``tensors`` and return its result; when another member died in it
    (a :class:`PeerFailure` naming a peer), put ``tensors`` back as they were and return that failure
    instead of raising it: under ``--max-restarts`` or ``--max-failures`` the group is lost, not the
    run. Without them nothing is copied (the copy would be a second model in memory)."""
    if node.survives_losses:
        snapshot.take(tensors)
    try:
        return await reduce
    except PeerFailure as exc:
        if not node.survives_losses or exc.peer is None or exc.peer == node.rank:
            raise
        snapshot.restore(tensors)
        return exc


async def allreduce_each(collective: AllReduce, group: Sequence[int], tensors: Sequence[torch.Tensor],
                         op: ReduceOp, *, tag: str) -> None:
    """All-reduce each of ``tensors`` (a model's flat tensors, one per dtype) in place, one after the
    other (a torch.distributed collective needs the same order of calls on every member): the first
    under ``tag``, the others under ``tag/i``."""
    for i, tensor in enumerate(tensors):
        await collective.allreduce(group, tensor, op, tag=tag if i == 0 else f"{tag}/{i}")

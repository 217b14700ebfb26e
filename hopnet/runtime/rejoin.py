"""A dead worker's replacement joining the running job, and the neighbour that hands it a model.

`hopnet launch --max-restarts K` starts a new process for a rank whose worker died. That
process (``HOPNET_RESTART=N``) does not start from its own initial weights:

1. it binds new sockets and takes the other ranks' addresses from the rendezvous;
2. it says ``rejoin`` (its restart number and new address) to the ranks it exchanges with;
   each of them handles the old process as dead if it had not noticed yet, then admits the
   new one: it connects to the new address and its protocol takes the rank back
   (:meth:`~hopnet.runtime.services.TrainingProtocol.on_peer_rejoined`);
3. it asks one neighbour for its state (``handover_req``); that neighbour answers at its next
   step boundary, where its model is consistent (:meth:`hopnet.api.Worker.step`), with one
   ``handover`` message: the iteration to start from, the protocol's own state there, and
   the model's ``state_dict`` and the trainer's registered state, serialized by
   :func:`torch.save` into one byte tensor. A neighbour that does not answer within the peer
   timeout (it died too, or never steps again) is passed over for the next.

The replacement then loads that state and enters the iteration the neighbour gave.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import torch

from hopnet.errors import HopnetError
from hopnet.wire import Message, register_kind

REJOIN = "rejoin"
"""Replacement -> the ranks it exchanges with: ``meta``: ``restart`` (N), ``address`` (its new one)."""
HANDOVER_REQUEST = "handover_req"
"""Replacement -> one neighbour: send me your state (``meta``: ``restart``)."""
HANDOVER = "handover"
"""Neighbour -> replacement: one uint8 tensor (the serialized state); ``meta``: ``iter`` to start
from, ``protocol`` (the protocol's own state), ``fingerprint`` of the model sent."""
REJOIN_KINDS = frozenset({REJOIN, HANDOVER_REQUEST, HANDOVER})
FINISHED = "finished"
"""In a handover's protocol state: the donor had finished training (the replacement starts after the
last iteration, and goes straight to the consensus)."""
BLOCKED = "blocked"
"""In a handover's protocol state: the donor answered while its protocol was blocked inside the
iteration (where its model is consistent, :meth:`hopnet.runtime.node.Node.handover_point`), not at
the step boundary before it: two handovers of one iteration are the same state only when both
say the same."""
RESTARTS_SEEN = "restarts_seen"
"""In a handover's protocol state: the donor's ``Node.restarts_seen``, so that the replacement counts
the same replacements (``Node.epoch``) as everyone else."""
GATHERS = "gathers"
"""In a handover's protocol state: the donor's ``Worker.gather_calls``, so that the replacement's next
:meth:`hopnet.Worker.gather` is the one the others make next (each is numbered by its call)."""
for _kind in REJOIN_KINDS:
    register_kind(_kind, any_rank=True)


@dataclass(frozen=True)
class Handover:
    """What a replacement received from its neighbour."""

    donor: int
    iteration: int
    protocol_state: dict[str, Any]
    state: dict[str, Any]
    """``{"model": state_dict, "states": {name: registered state}}``."""
    fingerprint: float


def fingerprint(tensors: list[torch.Tensor]) -> float:
    """A cheap checksum of a model's tensors: equal models give equal numbers (the event logs of
    a replacement and its neighbour show it took the neighbour's model, not its own)."""
    total = 0.0
    for tensor in tensors:
        if tensor.is_floating_point():
            total += float(tensor.detach().double().sum())
    return round(total, 9)


def pack(state: dict[str, Any]) -> torch.Tensor:
    """``state`` as one uint8 tensor (tensors inside it are copied into the bytes)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def unpack(data: torch.Tensor) -> dict[str, Any]:
    state = torch.load(io.BytesIO(data.numpy().tobytes()), map_location="cpu", weights_only=False)
    if not isinstance(state, dict):
        raise HopnetError("a handover did not hold a state dict")
    return state


def handover_message(src: int, dst: int, iteration: int, protocol_state: dict[str, Any],
                     state: dict[str, Any], model_fingerprint: float) -> Message:
    return Message(HANDOVER, src, dst, iteration, tensors=[pack(state)],
                   meta={"iter": iteration, "protocol": protocol_state, "fingerprint": model_fingerprint})


def read_handover(msg: Message) -> Handover:
    meta = msg.meta or {}
    iteration, protocol_state, print_ = meta.get("iter"), meta.get("protocol"), meta.get("fingerprint")
    if (not isinstance(iteration, int) or not isinstance(protocol_state, dict)
            or not isinstance(print_, (int, float)) or len(msg.tensors) != 1):
        raise HopnetError(f"a malformed handover from rank {msg.src}")
    return Handover(msg.src, iteration, dict(protocol_state), unpack(msg.tensors[0]), float(print_))


__all__ = ["BLOCKED", "FINISHED", "GATHERS", "HANDOVER", "HANDOVER_REQUEST", "REJOIN", "RESTARTS_SEEN", "REJOIN_KINDS", "Handover", "fingerprint", "handover_message",
           "read_handover"]

"""What the worker asks of its replica group, around each step (:class:`ReplicaSync`).

A worker without a group gets :data:`NO_REPLICA`, whose hooks do nothing. With one, the node
runs its lane on :attr:`ReplicaSync.lane_model` (and, under gradient protocols,
:attr:`ReplicaSync.lane_grads`): this process's shard. The hooks keep the shards and the
whole in step:

* :meth:`before_step`: the gradient is the replica's average (DDP or FSDP did it in the backward
  pass; a step after ``no_sync()`` does it now), the buffers are the first member's (DDP's rule),
  and the lane's tensors hold what the trainer's step changed;
* :meth:`wrap_apply`: the optimizer step (the protocol's apply) runs on the whole model with what
  the lanes mixed or averaged so far;
* :meth:`after_step`: what the lanes mixed after the apply reaches every member;
* :meth:`before_synchronize`/:meth:`after_synchronize`: the same around a gradient average the
  trainer asks for before clipping.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hopnet.coordinator.client import CoordinatorClient
from hopnet.errors import ConfigError
from hopnet.model_state import ModelState
from hopnet.replica.agreement import LaneAgreement
from hopnet.replica.relay import relayed_client


class ReplicaSync:
    """No replica group: every hook does nothing (each process is a replica of its own)."""

    size = 1
    member = 0
    replica_index: int | None = None
    mode = "none"
    lane_model: ModelState | None = None
    lane_grads: torch.Tensor | None = None
    lanes: LaneAgreement | None = None
    """How this member's lane agrees with the replica's other lanes (:mod:`hopnet.replica.agreement`)."""

    spent_s = 0.0
    """Seconds spent in the replica's own collectives since the last report."""
    _report: Callable[..., None] | None = None

    def attach(self, node: Any, report: Callable[..., None]) -> None:
        """``node`` (its ``start`` record names the replica) and the worker's ``report``: each iteration's
        record gets ``replica_s``, the time spent inside the replica (:meth:`report_time`)."""
        if self.replica_index is None:
            return
        node.start_fields.update(replica=self.replica_index, member=self.member, replica_size=self.size,
                                 replica_mode=self.mode)
        self._report = report

    def report_time(self) -> None:
        if self._report is not None:
            self._report(replica_s=round(self.spent_s, 6))
        self.spent_s = 0.0

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        began = time.monotonic()
        try:
            yield
        finally:
            self.spent_s += time.monotonic() - began

    def before_step(self) -> None:
        pass

    def wrap_apply(self, apply: Callable[[], None] | None) -> Callable[[], None] | None:
        return apply

    def after_step(self, *, mixed: bool = False) -> None:
        """``mixed``: the lanes changed the model outside the protocol's step (the consensus)."""

    def _lanes_mixed(self) -> bool:
        """Whether a lane said it changed its slice of the model since the last step (and forget it)."""
        if self.lanes is None or not self.lanes.models_mixed:
            return False
        self.lanes.models_mixed = False
        return True

    def before_synchronize(self) -> None:
        pass

    def after_synchronize(self) -> None:
        pass

    def refresh(self) -> None:
        """The lane's tensors from the model, before the protocol first sends them."""

    def deferring(self, deferred: bool) -> None:
        """Inside ``no_sync()``: backward passes only accumulate, inside the replica too."""

    def coordinator(self, client: CoordinatorClient | None) -> CoordinatorClient | None:
        """This member's client of the run's coordinator: the replica's member 0 speaks for it, and the
        others hear what it hears (:mod:`hopnet.replica.relay`)."""
        if self.lanes is None or self.replica_index is None:
            return client
        return relayed_client(client, self.lanes.group, self.member, self.size, self.replica_index)

    def agree(self, ok: bool) -> bool:
        """Whether every member says ``ok`` (a step skipped for a non-finite gradient is skipped by all)."""
        return ok

    def gradients(self) -> list[torch.Tensor] | None:
        """The gradient tensors the optimizer steps with, when not hopnet's flat ones."""
        return None

    def model_state(self, module: torch.nn.Module) -> dict[str, Any]:
        """What a checkpoint saves of the model: this process's part."""
        return dict(module.state_dict())

    def load_model_state(self, module: torch.nn.Module, state: dict[str, Any]) -> None:
        module.load_state_dict(state)

    def full_model_state(self, module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The whole model's state_dict, on the member that saves it (a collective over the replica
        under fsdp: every member calls it); ``None`` on the others."""
        return dict(module.state_dict()) if self.member == 0 else None  # (a ddp replica's members hold the same)

    def localized(self, state: Any) -> Any:
        """``state`` as a checkpoint holds it: what FSDP shards, this member's shard of it."""
        return state

    def restore_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """After a checkpoint's optimizer state was loaded: back into FSDP's sharded tensors."""

    def check_resharding(self, saved_size: int) -> None:
        """Refuse a checkpoint written by replicas of another size (resharding is not supported)."""
        if saved_size != self.size:
            raise ConfigError(f"the checkpoint was written by replica groups of {saved_size} process(es) and this "
                              f"run has {self.size}: resume with the same --replica-size (resharding a checkpoint "
                              "is not supported)")

    def close(self) -> None:
        pass


NO_REPLICA = ReplicaSync()

__all__ = ["NO_REPLICA", "ReplicaSync"]

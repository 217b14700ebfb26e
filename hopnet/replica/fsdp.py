"""``--replica-mode fsdp``: parameters, gradients and optimizer state sharded over the replica
with torch's FSDP2 (``fully_shard``), the protocol's state sharded with them.

:func:`shard_model` applies ``fully_shard`` to each module of at least :data:`UNIT_NUMEL`
trainable elements, then to the root (one all-gather per unit in the forward pass; the
optimizer, made after ``hopnet.init``, sees the sharded parameters). Each member's lane runs on
a flat tensor per dtype of its own (the shadow): ``[this member's shard of every trainable parameter | its
slice of the floating buffers]``. FSDP keeps its shards in storage of its own, so the shadow is
copied from them after every optimizer step and into them after every mix; both are 1/size
of the model. Buffers are not sharded by FSDP: as under ddp mode they live in flat tensors,
the first member's are broadcast before each step, and each member's lane mixes one slice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from hopnet.errors import ConfigError
from hopnet.model_state import ModelState
from hopnet.replica.base import ReplicaSync
from hopnet.replica.shards import bounds, share_slices


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


UNIT_NUMEL = 1 << 20
"""The least trainable elements an FSDP unit of its own holds (4 MB in fp32): smaller modules join
the unit of the module around them, up to the root."""


def shard_model(module: torch.nn.Module, group: Any, device: torch.device) -> None:
    """``fully_shard`` the model in units of at least :data:`UNIT_NUMEL` trainable elements, innermost
    first, then the root over what is left.

    Each unit costs an all-gather in the forward pass and a reduce-scatter in the backward, with
    FSDP's hooks around them; a unit per small layer made a small CNN's step 3 times as costly as
    under ddp mode. A unit per large module keeps the peak memory at a few units' size."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, device.type)

    def unsharded(owner: torch.nn.Module) -> int:
        """The trainable elements under ``owner`` that no unit holds yet; ``owner``'s children that
        reach :data:`UNIT_NUMEL` become units first."""
        pending = sum(p.numel() for p in owner.parameters(recurse=False) if p.requires_grad)
        for child in owner.children():
            below = unsharded(child)
            if below >= UNIT_NUMEL:
                fully_shard(child, mesh=mesh)
            else:
                pending += below
        return pending

    unsharded(module)
    fully_shard(module, mesh=mesh)


def _broadcast_module(module: torch.nn.Module, group: Any) -> None:
    first = dist.get_global_rank(group, 0)
    with torch.no_grad():
        works = [dist.broadcast(t.data, src=first, group=group, async_op=True)
                 for t in (*module.parameters(), *module.buffers()) if t.numel()]
    for work in works:
        work.wait()


class FsdpReplica(ReplicaSync):
    mode = "fsdp"

    def __init__(self, *, size: int, member: int, replica_index: int, group: Any, module: torch.nn.Module,
                 buffers: ModelState | None, averages_models: bool) -> None:
        self.size, self.member, self.replica_index = size, member, replica_index
        self.group = group
        self.module = module
        self.averages_models = averages_models
        self._first = dist.get_global_rank(group, 0)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.buffers = buffers
        dtypes: list[torch.dtype] = []
        for t in (*self.params, *(buffers.flats if buffers is not None else ())):
            if t.dtype not in dtypes:
                dtypes.append(t.dtype)
        device = self.params[0].device
        self._param_views: list[torch.Tensor] = []
        self._buffer_views: list[tuple[torch.Tensor, torch.Tensor]] = []  # (shadow part, buffer slice)
        flats, param_parts, buffer_parts = [], [], []
        for dtype in dtypes:
            mine = [p for p in self.params if p.dtype == dtype]
            n_params = sum(_local(p).numel() for p in mine)
            slices = []
            for flat in (buffers.flats if buffers is not None else ()):
                if flat.dtype == dtype:
                    start, stop = bounds(flat.numel(), size, member)
                    slices.append(flat[start:stop])
            shadow = torch.zeros(n_params + sum(s.numel() for s in slices), dtype=dtype, device=device)
            offset = 0
            for p in mine:
                n = _local(p).numel()
                self._param_views.append(shadow[offset:offset + n])
                offset += n
            for piece in slices:
                self._buffer_views.append((shadow[offset:offset + piece.numel()], piece))
                offset += piece.numel()
            flats.append(shadow)
            if n_params:
                param_parts.append(shadow[:n_params])
            if offset > n_params:
                buffer_parts.append(shadow[n_params:])
        self.lane_model = ModelState(flats, param_parts, buffer_parts)
        self.lane_grads = None
        if not averages_models:
            if len({p.dtype for p in self.params}) > 1:
                raise ConfigError("--replica-mode fsdp under a gradient protocol needs trainable parameters "
                                  "of one dtype")
            self.lane_grads = torch.zeros(sum(_local(p).numel() for p in self.params), dtype=self.params[0].dtype,
                                          device=device)
        self.refresh()

    # ------------------------------------------------------------------ shadow <-> shards
    def _pairs(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for p, view in zip(self.params, self._param_views):
            yield _local(p.detach()), view

    def refresh(self) -> None:
        with torch.no_grad():
            for local, view in self._pairs():
                view.copy_(local.reshape(-1))
            for view, piece in self._buffer_views:
                view.copy_(piece)

    def _to_shards(self) -> None:
        with torch.no_grad(), self.timed():
            for local, view in self._pairs():
                local.copy_(view.view_as(local))
            for view, piece in self._buffer_views:
                piece.copy_(view)
            if self.buffers is not None:
                share_slices(self.buffers.flats, self.size, self.member, self.group)

    def _lane_slices(self, lane_grads: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Each parameter with its slice of ``lane_grads`` (the lane's flat gradient holds the local
        shards of the gradients one after another)."""
        offset = 0
        for p in self.params:
            n = _local(p.detach()).numel()
            yield p, lane_grads[offset:offset + n]
            offset += n

    def _grads_to_lane(self) -> None:
        if self.lane_grads is None:
            return
        with torch.no_grad():
            for p, piece in self._lane_slices(self.lane_grads):
                if p.grad is None:
                    piece.zero_()
                else:
                    piece.copy_(_local(p.grad).reshape(-1))

    def _lane_to_grads(self) -> None:
        if self.lane_grads is None:
            return
        with torch.no_grad():
            for p, piece in self._lane_slices(self.lane_grads):
                if p.grad is not None:
                    grad = _local(p.grad)
                    grad.copy_(piece.view_as(grad))

    # ------------------------------------------------------------------ the step
    def before_step(self) -> None:
        self.report_time()
        if self.buffers is not None:
            with self.timed():
                works = [dist.broadcast(t, src=self._first, group=self.group, async_op=True)
                         for t in self.buffers.flats]
                for work in works:
                    work.wait()
        self.refresh()
        self._grads_to_lane()

    def before_synchronize(self) -> None:
        self._grads_to_lane()

    def after_synchronize(self) -> None:
        self._lane_to_grads()

    def wrap_apply(self, apply: Callable[[], None] | None) -> Callable[[], None] | None:
        if apply is None:
            return None

        def shards_then_apply() -> None:
            if self.averages_models:
                self._to_shards()
            else:
                self._lane_to_grads()
            apply()
            self.refresh()
        return shards_then_apply

    def after_step(self, *, mixed: bool = False) -> None:
        if self._lanes_mixed() or mixed or self.averages_models or self._buffer_views:
            self._to_shards()

    def deferring(self, deferred: bool) -> None:
        self.module.set_requires_gradient_sync(not deferred)  # type: ignore[operator]

    def agree(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.params[0].device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def gradients(self) -> list[torch.Tensor] | None:
        return [_local(p.grad) for p in self.params if p.grad is not None]

    def model_state(self, module: torch.nn.Module) -> dict[str, Any]:
        return {name: _local(t).detach().clone() for name, t in module.state_dict().items()}

    def load_model_state(self, module: torch.nn.Module, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for name, tensor in module.state_dict().items():
                _local(tensor).copy_(state[name])
        self.refresh()

    def localized(self, state: Any) -> Any:
        if isinstance(state, dict):
            return {key: self.localized(value) for key, value in state.items()}
        if isinstance(state, (list, tuple)):
            return type(state)(self.localized(value) for value in state)
        return _local(state).detach() if isinstance(state, torch.Tensor) else state

    def restore_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        from torch.distributed.tensor import DTensor

        for group in optimizer.param_groups:
            for param in group["params"]:
                if not isinstance(param, DTensor):
                    continue
                entries = optimizer.state.get(param, {})
                for key, value in list(entries.items()):
                    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
                            and value.shape == param.to_local().shape:
                        entries[key] = DTensor.from_local(value, param.device_mesh, param.placements,
                                                          run_check=False, shape=param.shape, stride=param.stride())

    def full_model_state(self, module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {name: t for name, t in full.items() if isinstance(t, torch.Tensor)} if self.member == 0 else None


__all__ = ["FsdpReplica", "shard_model"]

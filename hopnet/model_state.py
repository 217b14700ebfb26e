"""The model's state as hopnet moves it: one flat tensor per dtype, parameters and buffers.

:meth:`ModelState.of` moves every trainable parameter and every floating-point buffer
(BatchNorm's running statistics, any registered buffer) into one flat storage per dtype,
laid out as ``[that dtype's parameters | that dtype's floating buffers]``; each tensor
of the model becomes a view into it. So a model-averaging protocol mixes all of the
model with the same weights in one message or one all-reduce per dtype
(:attr:`ModelState.flats`), and a gradient protocol can keep the buffers alone in step
(:attr:`ModelState.buffers`). A model whose trainable parameters mix dtypes (fp32 with
bf16 parts) gets one flat per dtype.

Integer buffers (``num_batches_tracked``) stay where they are and are never
communicated: a count of this worker's own forward passes has no meaningful average,
and with BatchNorm's default momentum it is not read at all.

The views are what the protocols mix, so a tensor of the model that stops being its
view is no longer trained together: ``load_state_dict(..., assign=True)``, ``model.to()``
or ``model.half()`` after :func:`hopnet.init` replace tensors instead of writing into
them. :meth:`ModelState.check_bound` refuses that in one line naming the tensor (the
worker calls it at every step). ``load_state_dict`` without ``assign`` copies into the
views and is fine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hopnet.errors import ConfigError


@dataclass(frozen=True)
class _Bound:
    """A tensor of the model that must stay a view into the flat storage: ``owner[key]`` of a
    module (its ``_parameters`` or ``_buffers``), named ``name``, at ``ptr``."""

    owner: dict[str, torch.Tensor | None]
    key: str
    name: str
    ptr: int


class ModelState:
    """The flat tensors holding a model (see the module's docstring).

    ``flats``: one per dtype, that dtype's trainable parameters then its floating buffers; what
    model-averaging protocols send and mix. ``params``: the parameter part of each flat that has
    one; ``buffers``: the buffer part of each flat that has one (1-D contiguous views).
    ``local_buffers``: the names of the integer buffers, which stay local."""

    def __init__(self, flats: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                 buffers: Sequence[torch.Tensor], *, local_buffers: Sequence[str] = (),
                 bound: Sequence[_Bound] = ()) -> None:
        self.flats = list(flats)
        self.params = list(params)
        self.buffers = list(buffers)
        self.local_buffers = list(local_buffers)
        self._bound = tuple(bound)

    @classmethod
    def of_tensor(cls, params: torch.Tensor) -> ModelState:
        """A bare flat parameter tensor (``Worker(params=tensor)``, the simulator): no buffers."""
        return cls([params], [params], [])

    @classmethod
    def wrap(cls, params: ModelState | torch.Tensor | None) -> ModelState | None:
        """``params`` as a :class:`ModelState` (a bare tensor is wrapped; ``None`` stays ``None``)."""
        if params is None or isinstance(params, ModelState):
            return params
        return cls.of_tensor(params)

    @classmethod
    def of(cls, model: torch.nn.Module, *, buffers: bool = True, params: bool = True) -> ModelState:
        """Move ``model``'s trainable parameters and floating buffers into one flat storage per dtype.
        ``buffers=False`` leaves every buffer out (each worker keeps its own, as integer ones are);
        ``params=False`` the parameters (a model whose parameters FSDP holds: :mod:`hopnet.replica.fsdp`)."""
        with_buffers, with_params = buffers, params
        trainable: dict[int, torch.Tensor] = {}
        floating: dict[int, torch.Tensor] = {}
        owners: dict[int, list[tuple[dict[str, torch.Tensor | None], str, str]]] = {}
        local: list[str] = []
        for prefix, module in model.named_modules(remove_duplicate=False):
            for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
                for key, tensor in table.items():
                    if tensor is None:
                        continue
                    name = f"{prefix}.{key}" if prefix else key
                    if kind == "param":
                        if not tensor.requires_grad or not with_params:
                            continue  # frozen: the same on every rank, nothing to mix
                        trainable.setdefault(id(tensor), tensor)
                    elif with_buffers and tensor.is_floating_point():
                        floating.setdefault(id(tensor), tensor)
                    else:
                        if name not in local:
                            local.append(name)
                        continue
                    owners.setdefault(id(tensor), []).append((table, key, name))  # type: ignore[arg-type]
        if not trainable and with_params:
            raise ConfigError("the model has no trainable parameters")
        if not trainable and not floating:
            return cls([], [], [], local_buffers=local)
        devices = {t.device for t in (*trainable.values(), *floating.values())}
        if len(devices) > 1:
            raise ConfigError(f"hopnet needs all parameters and buffers on one device; found "
                              f"{sorted(map(str, devices))}")
        dtypes: list[torch.dtype] = []
        for t in (*trainable.values(), *floating.values()):
            if t.dtype not in dtypes:
                dtypes.append(t.dtype)
        device = next(iter(devices))
        flats: list[torch.Tensor] = []
        param_parts: list[torch.Tensor] = []
        buffer_parts: list[torch.Tensor] = []
        bound: list[_Bound] = []
        for dtype in dtypes:
            ps = [t for t in trainable.values() if t.dtype == dtype]
            bs = [t for t in floating.values() if t.dtype == dtype]
            n_params, n_buffers = sum(t.numel() for t in ps), sum(t.numel() for t in bs)
            flat = torch.empty(n_params + n_buffers, dtype=dtype, device=device)
            offset = 0
            with torch.no_grad():
                for t in (*ps, *bs):
                    view = flat[offset:offset + t.numel()].view_as(t)
                    view.copy_(t)
                    t.data = view  # the same tensor object, now a view: optimizers and modules keep it
                    offset += t.numel()
                    bound.extend(_Bound(owner, key, name, view.data_ptr()) for owner, key, name in owners[id(t)])
            flats.append(flat)
            if n_params:
                param_parts.append(flat[:n_params])
            if n_buffers:
                buffer_parts.append(flat[n_params:])
        return cls(flats, param_parts, buffer_parts, local_buffers=local, bound=bound)

    # ------------------------------------------------------------------ reading it
    @property
    def device(self) -> torch.device:
        return self.flats[0].device if self.flats else torch.device("cpu")

    @property
    def nbytes(self) -> int:
        """Bytes of every flat together: what one model update moves."""
        return sum(f.numel() * f.element_size() for f in self.flats)

    def check_bound(self) -> None:
        """Refuse a model whose tensors no longer view the flat storage, naming the first one."""
        for b in self._bound:
            tensor = b.owner.get(b.key)
            if tensor is None or tensor.data_ptr() != b.ptr:
                raise ConfigError(
                    f"the model's tensor {b.name!r} is no longer the one hopnet.init() placed in its flat buffer, "
                    "so the protocol would no longer send, mix or average it: after hopnet.init() load weights "
                    "with model.load_state_dict(state) (it copies in place; not assign=True), and do not move or "
                    "cast the model (.to(), .half()); do those before hopnet.init()")


__all__ = ["ModelState"]

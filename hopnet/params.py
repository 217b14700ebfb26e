"""One flat buffer for a model's parameters, and one for its gradients.

Every parameter of the module becomes a view into a single contiguous tensor, so a
model update is one message and one weighted sum, with no per-tensor loop. The
optimizer keeps working on the same ``Parameter`` objects; only their storage moves.
Gradients get the same treatment (:class:`FlatGradients`), so a gradient protocol
reduces one tensor. :func:`flatten_parameters` is the one-dtype form for a bare model;
``hopnet.init`` uses :class:`hopnet.model_state.ModelState`, which also holds the
floating buffers and takes several dtypes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hopnet.errors import ConfigError


def flatten_parameters(params: Iterable[torch.nn.Parameter] | torch.nn.Module) -> torch.Tensor:
    """Move the parameters into one flat buffer (views into it) and return the buffer.

    Parameters must share one dtype and device. Calling it again on parameters that
    already view one buffer returns that buffer without copying.
    """
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    plist = [p for p in params if p.requires_grad]
    if not plist:
        raise ConfigError("the model has no trainable parameters")
    dtypes = {p.dtype for p in plist}
    devices = {p.device for p in plist}
    if len(dtypes) > 1:
        raise ConfigError(f"hopnet needs one parameter dtype; the model mixes {sorted(map(str, dtypes))}")
    if len(devices) > 1:
        raise ConfigError(f"hopnet needs all parameters on one device; found {sorted(map(str, devices))}")
    existing = _shared_buffer(plist)
    if existing is not None:
        return existing
    total = sum(p.numel() for p in plist)
    flat = torch.empty(total, dtype=plist[0].dtype, device=plist[0].device)
    offset = 0
    with torch.no_grad():
        for p in plist:
            n = p.numel()
            view = flat[offset:offset + n].view_as(p)
            view.copy_(p)
            p.data = view
            offset += n
    return flat


def _shared_buffer(plist: list[torch.nn.Parameter]) -> torch.Tensor | None:
    base = plist[0].data
    storage = base.untyped_storage()
    offset = 0
    for p in plist:
        if p.untyped_storage().data_ptr() != storage.data_ptr() or p.storage_offset() != offset \
                or not p.is_contiguous():
            return None
        offset += p.numel()
    if storage.nbytes() != offset * base.element_size():
        return None
    return torch.empty(0, dtype=base.dtype, device=base.device).set_(storage, 0, (offset,), (1,))


class FlatGradients:
    """One flat buffer for the gradients, each parameter's ``.grad`` a view into it.

    ``loss.backward()`` accumulates into existing ``.grad`` tensors in place, so the views
    survive backward; zeroing in place (:meth:`zero`, or the optimizer's
    ``zero_grad(set_to_none=False)``) keeps them. A gradient protocol then reduces
    :attr:`buffer`, one tensor. If something replaced a ``.grad`` (``zero_grad()`` with
    ``set_to_none=True`` on the bare optimizer, say), :meth:`gather` copies it back in and
    restores the view.

    Trainable parameters of several dtypes (fp32 with bf16 parts) get one buffer per dtype
    (a ``.grad`` has its parameter's dtype). The protocols still reduce one tensor: then
    :attr:`packed` is true, :attr:`buffer` is a buffer of the widest dtype that
    :meth:`gather` fills from the per-dtype ones, and :meth:`unpack` writes the reduced
    values back into them.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter] | torch.nn.Module) -> None:
        if isinstance(params, torch.nn.Module):
            params = params.parameters()
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ConfigError("the model has no trainable parameters")
        dtypes: list[torch.dtype] = []
        for p in self.params:
            if p.dtype not in dtypes:
                dtypes.append(p.dtype)
        device = self.params[0].device
        # per dtype: its parameters' indices in self.params, and its buffer
        self._groups: list[tuple[list[int], torch.Tensor]] = []
        self.views: list[torch.Tensor] = [torch.empty(0)] * len(self.params)
        for dtype in dtypes:
            members = [i for i, p in enumerate(self.params) if p.dtype == dtype]
            buffer = torch.zeros(sum(self.params[i].numel() for i in members), dtype=dtype, device=device)
            offset = 0
            for i in members:
                p = self.params[i]
                view = buffer[offset:offset + p.numel()].view_as(p)
                if p.grad is not None:
                    view.copy_(p.grad)
                self.views[i] = view
                offset += p.numel()
            self._groups.append((members, buffer))
        self.packed = len(self._groups) > 1
        if self.packed:
            widest = dtypes[0]
            for dtype in dtypes[1:]:
                widest = torch.promote_types(widest, dtype)
            self.buffer = torch.zeros(sum(b.numel() for _, b in self._groups), dtype=widest, device=device)
        else:
            self.buffer = self._groups[0][1]
        self._attach()

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The per-dtype gradient buffers the ``.grad`` views live in (one unless :attr:`packed`)."""
        return [b for _, b in self._groups]

    def _attach(self) -> None:
        for p, view in zip(self.params, self.views):
            p.grad = view

    def rebind(self, buffer: torch.Tensor) -> None:
        """Make ``buffer`` (same size, dtype and device) the flat gradient buffer: every ``.grad``
        becomes a view into it. Pipe-SGD rotates its all-reduce buffers through here instead of
        copying the gradients out and the averaged ones back in. Not for :attr:`packed` gradients."""
        if self.packed:
            raise ConfigError("rebind needs gradients of one dtype; these are packed from several")
        if buffer.shape != self.buffer.shape or buffer.dtype != self.buffer.dtype \
                or buffer.device != self.buffer.device or not buffer.is_contiguous():
            raise ConfigError(f"rebind needs a contiguous {self.buffer.dtype} tensor of shape "
                              f"{tuple(self.buffer.shape)} on {self.buffer.device}")
        if buffer.data_ptr() == self.buffer.data_ptr():
            return
        self.buffer = buffer
        self._groups = [(self._groups[0][0], buffer)]
        views = []
        offset = 0
        for p in self.params:
            n = p.numel()
            views.append(buffer[offset:offset + n].view_as(p))
            offset += n
        self.views = views
        self._attach()

    def aliased(self) -> bool:
        """Whether every parameter's ``.grad`` is still its view into :attr:`buffer`."""
        return all(p.grad is not None and p.grad.data_ptr() == v.data_ptr()
                   for p, v in zip(self.params, self.views))

    def gather(self) -> torch.Tensor:
        """:attr:`buffer`, holding every current ``.grad`` (restoring views that were replaced)."""
        for p, view in zip(self.params, self.views):
            grad = p.grad
            if grad is None:
                view.zero_()
            elif grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
            else:
                continue
            p.grad = view
        if self.packed:
            offset = 0
            for _, part in self._groups:
                self.buffer[offset:offset + part.numel()].copy_(part)
                offset += part.numel()
        return self.buffer

    def unpack(self, reduced: torch.Tensor) -> None:
        """Make the ``.grad`` views hold ``reduced`` (a tensor shaped like :attr:`buffer`): a copy
        into the per-dtype buffers when :attr:`packed`, nothing when it is the buffer itself."""
        if not self.packed:
            if reduced.data_ptr() != self.buffer.data_ptr():
                self.buffer.copy_(reduced)
            return
        offset = 0
        for _, part in self._groups:
            part.copy_(reduced[offset:offset + part.numel()])
            offset += part.numel()

    def zero(self) -> None:
        """Zero every gradient in place, keeping (or restoring) the views."""
        for _, part in self._groups:
            part.zero_()
        if not self.aliased():
            self._attach()

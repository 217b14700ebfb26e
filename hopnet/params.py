"""One flat buffer for a model's parameters, and one for its gradients.

Every parameter of the module becomes a view into a single contiguous tensor, so a
model update is one message and one weighted sum, with no per-tensor loop. The
optimizer keeps working on the same ``Parameter`` objects; only their storage moves.
Gradients get the same treatment (:class:`FlatGradients`), so a gradient protocol
reduces one tensor.
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
    """

    def __init__(self, params: Iterable[torch.nn.Parameter] | torch.nn.Module) -> None:
        if isinstance(params, torch.nn.Module):
            params = params.parameters()
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ConfigError("the model has no trainable parameters")
        first = self.params[0]
        total = sum(p.numel() for p in self.params)
        self.buffer = torch.zeros(total, dtype=first.dtype, device=first.device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in self.params:
            n = p.numel()
            view = self.buffer[offset:offset + n].view_as(p)
            if p.grad is not None:
                view.copy_(p.grad)
            self.views.append(view)
            offset += n
        self._attach()

    def _attach(self) -> None:
        for p, view in zip(self.params, self.views):
            p.grad = view

    def rebind(self, buffer: torch.Tensor) -> None:
        """Make ``buffer`` (same size, dtype and device) the flat gradient buffer: every ``.grad``
        becomes a view into it. Pipe-SGD rotates its all-reduce buffers through here instead of
        copying the gradients out and the averaged ones back in."""
        if buffer.shape != self.buffer.shape or buffer.dtype != self.buffer.dtype \
                or buffer.device != self.buffer.device or not buffer.is_contiguous():
            raise ConfigError(f"rebind needs a contiguous {self.buffer.dtype} tensor of shape "
                              f"{tuple(self.buffer.shape)} on {self.buffer.device}")
        if buffer.data_ptr() == self.buffer.data_ptr():
            return
        self.buffer = buffer
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
        return self.buffer

    def zero(self) -> None:
        """Zero every gradient in place, keeping (or restoring) the views."""
        self.buffer.zero_()
        if not self.aliased():
            self._attach()

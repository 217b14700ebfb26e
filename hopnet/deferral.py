"""When a backward pass reduces the gradient: DDP's ``no_sync()`` rule, for :meth:`hopnet.api.Worker.no_sync`.

Under DDP the forward pass decides: a backward pass reduces nothing if its forward pass ran inside
``no_sync()``, wherever the backward pass itself runs. Scripts written for DDP (and frameworks'
accumulation) put either the forward pass alone or both inside the context, so here a backward
pass reduces nothing if its forward pass ran inside ``no_sync()`` *or* it runs inside it itself.
A forward pre-hook on every module that holds parameters (a trainer may call a submodule's
forward rather than the model's) notes, at each forward pass with gradients enabled, whether it
ran inside the context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


_GRAPH_TASK: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)
"""The backward pass this thread runs (-1: none): torch's own test, which its checkpointing uses
(looked up once: the hooks run at every module's forward pass)."""


class GradientSyncDeferral:
    """Tells ``defer`` (the protocol's and the replica's deferral) whether backward passes reduce."""

    def __init__(self, defer: Callable[[bool], None], module: torch.nn.Module | None) -> None:
        self._defer = defer
        self._inside = False  # in no_sync() now
        self._forward_inside = False  # the last forward pass with gradients ran in no_sync()
        self._deferred = False
        self._hooks = [] if module is None else [
            m.register_forward_pre_hook(self._on_forward) for m in module.modules()
            if any(True for _ in m.parameters(recurse=False))]

    def _set(self, deferred: bool) -> None:
        if deferred != self._deferred:
            self._deferred = deferred
            self._defer(deferred)

    def _on_forward(self, _module: torch.nn.Module, _inputs: Any) -> None:
        # (not a forward pass that activation checkpointing recomputes inside a backward pass)
        if torch.is_grad_enabled() and _GRAPH_TASK() == -1:
            self._forward_inside = self._inside
            self._set(self._inside)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._inside = True
        self._set(True)
        try:
            yield
        finally:
            self._inside = False
            self._set(self._forward_inside)

    def reducing_now(self) -> None:
        """A step or ``synchronize()`` reduces what has accumulated now, even after a forward pass in
        ``no_sync()`` (DDP's step does not look at the context either)."""
        self._forward_inside = False
        if not self._inside:
            self._set(False)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


__all__ = ["GradientSyncDeferral"]

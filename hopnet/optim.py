"""The optimizer a trainer steps: a torch optimizer whose ``step()`` runs the protocol.

:class:`DistributedOptimizer` is a :class:`torch.optim.Optimizer` that shares the wrapped
optimizer's ``param_groups``, ``state`` and ``defaults`` (the same objects), so what takes a
torch optimizer takes it: LR schedulers, ``torch.amp.GradScaler``, ``clip_grad_norm_``
workflows, ``state_dict()``/``load_state_dict()``. What it adds to the wrapped step:

* ``step()`` finishes the worker's iteration (exchange, mix, apply: where the protocol says);
  the wrapped step is its apply.
* :meth:`synchronize` averages the gradient before the step (Horovod's pattern), so that
  clipping or unscaling acts on the averaged gradient, as under DDP. ``step()`` never
  averages one gradient twice; :meth:`skip_synchronize` is there for Horovod's code.
* A step whose gradient (the averaged one, under a gradient protocol) holds inf or NaN is
  skipped, by every rank of the reduction alike, and recorded as ``non_finite_gradient``;
  the iteration still finishes. Under a model-averaging protocol a step that leaves the
  model non-finite raises :class:`hopnet.errors.NonFiniteError` before anything is sent.
* Under a pipeline (pipe-sgd) the step applies the gradient of ``K-1`` iterations ago with
  that iteration's hyperparameters (learning rate...), so a schedule is not shifted.

With ``torch.amp.GradScaler`` (``_step_supports_amp_scaling``): ``scaler.step(opt)`` always
calls :meth:`step`, which unscales gradients the scaler left scaled and decides the skip
itself, as above. The order that works under every protocol::

    scaler.scale(loss).backward()
    scaler.unscale_(opt)          # this rank's gradient, with this iteration's scale
    opt.synchronize()             # the averaged gradient in each .grad
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with opt.skip_synchronize():
        scaler.step(opt)          # skipped on every rank if the average is not finite
    scaler.update()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hopnet.api import Worker
from hopnet.checkpoint import OPTIMIZER_STATE
from hopnet.errors import HopnetError, NonFiniteError
from hopnet.finite import all_finite_in
from hopnet.params import FlatGradients
from hopnet.registry import Averages, lookup


Hyperparameters = list[dict[str, Any]]
"""Every param group's settings but its parameters (``lr``, ``momentum``...), in group order."""


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer: ``step()`` runs the protocol around the real step.

    With Hop's parallel approach the parameters are first mixed with the neighbours'
    and then the gradients (computed before the mix) are applied; with ``--serial``
    the gradients are applied first, then the result is sent and mixed.
    """

    _step_supports_amp_scaling = True
    """``GradScaler.step`` calls :meth:`step` even after an overflow: the skip is decided on the
    gradient the step applies (the averaged one), and the iteration finishes either way."""

    def __init__(self, optimizer: torch.optim.Optimizer, worker: Worker) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise HopnetError(f"DistributedOptimizer wraps a torch optimizer, not {type(optimizer).__name__}")
        # torch's own set-up (step hooks, profiling), on a placeholder group; then the wrapped
        # optimizer's groups, state and defaults become this one's.
        super().__init__([{"params": []}], dict(optimizer.defaults))
        self.optimizer = optimizer
        self.worker = worker
        self._share()
        self._models_averaged = lookup(worker.config.protocol).averages is Averages.MODELS
        self._synchronized_at: int | None = None
        self._skipping_synchronize = False
        self._settings: dict[int, Hyperparameters] = {}  # iteration -> its settings, kept for a pipeline
        self.skipped: list[int] = []
        """The iterations whose step was skipped because the gradient to apply was not finite."""
        worker.register_state(OPTIMIZER_STATE, self)  # saved in checkpoints, loaded on resume

    def _share(self) -> None:
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.defaults = self.optimizer.defaults

    # ------------------------------------------------------------------ the step
    def synchronize(self) -> None:
        """Average this iteration's gradient now, into each ``.grad`` (gradient protocols; under
        pipe-sgd, the averaged gradient the step will apply). Clip or unscale after it; the
        step that follows does not average again. Nothing to do under model averaging."""
        self.worker.synchronize()
        self._synchronized_at = self.worker.iteration

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """DDP's ``no_sync()`` (:meth:`hopnet.api.Worker.no_sync`): backward passes inside it only
        accumulate; the next one outside it, or the step, averages the accumulated gradient."""
        return self.worker.no_sync()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Horovod's guard around a ``step()`` that follows :meth:`synchronize`: a step inside it
        without a :meth:`synchronize` in the same iteration is refused (it would average a
        gradient the trainer meant to see averaged first)."""
        self._skipping_synchronize = True
        try:
            yield
        finally:
            self._skipping_synchronize = False

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        k = self.worker.iteration
        if self._skipping_synchronize and self._synchronized_at != k:
            raise HopnetError(f"rank {self.worker.rank}: step() inside skip_synchronize() but iteration {k}'s "
                              "gradient was never synchronized: call synchronize() first")
        self._unscale_for_a_scaler()
        source = self.worker.node.protocol.gradient_of(k)
        if source != k:
            self._settings[k] = _settings(self.param_groups)
        self.worker.step(lambda: self._apply(k, source))
        return loss

    def _unscale_for_a_scaler(self) -> None:
        """``GradScaler.step`` without a ``unscale_`` first leaves the gradients scaled and says by
        what in ``self.grad_scale``: unscale this rank's gradient now, before it is averaged
        with ranks whose scale may differ."""
        scale = getattr(self, "grad_scale", None)
        if scale is None:
            return
        inverse = scale.double().reciprocal().float() if isinstance(scale, torch.Tensor) else 1.0 / scale
        with torch.no_grad():
            for grad in self._gradients():
                grad.mul_(inverse)

    def _apply(self, k: int, source: int) -> None:
        """The protocol's apply: the wrapped step, unless the gradient to apply is not finite."""
        if not self.worker.replica.agree(all_finite_in(self._gradients())):  # a replica's members skip together
            self.skipped.append(k)
            self.worker.record("non_finite_gradient", iter=k, gradient_of=source,
                               averaged=not self._models_averaged)
            return
        if source == k:
            self.optimizer.step()
        else:
            self._step_with(self._settings.pop(source, None))
            for old in [i for i in self._settings if i < source]:
                del self._settings[old]
        if self._models_averaged and not self.worker.replica.agree(self._model_finite()):
            raise NonFiniteError(f"rank {self.worker.rank}: the optimizer step of iteration {k} left the model "
                                 "with inf or NaN; it is not sent to any neighbour", rank=self.worker.rank,
                                 iteration=k)

    def _step_with(self, settings: Hyperparameters | None) -> None:
        """The wrapped step with the settings of the iteration whose gradient it applies."""
        if settings is None:
            self.optimizer.step()
            return
        current = _settings(self.param_groups)
        _restore(self.param_groups, settings)
        try:
            self.optimizer.step()
        finally:
            _restore(self.param_groups, current)

    def _gradients(self) -> list[torch.Tensor]:
        sharded = self.worker.replica.gradients()  # fsdp: this member's shards of the gradient
        if sharded is not None:
            return sharded
        grads = self.worker.grads
        if isinstance(grads, FlatGradients):
            return grads.buffers  # one per dtype: written in place when unscaling
        return [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]

    def _model_finite(self) -> bool:
        model = self.worker.model
        if model is not None:
            return all_finite_in(model.flats)
        return all_finite_in(p.detach() for group in self.param_groups for p in group["params"])

    # ------------------------------------------------------------------ the rest of an optimizer
    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradients. When the worker holds them in one flat buffer (``hopnet.init(model)``)
        they are zeroed in place whatever ``set_to_none`` says, so every ``.grad`` stays a view
        into the buffer the gradient protocols reduce."""
        grads = self.worker.grads
        if isinstance(grads, FlatGradients):
            grads.zero()
        else:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not hasattr(self, "optimizer"):  # torch's set-up, before the wrapped optimizer is known
            super().add_param_group(param_group)
            return
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
        self.worker.replica.restore_optimizer(self.optimizer)  # fsdp: the shards back into DTensors
        self._share()  # torch's load_state_dict replaces the groups and the state

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"


def _settings(groups: list[dict[str, Any]]) -> Hyperparameters:
    return [{key: value.clone() if isinstance(value, torch.Tensor) else value
             for key, value in group.items() if key != "params"} for group in groups]


def _restore(groups: list[dict[str, Any]], settings: Hyperparameters) -> None:
    for group, saved in zip(groups, settings):
        for key, value in saved.items():
            current = group.get(key)
            if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
                current.copy_(value)  # a tensor lr (fused, capturable) is updated in place by schedulers
            else:
                group[key] = value

"""hopnet in an Accelerate script: :class:`Sync`, in the place of ``accelerate.LocalSGD``.

``LocalSGD`` averages the models every K steps over DDP's process group. :class:`Sync` runs any
hopnet protocol instead: the Accelerator sees one process (no DDP), the optimizer's step becomes
a hopnet iteration, and the context's exit leaves every worker with the consensus model::

    accelerator = Accelerator(mixed_precision="bf16")      # under `hopnet launch`: one process
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with Sync(accelerator, model, optimizer, steps=len(loader) // accelerator.gradient_accumulation_steps) as sync:
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)  # the averaged gradient (gradient protocols)
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()                           # one hopnet iteration (exchange, mix, apply)
                optimizer.zero_grad()
            if not sync.step():                            # after each batch, as LocalSGD's step()
                break
    # here every worker holds the mean of the live workers' models

Under torchrun, build the Accelerator inside :func:`single_process` so that it does not join
torchrun's process group and wrap the model in DDP.

With fp16's gradient scaler (``mixed_precision="fp16"`` on a GPU) the order is the bare API's
(:mod:`hopnet.optim`): ``accelerator.backward`` unscales this worker's gradient with its own
scale before the average, ``clip_grad_norm_`` does not unscale again, and a step whose averaged
gradient overflowed is skipped by every worker alike; Accelerate then reports it skipped
(``accelerator.optimizer_step_was_skipped``), so a prepared scheduler, and the Trainer's, do not
step, as under DDP.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import torch
from accelerate import Accelerator, DistributedType
from accelerate.optimizer import AcceleratedOptimizer, patch_optimizer_step

from hopnet.api import Worker, init
from hopnet.collectives.consensus import ConsensusResult
from hopnet.errors import ConfigError, HopnetError
from hopnet.optim import DistributedOptimizer

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                      "MV2_COMM_WORLD_SIZE")
"""What makes Accelerate (and so the Trainer) believe it runs distributed, and join a process group."""


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """Hide torchrun's (and MPI's) variables while an Accelerator or the Trainer's arguments are set up:
    they then see one process, and do not initialise a process group or wrap the model in DDP. On a
    GPU machine the device is ``cuda:{local rank}`` (``HOPNET_LOCAL_RANK``, else ``LOCAL_RANK``)."""
    local = os.environ.get("HOPNET_LOCAL_RANK") or os.environ.get("LOCAL_RANK") or "0"
    hidden = {name: os.environ.pop(name) for name in LAUNCHER_VARIABLES if name in os.environ}
    device = "ACCELERATE_TORCH_DEVICE"
    pinned = torch.cuda.is_available() and device not in os.environ
    if pinned:
        os.environ[device] = f"cuda:{local}"
        torch.cuda.set_device(int(local))
    try:
        yield
    finally:
        if pinned:
            os.environ.pop(device, None)
        os.environ.update(hidden)


class Sync:
    """Run ``model``'s training under the protocol ``hopnet launch`` (or torchrun) configured.

    ``optimizer`` is the one ``accelerator.prepare`` returned: its step becomes the worker's
    iteration (the wrapped optimizer becomes a :class:`~hopnet.optim.DistributedOptimizer`),
    and inside the context ``accelerator.backward`` leaves the averaged gradient in ``.grad``
    under the gradient protocols, so that ``accelerator.clip_grad_norm_`` clips what DDP
    clips; backward passes of accumulation steps only accumulate (DDP's ``no_sync``).
    ``steps``: the optimizer steps every worker runs (the protocol ends the run at the last
    one); ``worker``: a worker already started (else :func:`hopnet.init` starts one with
    ``options``). At the exit, :meth:`hopnet.api.Worker.consensus`: every live worker holds the
    mean model (:attr:`consensus`).
    """

    def __init__(self, accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 steps: int | None = None, worker: Worker | None = None, **options: Any) -> None:
        if accelerator.distributed_type != DistributedType.NO:
            raise ConfigError(f"Sync needs an Accelerator of one process (it has {accelerator.distributed_type}): "
                              "build it inside hopnet.integrations.accelerate.single_process()")
        if not isinstance(optimizer, AcceleratedOptimizer):
            raise ConfigError("Sync takes the optimizer accelerator.prepare() returned")
        if optimizer.scaler is not None and not hasattr(optimizer, "_optimizer_patched_step_method"):
            raise ConfigError("Sync with fp16's gradient scaler needs the AcceleratedOptimizer of Accelerate 1.x "
                              "(its patched step): use mixed_precision='bf16'")
        self.accelerator = accelerator
        self.prepared = optimizer
        self.inner = optimizer.optimizer
        self.worker = worker if worker is not None else init(accelerator.unwrap_model(model), **options)
        self.optimizer = DistributedOptimizer(self.inner, self.worker)
        self.steps = steps
        self.consensus: ConsensusResult | None = None
        self.finished: int | None = None
        """The iteration the last optimizer step finished (that a checkpoint saved now holds)."""
        self._loop: Iterator[int] | None = None
        self._current: int | None = None
        self._over = False

    def __enter__(self) -> Sync:
        self.prepared.optimizer = self.optimizer
        self.accelerator.backward = self._backward  # type: ignore[method-assign]
        if self.prepared.scaler is not None:
            # The scaler's step must call this step, and say it was skipped when every worker skipped it.
            self.prepared._optimizer_original_step_method = self.optimizer.step
            self.prepared._optimizer_patched_step_method = self._scaled_step  # set as the optimizer's step
            self.accelerator.unscale_gradients = self._unscaled_in_backward  # type: ignore[method-assign]
        if self.steps is not None:
            self._loop = self.worker.iterations(self.steps)
            self._advance()
        return self

    def _advance(self) -> None:
        assert self._loop is not None
        self._current = next(self._loop, None)
        self._over = self._current is None

    def _backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        backward = type(self.accelerator).backward
        if self.accelerator.sync_gradients:
            backward(self.accelerator, loss, **kwargs)
            if self.prepared.scaler is not None:  # this worker's gradient, with its own scale, before the average
                self.prepared.scaler.unscale_(self.optimizer)
            self.optimizer.synchronize()  # the step that follows does not average again
        else:
            with self.worker.no_sync():
                backward(self.accelerator, loss, **kwargs)

    def _unscaled_in_backward(self, optimizer: Any = None) -> None:
        """``accelerator.unscale_gradients`` (``clip_grad_norm_`` calls it): :meth:`_backward` did."""

    def _scaled_step(self, *args: Any, **kwargs: Any) -> Any:
        """The step the gradient scaler calls: Accelerate counts it as run unless this worker skipped it
        (every worker alike under a gradient protocol: the averaged gradient overflowed)."""
        skipped = len(self.optimizer.skipped)
        out = DistributedOptimizer.step(self.optimizer, *args, **kwargs)  # (its .step is this, meanwhile)
        self.prepared._accelerate_step_called = len(self.optimizer.skipped) == skipped
        return out

    def step(self) -> bool:
        """Call it after each batch, as ``LocalSGD.step()``: after an optimizer step it ends the
        iteration (its checkpoint, a replacement's handover) and enters the next. False once the
        run's iterations are over (``steps`` reached, or a skip ahead jumped to the end)."""
        if self._loop is not None and self.accelerator.sync_gradients and not self._over:
            self.finished = self._current
            self._advance()
        return not self._over

    @property
    def active(self) -> bool:
        """Inside the context: the optimizer's step is a hopnet iteration."""
        return self.prepared.optimizer is self.optimizer

    def close(self, consensus: bool = True) -> None:
        """Leave the context's hold on the accelerator and the optimizer; with ``consensus``, first
        make every live worker's model the mean of theirs."""
        if not self.active:
            return
        try:
            if consensus:
                if self._loop is not None and not self._over:
                    raise HopnetError(f"rank {self.worker.rank}: Sync left at iteration {self.worker.iteration}, "
                                      f"before its last ({self.steps}): every worker must run the same steps")
                self.consensus = self.worker.consensus()
        finally:
            self.prepared.optimizer = self.inner
            del self.accelerator.backward
            if self.prepared.scaler is not None:
                del self.accelerator.unscale_gradients
                self.prepared._optimizer_original_step_method = self.inner.step
                self.prepared._optimizer_patched_step_method = patch_optimizer_step(self.prepared, self.inner.step)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close(consensus=kind is None)


__all__ = ["LAUNCHER_VARIABLES", "Sync", "single_process"]

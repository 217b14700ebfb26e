"""The Lightning strategy, written once for both namespaces (``lightning.pytorch`` and
``pytorch_lightning``): :func:`strategy_class` builds it on the namespace it is given.

Each process is one hopnet worker, started by ``hopnet launch``, torchrun or srun: the strategy
spawns nothing and wraps the model in nothing. At its setup (the model on its device)
it calls :func:`hopnet.init` on the LightningModule and wraps the optimizer in
:class:`hopnet.DistributedOptimizer`. One optimizer step is one hopnet iteration, driven
through :meth:`hopnet.Worker.iterations`: it enters an iteration at the batch that starts it
(so a checkpoint or handover boundary comes after Lightning stepped its LR schedulers) and
stops the Trainer at the run's last iteration. A callback placed first averages the gradient
(``synchronize()``) before ``on_before_optimizer_step`` and gradient clipping, after a
GradScaler's ``unscale_``. The collectives (``reduce``, ``barrier``, ``broadcast``,
``all_gather``, ``reduce_boolean_decision``) run among the live workers through
:meth:`hopnet.Worker.gather`; before the setup they are local (no worker yet). Checkpoints:
every rank writes its own file (rank 0 at Lightning's path, rank R at ``PATH.rankR``) with
hopnet's state under ``"hopnet"``; ``fit(ckpt_path=...)`` resumes every rank from its own.
A replacement (``--max-restarts``) takes the Trainer's state in its handover (:class:`TrainerState`),
and Lightning restores it as from a checkpoint; so does a joiner of an elastic run, which enters
at the setup (:func:`hopnet.elastic.trainers.join_now`), and the train loader then takes an
elastic sampler in epochs of a fixed length (:func:`hopnet.elastic.trainers.fixed_epochs`).
The run's last iteration ends with :meth:`hopnet.Worker.consensus` (``on_train_end`` does, when
the loop stopped earlier). What it refuses, and why: docs/guides/lightning.md.
"""

from __future__ import annotations

import builtins
import importlib
import io
import os
import signal
from collections.abc import Callable, Generator, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_only

import hopnet
from hopnet.api import Worker
from hopnet.bootstrap.env import WorkerEnv
from hopnet.bootstrap.external import detect
from hopnet.checkpoint import OPTIMIZER_STATE
from hopnet.elastic.trainers import fixed_epochs, is_elastic, join_now
from hopnet.errors import ConfigError, HopnetError
from hopnet.optim import DistributedOptimizer

LOOP_STATE = "lightning"
"""The name under which the strategy registers the Trainer's own state with hopnet (:class:`TrainerState`)."""
DATA_STATE = "lightning"
"""The prefix of the training data's registered states in an elastic run (``lightning_sampler``, ``lightning_epochs``)."""
STATE_KEY = "hopnet"
"""Where a checkpoint holds hopnet's state (:meth:`hopnet.Worker.checkpoint_state`, pickled)."""
WAITS = ("compute_s", "wait_updates_s", "wait_tokens_s", "mix_s")
"""The step timings logged through Lightning's loggers, as ``hopnet/<name>``."""


def place(environ: Mapping[str, str]) -> tuple[int, int, int, int]:
    """(rank, world size, local rank, node rank) as the launcher set them, before hopnet.init."""
    launched = WorkerEnv.from_environ(environ)
    if launched is not None:
        return launched.rank, launched.world_size, launched.local_rank, launched.node_rank
    external = detect(environ)
    if external is not None:
        return external.rank, external.world_size, external.local_rank, external.node_rank
    return 0, 1, 0, 0


def pack(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)  # the run's own workers


def rank_path(path: str | os.PathLike[str], rank: int) -> str:
    """Each rank's checkpoint file: rank 0's is Lightning's own path."""
    return os.fspath(path) if rank == 0 else f"{os.fspath(path)}.rank{rank}"


def reduce_stacked(stacked: torch.Tensor, op: Any) -> torch.Tensor:
    name = str(getattr(op, "name", op) or "mean").lower().rsplit(".", 1)[-1]
    if name in ("mean", "avg"):  # as Lightning's DDP: the sum, divided by the workers
        return stacked.sum(dim=0) / stacked.shape[0]
    if name == "sum":
        return stacked.sum(dim=0)
    if name in ("max", "min"):
        return stacked.amax(dim=0) if name == "max" else stacked.amin(dim=0)
    raise ConfigError(f"HopnetStrategy.reduce: reduce_op {op!r} is not supported (sum, mean, max, min)")


def elastic_train_loader(worker: Worker, dataloader: Any, update: Callable[[Any, Any], Any]) -> Any:
    """An elastic run's training loader: ``dataloader`` (Lightning's, with its batch size) over the
    members' shares of the data (:func:`hopnet.elastic.trainers.fixed_epochs`), its epochs a fixed
    number of batches on every member. ``update(dataloader, sampler)`` rebuilds it (Lightning's own)."""
    if isinstance(getattr(dataloader, "dataset", None), torch.utils.data.IterableDataset):
        return dataloader  # (its division among the members is the script's)
    batch_size = getattr(dataloader, "batch_size", None)
    if not isinstance(batch_size, int):
        raise ConfigError("HopnetStrategy: an elastic run divides the training data itself; give the "
                          "train DataLoader a batch_size (not a batch_sampler)")
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))  # as Lightning seeds its DistributedSampler
    return update(dataloader, fixed_epochs(worker, dataloader.dataset, batch_size, seed=seed, name=DATA_STATE))


def refusal(worker: Worker) -> str | None:
    """Why this run cannot map Lightning's loop onto hopnet's iterations, in one line, or None."""
    if getattr(worker.config.options, "skip_threshold", None) is not None:
        return ("Hop's skipping (--skip-threshold) jumps iterations that Lightning's loop counts one by one: "
                "drop it under HopnetStrategy")
    if worker.checkpointer is not None:
        return "--checkpoint-every: Lightning saves the checkpoints (ModelCheckpoint, with hopnet's state inside)"
    if worker.replica.size > 1:
        return "replica groups (--replica-size) are not supported under HopnetStrategy"
    return None


class TrainerState:
    """The Trainer's training state, as ``fit(ckpt_path=...)`` restores it (its loops' progress,
    the callbacks', the LR schedulers', the precision plugin's), registered with hopnet so that a
    handover carries it to a replacement (``--max-restarts``); hopnet hands the model and the
    optimizer itself. The replacement's :meth:`load_state_dict` keeps it for the strategy, which
    gives it to Lightning's checkpoint connector once set up."""

    def __init__(self, trainer: Any, version: str) -> None:
        self.trainer, self.version = trainer, version
        self.handed: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        trainer = self.trainer  # (at a step boundary, or on the event loop with the trainer blocked in its step)
        state = {"pytorch-lightning_version": self.version, "loops": trainer._checkpoint_connector._get_loops_state_dict(),
                 "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks if cb.state_dict()},
                 "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs]}
        precision = trainer.precision_plugin.state_dict()
        if precision:
            state[type(trainer.precision_plugin).__qualname__] = precision
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # (A resync that moves a rank already training forward loads it too: its model and optimizer
        # follow, its loops keep their own count; the strategy stops it at hopnet's last iteration.)
        self.handed = dict(state)

    def restore(self, optimizers: list[torch.optim.Optimizer]) -> bool:
        """In a replacement: hand Lightning the state it restores after the strategy's setup (as from
        a checkpoint), the optimizers' as they stand (they took theirs as they registered)."""
        if self.handed is None:
            return False
        connector = self.trainer._checkpoint_connector
        connector._loaded_checkpoint = {**self.handed, "optimizer_states": [o.state_dict() for o in optimizers]}
        connector.restore_callbacks()  # (the others Lightning restores itself: precision, loops, schedulers)
        self.handed = None
        return True


def strategy_class(pl: ModuleType) -> type:
    """``HopnetStrategy`` for the Lightning namespace ``pl`` (``lightning.pytorch`` or ``pytorch_lightning``)."""
    parallel: Any = pl.strategies.ParallelStrategy
    update_dataloader = importlib.import_module(f"{pl.__name__}.utilities.data")._update_dataloader
    callback: Any = pl.Callback

    class Synchronize(callback):
        """First of the callbacks: the averaged gradient before anyone looks at it before the step."""

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if isinstance(optimizer, DistributedOptimizer):
                optimizer.synchronize()

    class HopnetStrategy(parallel):
        """Trains under hopnet: ``Trainer(strategy=HopnetStrategy(protocol="hop", max_ig=4))`` in a
        script started by ``hopnet launch`` (or torchrun, srun). ``protocol`` and ``options`` go to
        :func:`hopnet.init` (one that contradicts the launcher's command line is refused, as there)."""

        strategy_name = "hopnet"
        optimizers: list[torch.optim.Optimizer]  # Lightning's property, typed for mypy

        def __init__(self, protocol: str | None = None, **options: Any) -> None:
            super().__init__()
            self.options = dict(options) if protocol is None else {"protocol": protocol, **options}
            self.worker: Worker | None = None
            self._rank, self._world, self._local, self._node = place(os.environ)
            self._resume: dict[str, Any] | None = None
            self._iterations: Generator[int, None, None] | None = None
            self._current = -1
            self._total = 0
            self._due = True  # the next batch (or step) enters a new iteration
            self._done = False
            self._catching_up = False  # a replacement, before it enters its first iteration
            self._sigterm: Any = None

        # ---------------------------------------------------------------- who and where
        @property
        def global_rank(self) -> int:
            return self._rank

        @property
        def local_rank(self) -> int:
            return self._local

        @property
        def node_rank(self) -> int:
            return self._node

        @property
        def world_size(self) -> int:
            return self._world

        @property
        def is_distributed(self) -> bool:
            return True

        @property
        def distributed_sampler_kwargs(self) -> dict[str, Any]:
            if is_elastic(self.worker):  # the members change: each validates on the whole held-out set, and
                return {"num_replicas": 1, "rank": 0}  # the train loader takes an elastic sampler (process_dataloader)
            return {"num_replicas": self._world, "rank": self._rank}

        def process_dataloader(self, dataloader: Any) -> Any:
            trainer = self.lightning_module.trainer if self.model is not None else None
            if self.worker is None or not is_elastic(self.worker) or trainer is None or not trainer.training:
                return dataloader
            return elastic_train_loader(self.worker, dataloader, update_dataloader)

        @property
        def root_device(self) -> torch.device:
            devices = self.parallel_devices  # one device per worker: its local rank's GPU
            if not devices or devices[0].type == "cpu":
                return torch.device("cpu")
            return torch.device(devices[0].type, self._local)

        def set_world_ranks(self) -> None:
            rank_zero_only.rank = self._rank  # type: ignore[attr-defined]

        def model_to_device(self) -> None:
            assert self.model is not None
            self.model.to(self.root_device)

        # ---------------------------------------------------------------- the worker and its optimizer
        def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
            """The model is on its device and in its final dtype: it becomes a hopnet worker."""
            if self.worker is None:
                self.worker = hopnet.init(self.lightning_module, resume=self._resume, **self.options)
                why = refusal(self.worker)
                if why is not None:
                    raise ConfigError(f"HopnetStrategy: {why}")
            return model

        def setup(self, trainer: Any) -> None:
            super().setup(trainer)
            assert self.worker is not None
            # A joiner of an elastic run enters now, its optimizer set up and its loop not started: the
            # donor's state (the Trainer's with it) then comes as a replacement's handover does.
            join_now(self.worker)
            self._sigterm = signal.getsignal(signal.SIGTERM)  # an elastic worker's: a SIGTERM makes it leave
            loops = TrainerState(trainer, pl.__version__)
            self.worker.register_state(LOOP_STATE, loops)  # in a replacement: loads the handed state
            # A replacement goes on where its donor was (Lightning restores the loops next); the
            # collectives of a fit's start, which the others made long ago, stay local until it trains.
            self._catching_up = loops.restore(self.optimizers)

        def on_train_start(self) -> None:
            """In an elastic run a SIGTERM makes the worker leave at the next view change (hopnet's
            handler), not stop at the next batch (the one Lightning installed since)."""
            if is_elastic(self.worker) and callable(self._sigterm):
                signal.signal(signal.SIGTERM, self._sigterm)

        def setup_optimizers(self, trainer: Any) -> None:
            super().setup_optimizers(trainer)
            configured = list(self.optimizers)
            if len(configured) != 1:
                raise ConfigError(f"HopnetStrategy trains with one optimizer (one step is one hopnet iteration); "
                                  f"configure_optimizers returned {len(configured)}")
            assert self.worker is not None
            wrapped = DistributedOptimizer(configured[0], self.worker)
            # Lightning's precision plugins then unscale and clip (the averaged gradient, see
            # Synchronize) and a GradScaler skips the step of a rank whose own gradient overflowed:
            # the iteration still finishes (Worker.iterations), and the average carries the inf.
            wrapped._step_supports_amp_scaling = False  # type: ignore[misc]
            self.optimizers = [wrapped]
            if not any(isinstance(cb, Synchronize) for cb in trainer.callbacks):
                trainer.callbacks.insert(0, Synchronize())

        @contextmanager
        def block_backward_sync(self) -> Iterator[None]:
            """Gradient accumulation: the micro-batches before the last one only accumulate."""
            if self.worker is None:
                yield
                return
            with self.worker.no_sync():
                yield

        # ---------------------------------------------------------------- steps are iterations
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if self._due:
                self._enter()

        def _enter(self) -> None:
            worker, trainer = self.worker, self.lightning_module.trainer
            assert worker is not None
            if self._done:
                raise HopnetError("HopnetStrategy: this worker's training is over (one fit per process)")
            if self._iterations is None:
                total = trainer.estimated_stepping_batches
                if total == float("inf"):
                    raise ConfigError("HopnetStrategy needs a finite run: set max_steps or max_epochs")
                if worker.iteration != trainer.global_step:
                    raise ConfigError(f"HopnetStrategy: hopnet is at iteration {worker.iteration} but Lightning at "
                                      f"step {trainer.global_step}: resume with fit(ckpt_path=...) only")
                self._total = int(total)
                self._iterations = worker.iterations(self._total)
            self._catching_up = False
            self._current = next(self._iterations)
            self._due = False

        def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None,
                           **kwargs: Any) -> Any:
            if self._due:  # manual optimization: a second step in one batch
                self._enter()
            result = super().optimizer_step(optimizer, closure, model, **kwargs)
            self._due = True
            self._log_waits()
            if self._current >= self._total - 1:  # before any collective: a protocol may wait for the others'
                self.on_train_end()                 # consensus at its last step (ad-psgd's passives do)
                self.lightning_module.trainer.should_stop = True
            return result

        def _log_waits(self) -> None:
            assert self.worker is not None
            step = self.worker.node.last_step or {}
            metrics = {f"hopnet/{name}": float(step[name]) for name in WAITS if name in step}
            if metrics and self.lightning_module._current_fx_name is not None:
                self.lightning_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

        def _finish(self) -> None:
            """Training is over here: the last boundary (handovers), or the loop left early."""
            if self._iterations is not None and not self._done:
                self._done = True
                if self._current >= self._total - 1:
                    next(self._iterations, None)
                else:
                    self._iterations.close()  # an early stop every rank agreed on

        def on_train_end(self) -> None:
            """Every live worker ends training with the mean of the live workers' models: at the
            run's last iteration, before Lightning's last validation and checkpoint, or here when
            the loop stopped early (every rank agreed to: early stopping)."""
            self._finish()
            self._catching_up = False
            if self.worker is not None and not self.worker.consensus_calls:
                self.worker.consensus()

        # ---------------------------------------------------------------- collectives among the live workers
        def _gather(self, value: Any) -> dict[int, Any] | None:
            return None if self.worker is None or self._catching_up else self.worker.gather(value)

        def barrier(self, name: str | None = None) -> None:
            self._gather(None)

        def broadcast(self, obj: Any, src: int = 0) -> Any:
            values = self._gather(pack(obj) if self._rank == src else None)
            if values is None:
                return obj
            if values.get(src) is None:
                raise HopnetError(f"HopnetStrategy.broadcast: rank {src} is not live")
            return unpack(values[src])

        def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
            if not isinstance(tensor, torch.Tensor):
                return tensor
            values = self._gather(pack(tensor.detach().cpu()))
            if values is None:
                return tensor
            stacked = torch.stack([unpack(v) for _, v in sorted(values.items())])
            return reduce_stacked(stacked, reduce_op).to(tensor.device)

        def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
            if sync_grads:
                raise ConfigError("HopnetStrategy.all_gather(sync_grads=True) is not supported: "
                                  "gradients cross workers only through the protocol")
            values = self._gather(pack(tensor.detach().cpu()))
            if values is None:
                return tensor.unsqueeze(0)
            return torch.stack([unpack(v) for _, v in sorted(values.items())]).to(tensor.device)

        def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
            values = self._gather(bool(decision))
            if values is None:
                return bool(decision)
            return builtins.all(values.values()) if all else builtins.any(values.values())

        # ---------------------------------------------------------------- checkpoints: one file per rank
        def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
            worker = self.worker
            if worker is not None and worker.steps:
                state = worker.checkpoint_state(worker.iteration - 1)  # the model is Lightning's state_dict
                del state["model"]
                state["states"].pop(OPTIMIZER_STATE, None)  # and the optimizer its optimizer_states,
                state["states"].pop(LOOP_STATE, None)  # and the Trainer its own
                checkpoint = {**checkpoint, STATE_KEY: pack(state)}
            self.checkpoint_io.save_checkpoint(checkpoint, rank_path(filepath, self._rank),
                                               storage_options=storage_options)

        def remove_checkpoint(self, filepath: Any) -> None:
            self.checkpoint_io.remove_checkpoint(rank_path(filepath, self._rank))

        def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
            own = rank_path(checkpoint_path, self._rank)
            path = own if Path(own).exists() else checkpoint_path  # a rank without its own: rank 0's state
            checkpoint: dict[str, Any] = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
            if STATE_KEY in checkpoint and self.worker is None:
                self._resume = unpack(checkpoint[STATE_KEY])
            return checkpoint

    HopnetStrategy.__qualname__ = "HopnetStrategy"
    return HopnetStrategy


__all__ = ["STATE_KEY", "WAITS", "strategy_class"]

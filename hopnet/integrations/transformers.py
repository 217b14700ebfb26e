"""hopnet under a Hugging Face ``transformers.Trainer``: :class:`HopnetTrainer`.

A drop-in for ``Trainer``, started once per worker by ``hopnet launch`` (or torchrun, srun)::

    trainer = HopnetTrainer(model=model, args=TrainingArguments(..., save_steps=50),
                            train_dataset=train, data_collator=collate)
    trainer.train()                  # or train(resume_from_checkpoint=True)
    trainer.save_model()             # the consensus model, written once (lowest live rank)

What it changes in the Trainer, and nothing else:

* the Trainer sees one process (:func:`hopnet.integrations.accelerate.single_process`): no DDP;
* ``train()`` starts the worker (:func:`hopnet.init`), from a checkpoint's hopnet state when it
  resumes; the optimizer's step is one hopnet iteration and the run has ``max_steps`` of them
  (:class:`hopnet.integrations.accelerate.Sync` on the Trainer's own Accelerator): the Trainer's
  schedule, accumulation, clipping (of the averaged gradient) and bf16 are as without hopnet;
* each worker reads its share of every epoch (``DistributedSampler``'s division, seeded with
  ``data_seed`` or ``seed``); in an elastic run, an elastic sampler's share, which follows the
  views, in epochs of a fixed number of batches (:func:`hopnet.elastic.trainers.fixed_epochs`),
  and a joiner enters at ``train()``'s start, taking its donor's ``TrainerState`` as a
  replacement does;
* checkpoints go to ``output_dir/rank{R}/checkpoint-N``, with hopnet's state in ``hopnet/``;
* the Trainer's progress (``TrainerState``) and LR schedule are registered with the worker, so that
  a replacement that ``hopnet launch --max-restarts`` starts gets them in its neighbour's handover,
  with the model and the optimizer, and ``train()`` goes on from there as a resume does;
* at the end of ``train()`` every live worker holds the consensus model, and ``save_model()``
  writes it from the lowest live rank only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import TrainOutput

from hopnet import checkpoint
from hopnet.api import Worker, init
from hopnet.bootstrap.env import WorkerEnv
from hopnet.bootstrap.external import detect
from hopnet.elastic.trainers import fixed_epochs, is_elastic, join_now
from hopnet.errors import ConfigError
from hopnet.integrations.accelerate import Sync, single_process

STATE_FOLDER = "hopnet"
"""The folder of a Trainer checkpoint that holds this rank's hopnet checkpoint."""
PROGRESS_STATE = "hf_trainer_state"
"""The name the Trainer's ``TrainerState`` is registered under (hopnet's checkpoints, handovers)."""
SCHEDULER_STATE = "hf_lr_scheduler"
"""The name the Trainer's LR scheduler is registered under."""
DATA_STATE = "hf_train"
"""The prefix of the training data's registered states in an elastic run (``hf_train_sampler``, ``hf_train_epochs``)."""
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")


class HopnetTrainer(Trainer):
    """``transformers.Trainer`` whose training runs as one hopnet worker.

    ``worker``: a worker already started (then no resume through ``train()``); ``hopnet_options``:
    keyword options of :func:`hopnet.init` (``max_ig=4``...). Not supported: ``model_init``
    (hyperparameter search), DeepSpeed, FSDP, and hopnet's own ``--checkpoint-every`` (use
    ``save_steps``). fp16's gradient scaler skips an overflowed step on every worker alike
    (:class:`~hopnet.integrations.accelerate.Sync`).

    Under ``hopnet launch --max-restarts``, a replacement's ``train()`` goes on from its neighbour's
    handover: its model, optimizer, LR schedule and ``TrainerState`` (global step, epoch), fed
    through the Trainer's own resume path, which skips the batches of the epoch already seen.
    """

    def __init__(self, model: Any = None, args: TrainingArguments | None = None, *positional: Any,
                 worker: Worker | None = None, hopnet_options: Mapping[str, Any] | None = None,
                 **kwargs: Any) -> None:
        if kwargs.get("model_init") is not None:
            raise ConfigError("HopnetTrainer needs a model, not model_init: hopnet.init() moves its tensors")
        if os.environ.get(checkpoint.CHECKPOINT_EVERY, "0").strip() not in ("", "0"):
            raise ConfigError("HopnetTrainer saves through the Trainer: use TrainingArguments(save_steps=N) "
                              "instead of --checkpoint-every")
        with single_process():
            args = TrainingArguments(output_dir="trainer_output") if args is None else args
            _one_process(args)
            super().__init__(model, args, *positional, **kwargs)
        self.worker = worker
        self.hopnet_options = dict(hopnet_options or {})
        self.sync: Sync | None = None
        self.handed_state: TrainerState | None = None
        """A replacement's: the ``TrainerState`` its neighbour handed over (``None`` otherwise)."""
        self._handover_folder: str | None = None
        self.add_callback(_HopnetCallback(self))

    # ------------------------------------------------------------------ the run
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None) -> TrainOutput:
        """``Trainer.train``, as one hopnet worker; ``resume_from_checkpoint=True`` resumes every rank
        from the newest step that all of them saved (:func:`resume_folder`)."""
        resume = resume_folder(str(self.args.output_dir), resume_from_checkpoint, *_environ_place())
        if self.sync is not None:
            raise ConfigError("HopnetTrainer trains once: its run ended with the consensus (start another process)")
        if self.worker is None:
            if self.model is None:
                raise ConfigError("HopnetTrainer needs a model")
            self.worker = _start_worker(self.model, resume, self.hopnet_options)
        elif resume is not None:
            raise ConfigError("resume_from_checkpoint: the worker is already started (resume in a fresh process)")
        if is_elastic(self.worker):
            # A joiner enters now, before the Trainer sets its loop up: its donor's TrainerState then
            # comes as a replacement's does. The elastic sampler's state, not the Trainer's count of
            # batches, says where the data goes on: the Trainer skips none.
            join_now(self.worker)
            self.args.ignore_data_skip = True
        # A replacement gets its neighbour's TrainerState here (hopnet loads it as it registers).
        self.worker.register_state(PROGRESS_STATE, _Progress(self))
        with contextlib.ExitStack() as stack:
            if resume is None and self.handed_state is not None:
                resume = self._handover_folder = stack.enter_context(tempfile.TemporaryDirectory())
                self.handed_state.save_to_json(os.path.join(resume, "trainer_state.json"))
            try:
                return super().train(resume_from_checkpoint=resume, trial=trial,
                                     ignore_keys_for_eval=ignore_keys_for_eval)
            finally:
                self._handover_folder = None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if resume_from_checkpoint != self._handover_folder:  # a replacement's model came with the handover
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _get_train_sampler(self, train_dataset: Dataset | None = None) -> Sampler | None:
        dataset = self.train_dataset if train_dataset is None else train_dataset
        if self.worker is None or dataset is None:
            return super()._get_train_sampler(train_dataset)
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        if is_elastic(self.worker):  # the members' shares follow the views, in epochs of a fixed length
            return fixed_epochs(self.worker, dataset,  # type: ignore[arg-type]
                                self._train_batch_size, seed=seed, name=DATA_STATE)
        members = list(self.worker.members)
        # Padded to equal shares, so every worker counts the same steps per epoch.
        return DistributedSampler(dataset, num_replicas=len(members),  # type: ignore[arg-type]
                                  rank=members.index(self.worker.rank), shuffle=True, seed=seed)

    # ------------------------------------------------------------------ checkpoints and the model
    def _get_output_dir(self, trial: Any) -> str:
        return os.path.join(super()._get_output_dir(trial), f"rank{_environ_rank()}")

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A checkpoint's model on every rank (its own); otherwise the model once, from the lowest
        live rank (after ``train()``, every live rank holds the same consensus model)."""
        if _internal_call or self._writes_model():
            super().save_model(output_dir, _internal_call=_internal_call)

    def _writes_model(self) -> bool:
        worker = self.worker
        if worker is None:
            return _environ_rank() == 0
        consensus = self.sync.consensus if self.sync is not None else None
        lowest = consensus.members[0] if consensus is not None else min(worker.members)
        return worker.rank == lowest


class _HopnetCallback(TrainerCallback):
    """Drives the worker from the Trainer's loop: one iteration per optimizer step."""

    def __init__(self, trainer: HopnetTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        trainer = self.trainer
        assert trainer.model is not None and trainer.optimizer is not None
        sync = Sync(trainer.accelerator, trainer.model, trainer.optimizer, steps=state.max_steps,
                    worker=trainer.worker)
        trainer.sync = sync.__enter__()
        if trainer.lr_scheduler is not None:  # (the optimizer's state: Sync's DistributedOptimizer registers it)
            sync.worker.register_state(SCHEDULER_STATE, trainer.lr_scheduler)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        sync = self.trainer.sync
        if sync is not None and not sync.step():
            control.should_training_stop = True  # hopnet's iterations are over (a skip ahead reached the end)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        trainer, sync = self.trainer, self.trainer.sync
        if sync is None or sync.finished is None:
            return
        folder = Path(trainer._get_output_dir(None)) / f"checkpoint-{state.global_step}" / STATE_FOLDER
        _save_hopnet_state(sync.worker, folder, sync.finished)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        sync = self.trainer.sync
        if sync is not None and sync.active and logs:
            sync.worker.report(**{key: value for key, value in logs.items() if isinstance(value, (int, float))})

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self.trainer.sync is not None:
            self.trainer.sync.close()  # every live worker: the consensus model


class _Progress:
    """The Trainer's ``TrainerState`` as registered state: saved in hopnet's checkpoints and handed
    over at the step boundary (``on_step_end``: ``global_step`` counts the step just finished).
    Loaded before training (a replacement), it is kept for ``train()``'s resume path; during
    training (a rank behind that resynchronizes), the step and epoch counters follow it."""

    def __init__(self, trainer: HopnetTrainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return {"trainer_state": json.dumps(dataclasses.asdict(self.trainer.state))}  # as its save_to_json

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        loaded = TrainerState(**json.loads(state["trainer_state"]))
        trainer = self.trainer
        if trainer.sync is None:
            trainer.handed_state = loaded
        else:
            trainer.state.global_step, trainer.state.epoch = loaded.global_step, loaded.epoch


def _one_process(args: TrainingArguments) -> None:
    """Set ``args`` up as one process (inside :func:`single_process`): arguments built under torchrun
    see its world; on a GPU machine, this worker's GPU only (the Trainer would take every visible
    one into ``DataParallel``)."""
    if args.world_size > 1:
        args.__dict__.pop("_setup_devices", None)  # a cached_property: computed again, now as one process
    if args.device.type == "cuda":
        args.__dict__["_setup_devices"] = torch.device("cuda", torch.cuda.current_device())
        args._n_gpu = 1


def _save_hopnet_state(worker: Worker, folder: Path, iteration: int) -> None:
    """The worker's checkpoint (model, optimizer, protocol and registered state, RNG) into ``folder``,
    in hopnet's format: what :func:`_start_worker` resumes from."""
    own, worker.checkpointer = worker.checkpointer, checkpoint.Checkpointer(folder, worker.rank, every=0)
    try:
        worker.save_checkpoint(iteration)
        worker.checkpointer.wait()
    finally:
        worker.checkpointer = own


def _start_worker(model: torch.nn.Module, resume: str | None, options: Mapping[str, Any]) -> Worker:
    """:func:`hopnet.init`, from the hopnet checkpoint in ``resume`` when there is one."""
    if resume is None:
        return init(model, **options)
    folder = Path(resume) / STATE_FOLDER
    iterations = checkpoint.rank_iterations(folder, _environ_rank())
    if not iterations:
        raise ConfigError(f"{resume} holds no hopnet state for rank {_environ_rank()} (in {STATE_FOLDER}/)")
    with _variables({checkpoint.CHECKPOINT_DIR: str(folder), checkpoint.RESUME: str(iterations[-1])}):
        return init(model, **options)


def resume_folder(output_dir: str, asked: str | bool | None, rank: int, world_size: int) -> str | None:
    """This rank's folder of the checkpoint to resume from (``output_dir/rank{R}/checkpoint-N``):
    ``True`` picks the newest step that every rank saved; a path names a step (its last part,
    ``checkpoint-N``), read from this rank's folder; ``None`` or ``False``: none."""
    if asked is None or asked is False:
        return None
    root = Path(output_dir)
    if asked is True:
        common = set.intersection(*(_saved_steps(root / f"rank{r}", r) for r in range(world_size)))
        if not common:
            raise ValueError(f"no checkpoint in {root} that every rank saved")
        return str(root / f"rank{rank}" / f"checkpoint-{max(common)}")
    return str(root / f"rank{rank}" / Path(asked).name)


def _saved_steps(folder: Path, rank: int) -> set[int]:
    """The steps of the complete checkpoints in one rank's folder (the hopnet state is written last)."""
    if not folder.is_dir():
        return set()
    return {int(m.group(1)) for path in folder.iterdir() if (m := _CHECKPOINT.fullmatch(path.name))
            and checkpoint.rank_iterations(path / STATE_FOLDER, rank)}


def _environ_place() -> tuple[int, int]:
    """This process's rank and the run's world size, from its launcher's variables (0 of 1 without)."""
    found = WorkerEnv.from_environ(os.environ) or detect(os.environ)
    return (found.rank, found.world_size) if found is not None else (0, 1)


def _environ_rank() -> int:
    return _environ_place()[0]


@contextlib.contextmanager
def _variables(values: Mapping[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


__all__ = ["PROGRESS_STATE", "SCHEDULER_STATE", "STATE_FOLDER", "HopnetTrainer", "resume_folder"]

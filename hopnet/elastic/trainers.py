"""What the adapters of trainers that run their own loop (Lightning's, the Hugging Face
Trainer's) need from an elastic run: a joiner enters before the trainer sets its loop up, and
the training data follows the views in epochs of a fixed number of batches.

A joiner of the bare API asks to be admitted at its first step (docs/design/elastic.md). A
framework's loop state (Lightning's fit loop progress, the Trainer's ``TrainerState``) can be
restored only before the loop starts, as from a checkpoint, so an adapter calls
:func:`join_now` once its worker holds the model and the optimizer: the donor's state then
arrives as a replacement's handover does, and the adapter restores the loop from it."""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

from hopnet.data import ElasticSampler, FixedEpochs, batches_per_epoch


def is_elastic(worker: Any) -> bool:
    """Whether ``worker`` (a :class:`hopnet.api.Worker`) is a member of an elastic run."""
    return getattr(worker, "changeover", None) is not None


def joining(worker: Any) -> bool:
    """Whether ``worker`` is a joiner not admitted yet."""
    return is_elastic(worker) and bool(worker.changeover.joining)


def join_now(worker: Any) -> bool:
    """A joiner: be admitted now, with a donor's state (the registered states not registered yet
    wait in the worker until they are). Returns whether it joined; raises
    :class:`hopnet.elastic.changeover.Left` when the run ended before it got in."""
    if not joining(worker):
        return False
    worker.changeover.join_when_due()
    return True


def fixed_epochs(worker: Any, dataset: Sized | int, batch_size: int, *, seed: int, name: str) -> FixedEpochs:
    """This member's training indices in an elastic run: an :class:`ElasticSampler` over the
    view's members, in trainer epochs of one pass over the data by the run's members when the
    sampler is made (the donor's count, in a joiner). Both are registered with ``worker``, as
    ``{name}_sampler`` and ``{name}_epochs``: the view changes re-divide the data, and a
    joiner takes both from its donor. A second call for the same data returns the first one's."""
    length = dataset if isinstance(dataset, int) else len(dataset)
    made = worker._states.get(f"{name}_epochs")
    if isinstance(made, FixedEpochs) and made.source.split.length == length and made.batch_size == batch_size:
        return made  # a loader built again (Lightning's reload_dataloaders_every_n_epochs): the same stream
    sampler = ElasticSampler(length, rank=worker.rank, members=worker.members, view=worker.view, seed=seed)
    worker.register_state(f"{name}_sampler", sampler)
    epochs = FixedEpochs(sampler, batch_size, batches_per_epoch(length, len(worker.members), batch_size))
    worker.register_state(f"{name}_epochs", epochs)
    return epochs


__all__ = ["fixed_epochs", "is_elastic", "join_now", "joining"]

"""Is a tensor free of inf and NaN? The checks that keep non-finite values out of the mix.

Who calls them, and what happens then (docs/design/optimizer.md, "Non-finite values"):

* :class:`hopnet.optim.DistributedOptimizer` skips the step whose gradient (the averaged one,
  under a gradient protocol) is not finite, on every rank of the reduction alike, and raises
  :class:`hopnet.errors.NonFiniteError` when its own step left the model non-finite;
* the model-averaging protocols that receive a neighbour's model (hop, ad-psgd) leave out a
  non-finite one: dropped, counted as ``non_finite``, recorded naming its sender;
* those that average in groups (prague, partial-reduce) and ad-psgd's actives check their own
  model before they average it with anyone (:func:`refuse_non_finite_model`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hopnet.errors import NonFiniteError


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of ``tensor`` is finite.

    One reduction on the fast path: the sum of a tensor holding inf or NaN is not finite.
    Only a non-finite sum (which finite values can reach by overflowing) pays for the
    element-wise check."""
    if tensor.numel() == 0:
        return True
    if not tensor.dtype.is_floating_point and not tensor.dtype.is_complex:
        return True
    if bool(torch.isfinite(tensor.sum())):
        return True
    return bool(torch.isfinite(tensor).all())


def all_finite_in(tensors: Iterable[torch.Tensor]) -> bool:
    """:func:`all_finite` of every tensor of ``tensors``."""
    return all(all_finite(t) for t in tensors)


def refuse_non_finite_model(model: Iterable[torch.Tensor], *, rank: int, iteration: int, to: str) -> None:
    """Raise :class:`NonFiniteError` if ``model`` (this worker's own flat tensors) is not finite:
    called before the model is sent ``to`` someone."""
    if not all_finite_in(model):
        raise NonFiniteError(f"rank {rank}: its model holds inf or NaN in iteration {iteration}; it is not sent "
                             f"to {to}", rank=rank, iteration=iteration)

"""Local steps (local SGD) for the protocols that average models: ``--local-steps H``.

A worker mixes its model with the others' every ``H`` iterations and trains alone in between.
Iterations are numbered as ever (the trainer's loop, the event log and checkpoints count them);
the iterations are grouped into *rounds* of ``H``: round ``r`` holds iterations ``rH .. rH+H-1``
and mixes at its last one, the *mixing iteration*. The run's last iteration always mixes, so a
run whose length is not a multiple of ``H`` ends with a shorter round and a mixed model.

Everything here is a pure function of the iteration, so that checkpoints, restarts and every
rank agree on where the rounds fall without saying so: a run resumed from a checkpoint taken
in the middle of a round goes on with that round, and mixes where it would have.
"""

from __future__ import annotations

from dataclasses import dataclass

from hopnet.options import ProtocolOptions, option


@dataclass(frozen=True)
class LocalStepsOptions(ProtocolOptions):
    """The option shared by the model-averaging protocols that take local steps."""

    local_steps: int = option(1, minimum=1, metavar="H",
                              help="mix every H iterations and train alone in between (local SGD; under "
                                   "--protocol diloco: inner steps between outer steps, default 10)")


def mixes_at(iteration: int, local_steps: int, final_iteration: int | None) -> bool:
    """Whether ``iteration`` is a mixing iteration: the last of its round, or the run's last."""
    if local_steps == 1 or (iteration + 1) % local_steps == 0:
        return True
    return final_iteration is not None and iteration >= final_iteration


def round_of(iteration: int, local_steps: int) -> int:
    """The round ``iteration`` belongs to."""
    return iteration // local_steps


def mixing_iteration(round_: int, local_steps: int, final_iteration: int | None) -> int:
    """The iteration at which round ``round_`` mixes."""
    last = round_ * local_steps + local_steps - 1
    return last if final_iteration is None else min(last, final_iteration)


def rounds_sent_by(iteration: int, local_steps: int, final_iteration: int | None) -> int:
    """The last round a worker in ``iteration`` has entered (so sent its model for), ``-1`` for none:
    it enters a round at its mixing iteration."""
    r = round_of(iteration, local_steps)
    return r if iteration >= mixing_iteration(r, local_steps, final_iteration) else r - 1


__all__ = ["LocalStepsOptions", "mixes_at", "mixing_iteration", "round_of", "rounds_sent_by"]

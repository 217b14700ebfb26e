"""DiLoCo's declaration (:mod:`hopnet.protocols.diloco.protocol` is the algorithm, and
:mod:`hopnet.protocols.diloco.quorum` its ``--outer-quorum`` variant): its options, its sync
schedule and the gap bound that follows from it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hopnet.config import ProtocolConfig
from hopnet.graph import Graph
from hopnet.output_spec import Count, OutputSpec, Wait
from hopnet.registry import Averages, MessageKind, ProtocolSpec, register
from hopnet.protocols.diloco.options import READY_KIND, DiLoCoOptions, sync_interval

if TYPE_CHECKING:
    import torch

    from hopnet.model_state import ModelState
    from hopnet.protocols.diloco.protocol import DiLoCoProtocol


def gap_bound(options: DiLoCoOptions, graph: Graph) -> np.ndarray:
    """Iter(i) - Iter(j) <= the sync interval plus --overlap-steps, for every pair: a worker passes the
    landing of a sync only once every rank has finished the step that launched it, and the next
    landing is at most that many iterations further."""
    if options.outer_quorum is not None and options.max_stale_rounds > 0:
        bound = np.full((graph.n, graph.n), np.inf)  # rounds close without the slow: it falls behind
    else:
        bound = np.full((graph.n, graph.n), float(sync_interval(options.local_steps, options.fragments)
                                                   + options.overlap()))
    np.fill_diagonal(bound, 0.0)
    return bound


def gap_rule(options: DiLoCoOptions) -> str:
    if options.outer_quorum is not None and options.max_stale_rounds > 0:
        return f"unbounded in iterations; a pseudo-gradient is at most {options.max_stale_rounds} rounds stale"
    interval = sync_interval(options.local_steps, options.fragments)
    return f"{interval + options.overlap()} (every sync is a barrier: {interval} iterations apart" + \
        (f", landing {options.overlap()} later)" if options.overlap() else ")")


def build(config: ProtocolConfig, options: DiLoCoOptions, model: ModelState | torch.Tensor | None,
          grads: object) -> DiLoCoProtocol:
    if options.outer_quorum is None:
        from hopnet.protocols.diloco.protocol import DiLoCoProtocol

        return DiLoCoProtocol(config, options, model)
    from hopnet.protocols.diloco.quorum import QuorumDiLoCoProtocol

    return QuorumDiLoCoProtocol(config, options, model)


DILOCO_OUTPUT = OutputSpec(
    waits=(Wait("wait_updates_s", "wait for the outer step", "wait outer"),),
    counts=(Count("outer_steps", "outer steps", "max"), Count("local_steps", "local steps (H)", "max"),
            Count("late_taken", "late pseudo-gradients taken"),
            Count("rounds", "rounds", "max", in_summary=False),
            Count("max_staleness", "most rounds stale", "max", in_summary=False)),
    gaps="all")


register(ProtocolSpec(
    name="diloco",
    between_replicas=True,
    summary="DiLoCo: H local steps of the trainer's optimizer, then an outer Nesterov step on the averaged "
            "pseudo-gradient (--local-steps, --outer-lr, --fragments, --compress).",
    options=DiLoCoOptions,
    build=build,
    message_kinds=(MessageKind(READY_KIND, any_rank=True),),
    averages=Averages.MODELS,
    uses_graph=False,
    resumable=True,
    gap_bound=gap_bound,
    gap_rule=gap_rule,
    output=DILOCO_OUTPUT,
))


"""Hop's declaration (:mod:`hopnet.protocols.hop.protocol` is the algorithm): its options (Table 1's
settings), what it refuses on a graph, and the gap bound it proves.

Imports no torch: `hopnet launch --help` and the argument checks read it; the algorithm is
imported when a run builds its protocol."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from hopnet.config import ProtocolConfig
from hopnet.config_checks import graph_in_words
from hopnet.errors import ConfigError
from hopnet.graph import Graph
from hopnet.output_spec import SKIPS, TOKENS_WAIT, UPDATES_WAIT, Count, OutputSpec, Wait
from hopnet.registry import Averages, MessageKind, ProtocolSpec, register
from hopnet.protocols.hop.options import WELCOME, HopOptions, NotifyAckOptions, backup_workers_flag, restart_refusal

if TYPE_CHECKING:
    import torch

    from hopnet.model_state import ModelState
    from hopnet.params import FlatGradients
    from hopnet.protocols.base import Protocol


# ---------------------------------------------------------------------- checks against the graph
# What is refused, and why (Table 1 and Sec. 4-5; ``d(a, b)`` is the shortest path a -> b):
#
# * More backup workers at a rank than it has in-neighbours (Fig. 8 needs
#   ``N_buw(i) < |N_in(i)|`` with the self-loop counted).
# * Iteration skipping that can never trigger. A worker ``i`` skips when it is more than
#   ``T`` iterations behind every out-neighbour ``j``. How far ``j`` can get ahead of its
#   in-neighbour ``i`` is ``min(b0, max_ig * d(j, i))``: ``b0`` is 1 when ``j`` needs
#   ``i``'s update of every iteration, ``s + 1`` with staleness ``s`` and unbounded when
#   ``j`` has backup workers; the token queues give the second term. When ``T`` is not
#   below that for any worker, nothing ever skips. A jump is also capped at
#   ``max_ig - 1`` iterations (docs/protocols/hop.md, "Skips are capped at max_ig"), so ``--max-ig 1`` never skips.
#
# What is accepted, with a note:
#
# * ``--staleness S`` that the token queues always pre-empt. Worker ``i`` can be at most
#   ``max_ig * d(i, j)`` iterations ahead of its in-neighbour ``j``, and with the parallel
#   approach the update that carries ``j``'s token is the update itself, so ``i`` always
#   holds an update no older than ``k - max_ig * d(i, j)`` (one older with ``--serial``).
#   When ``S`` is at least that on every edge, the bound never makes a worker wait, and
#   ``S`` only sets Eq. 2's mixing weights: asynchronous within the token bound, so not refused.
# * ``--max-jump J`` above ``max_ig - 1``: it acts as ``max_ig - 1``.
def check_hop_graph(config: ProtocolConfig, options: HopOptions, graph: Graph) -> list[str]:
    _check_backup_workers(options, graph)
    notes: list[str] = []
    # These checks need only each edge's way back (Graph.back_lengths), not the n x n path
    # lengths (O(n^2) memory: 800 MB at 10,000 workers).
    if options.skip_threshold is not None:
        notes.extend(_check_skipping(options, graph))
    if options.staleness is not None and options.token_queues:
        notes.extend(_staleness_notes(options, graph))
    return notes


def _check_backup_workers(options: HopOptions, graph: Graph) -> None:
    for rank in range(graph.n):
        wanted = options.backup_workers_for(rank)
        degree = len(graph.in_peers(rank))
        if wanted > degree:
            noun = "in-neighbour" if degree == 1 else "in-neighbours"
            raise ConfigError(f"{backup_workers_flag(options)}: rank {rank} of {graph_in_words(graph)} has "
                              f"{degree} {noun}, so it can go without at most {degree} of their updates")


def _lead_bound(options: HopOptions, back: Mapping[tuple[int, int], int], i: int, j: int) -> float:
    """How far out-neighbour ``j`` can ever get ahead of its in-neighbour ``i`` (Table 1);
    ``back[i, j]`` is d(j, i)."""
    if options.backup_workers_for(j) > 0:
        own = math.inf  # j can go on without i's updates
    elif options.staleness is not None:
        own = options.staleness + 1
    else:
        own = 1
    return min(own, options.max_ig * float(back[i, j]))


def largest_lead(options: HopOptions, graph: Graph) -> float:
    """The most any worker can ever be behind *all* its out-neighbours: what a skip threshold must stay below."""
    back = graph.back_lengths()
    best = 0.0
    for i in range(graph.n):
        outs = graph.out_peers(i)
        if outs:
            best = max(best, min(_lead_bound(options, back, i, j) for j in outs))
    return best


def _check_skipping(options: HopOptions, graph: Graph) -> list[str]:
    threshold, max_jump, max_ig = options.skip_threshold, options.max_jump, options.max_ig
    assert threshold is not None and max_jump is not None
    flag = f"--skip-threshold {threshold}"
    if max_ig < 2:
        raise ConfigError(f"{flag}: a jump is capped at max_ig - 1 iterations, so --max-ig {max_ig} "
                          "never skips (use --max-ig 2 or more)")
    lead = largest_lead(options, graph)
    if lead <= 1 and options.staleness is None and not options.has_backup_workers:
        raise ConfigError(f"{flag} is never passed: without --backup-workers or --staleness a worker is never "
                          "more than 1 iteration behind its out-neighbours (Hop Table 1), so nothing would skip")
    if threshold >= lead:
        limit = int(lead)
        if options.staleness is not None and not options.has_backup_workers and lead == options.staleness + 1:
            why = f"with --staleness {options.staleness}"
        elif lead == max_ig:
            why = f"with --max-ig {max_ig}"
        else:
            why = f"with these options on {graph_in_words(graph)}"
        hint = f" (use a threshold below {limit})" if limit >= 2 else ""
        raise ConfigError(f"{flag} is never passed: {why} no worker falls more than {limit} "
                          f"iteration{'s' if limit != 1 else ''} behind all its out-neighbours, "
                          f"so nothing would skip{hint}")
    notes = []
    if max_jump > max_ig - 1:
        notes.append(f"--max-jump {max_jump} acts as {max_ig - 1}: a jump is capped at max_ig - 1 iterations "
                     f"(--max-ig {max_ig})")
    return notes


def _staleness_notes(options: HopOptions, graph: Graph) -> list[str]:
    staleness = options.staleness
    assert staleness is not None
    extra = 1 if options.serial else 0
    back = graph.back_lengths()  # back[j, i] = d(i, j) for each in-neighbour j of i
    reach = max((options.max_ig * back[j, i] + extra for i in range(graph.n) for j in graph.in_peers(i)),
                default=0)
    if staleness < reach:
        return []
    return [f"--staleness {staleness} never makes a worker wait here: the token queues (--max-ig {options.max_ig}) "
            f"stop it first, so it only sets the mixing weights (a bound that binds is below {reach})"]


# ---------------------------------------------------------------------- the gap bound (Table 1)
def gap_bound(options: HopOptions, graph: Graph) -> np.ndarray:
    """The upper bound on Iter(i) - Iter(j) as an N x N matrix (inf = unbounded)."""
    d = graph.shortest_path_lengths().astype(float)
    forward = d.T  # forward[i][j] = length(Path j -> i)
    backward = d   # backward[i][j] = length(Path i -> j)
    if options.has_backup_workers:
        base = np.full_like(forward, np.inf)
    elif options.staleness is not None:
        base = (options.staleness + 1) * forward
    else:
        base = forward
    if options.token_queues:
        return np.minimum(base, options.max_ig * backward)
    return base


def gap_rule(options: HopOptions) -> str:
    """:func:`gap_bound` in words (len = shortest path length)."""
    tokens = f"{options.max_ig}·len(i→j)" if options.token_queues else None
    if options.has_backup_workers:
        base = None
    elif options.staleness is not None:
        base = f"{options.staleness + 1}·len(j→i)"
    else:
        base = "len(j→i)"
    if base is None:
        rule = tokens or "unbounded"
    else:
        rule = f"min({base}, {tokens})" if tokens else base
    return rule if options.local_steps == 1 else f"{rule} rounds of {options.local_steps} iterations"


def notify_ack_gap_bound(options: NotifyAckOptions, graph: Graph) -> np.ndarray:
    d = graph.shortest_path_lengths().astype(float)
    return np.minimum(d.T, 2 * d)


# ---------------------------------------------------------------------- the declarations
def _build_hop(config: ProtocolConfig, options: HopOptions, model: ModelState | None,
               grads: FlatGradients | torch.Tensor | None) -> Protocol:
    from hopnet.protocols.hop.protocol import HopProtocol

    return HopProtocol(config, options, model)


def _build_notify_ack(config: ProtocolConfig, options: NotifyAckOptions, model: ModelState | None,
                      grads: FlatGradients | torch.Tensor | None) -> Protocol:
    from hopnet.protocols.hop.protocol import HopProtocol

    return HopProtocol(config, options.as_hop(), model, notify_ack=True)


HOP_COUNTS = (Count(SKIPS, "skips"), Count("skipped_iterations", "iterations skipped", in_summary=False),
              Count("late_updates_dropped", "late updates dropped", in_summary=False),
              Count("updates_not_sent", "updates not sent", in_summary=False),
              Count("queue_high_water", "queue high water", "max", in_summary=False),
              Count("token_high_water", "token high water", "max", in_summary=False))
HOP_OUTPUT = OutputSpec(waits=(UPDATES_WAIT, TOKENS_WAIT), counts=HOP_COUNTS, gaps="neighbours")
NOTIFY_ACK_OUTPUT = OutputSpec(waits=(UPDATES_WAIT, Wait("wait_tokens_s", "wait for acknowledgements", "wait acks")),
                               counts=HOP_COUNTS, gaps="neighbours")


register(ProtocolSpec(
    name="hop",
    between_replicas=True,
    restarts_replicas=True,
    summary="Hop's queue-based decentralized training: each worker mixes its neighbours' updates, with "
            "token queues bounding the gap (--max-ig), and backup workers, bounded staleness and "
            "iteration skipping for stragglers.",
    options=HopOptions,
    build=_build_hop,
    averages=Averages.MODELS,
    uses_graph=True,
    check_graph=check_hop_graph,
    gap_bound=gap_bound,
    gap_rule=gap_rule,
    simulated_without_tensors=True,
    resumable=True,
    restartable=True,
    restart_refusal=restart_refusal,
    message_kinds=(MessageKind(WELCOME),),
    output=HOP_OUTPUT,
))

register(ProtocolSpec(
    name="notify-ack",
    between_replicas=True,
    summary="the baseline Hop improves on: a worker enters iteration k once every out-neighbour "
            "acknowledged its update k-1.",
    options=NotifyAckOptions,
    build=_build_notify_ack,
    averages=Averages.MODELS,
    uses_graph=True,
    gap_bound=notify_ack_gap_bound,
    gap_rule=lambda options: "min(len(j→i), 2·len(i→j))" + (
        f" rounds of {options.local_steps} iterations" if options.local_steps > 1 else ""),
    simulated_without_tensors=True,
    resumable=True,
    restartable=True,
    restart_refusal=lambda options: restart_refusal(options.as_hop(), "notify-ack"),
    message_kinds=(MessageKind(WELCOME),),
    output=NOTIFY_ACK_OUTPUT,
))


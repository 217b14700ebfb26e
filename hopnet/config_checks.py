"""Protocol options checked against the graph they will run on, before anything starts.

:func:`check_config_for_graph` is the one check that `hopnet launch`, `hopnet simulate`
and :func:`hopnet.init` run, so all three refuse the same settings with the same
one-line :class:`ConfigError`. It returns notes: settings that are accepted but do
less than their name suggests.

What is refused, and why (Hop, ASPLOS'19, Sec. 4-5 and Table 1; ``d(a, b)`` is the
shortest path a -> b):

* Options naming ranks the run does not have (per-rank backup workers, slowdowns).
* More backup workers at a rank than it has in-neighbours (Fig. 8 needs
  ``N_buw(i) < |N_in(i)|`` with the self-loop counted).
* Iteration skipping that can never trigger. A worker ``i`` skips when it is more than
  ``T`` iterations behind every out-neighbour ``j``. How far ``j`` can get ahead of its
  in-neighbour ``i`` is ``min(b0, max_ig * d(j, i))``: ``b0`` is 1 when ``j`` needs
  ``i``'s update of every iteration, ``s + 1`` with staleness ``s`` and unbounded when
  ``j`` has backup workers; the token queues give the second term. When ``T`` is not
  below that for any worker, nothing ever skips (``--skip-threshold 4 --max-ig 4`` on
  an undirected graph, or skipping without backup workers or staleness). A jump is also
  capped at ``max_ig - 1`` iterations (docs/design.md), so ``--max-ig 1`` never skips.

What is accepted, with a note:

* ``--staleness S`` that the token queues always pre-empt. Worker ``i`` can be at most
  ``max_ig * d(i, j)`` iterations ahead of its in-neighbour ``j``, and with the parallel
  approach the update that carries ``j``'s token is the update itself, so ``i`` always
  holds an update no older than ``k - max_ig * d(i, j)`` (one older with ``--serial``,
  where updates go out after the compute). When ``S`` is at least that on every edge,
  the bound never makes a worker wait, and ``S`` only sets Eq. 2's mixing weights.
  The run is still useful, it's just asynchronous within the token bound (the
  simulator gives byte-identical timings for ``--staleness 2`` and ``--staleness 5``
  at ``--max-ig 2``), so it is not refused.
* ``--max-jump J`` above ``max_ig - 1``: it acts as ``max_ig - 1``.

Notify-ack's own restrictions (no backup workers, staleness or skipping: its gap of
at most 2 leaves no room for them, Sec. 3.4-3.5) and the need for token queues are
checked by :meth:`ProtocolConfig.validate`, which this runs first.
"""

from __future__ import annotations

import math

import numpy as np

from hopnet.config import ProtocolConfig
from hopnet.coordinator.static_schedule import check_static_schedule
from hopnet.errors import ConfigError
from hopnet.graph import Graph


def check_config_for_graph(config: ProtocolConfig, graph: Graph) -> list[str]:
    """Refuse (``ConfigError``) options that cannot work on ``graph``; return notes on the rest."""
    config.validate()
    config.validate_ranks(graph.n)
    _check_backup_workers(config, graph)
    if config.protocol == "ad-psgd":
        check_bipartite(graph)
    notes: list[str] = []
    if config.protocol == "prague":
        notes.extend(_check_prague(config, graph))
    if config.protocol != "hop":
        return notes
    d = graph.shortest_path_lengths()
    if config.skip_threshold is not None:
        notes.extend(_check_skipping(config, graph, d))
    if config.staleness is not None and config.token_queues:
        notes.extend(_staleness_notes(config, graph, d))
    return notes


def check_bipartite(graph: Graph) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """AD-PSGD's active and passive sets: the graph's two sides. A graph that has none (an odd
    cycle, which would let averagings wait on each other in a circle) or whose edges go one way
    only (a pair must talk both ways) is refused in one line."""
    if not graph.is_undirected():
        raise ConfigError(f"--protocol ad-psgd needs an undirected graph: {_graph_label(graph)} has "
                          "one-way edges, and an averaging pair talks both ways")
    sides = graph.two_colouring()
    if isinstance(sides, list):
        raise ConfigError(f"{_graph_label(graph)} is not bipartite: odd cycle {'-'.join(map(str, sides))} "
                          "(--protocol ad-psgd needs active and passive sides with every edge between them)")
    return sides


def _check_prague(config: ProtocolConfig, graph: Graph) -> list[str]:
    """The static schedule refuses graphs it cannot serve; the smart GG notes an Inter-Intra that is off."""
    if config.group_generator == "static":
        check_static_schedule(graph.machines)
        return []
    if (config.group_generator == "smart" and config.inter_intra and config.global_division
            and any(m is None for m in graph.machines)):
        return [f"Inter-Intra is off: {_graph_label(graph)} has no machine labels (the graph's "
                "\"machine\" field); groups are drawn over all workers"]
    return []


def _graph_label(graph: Graph) -> str:
    return graph.name or f"the graph ({graph.n} nodes)"


def backup_workers_flag(config: ProtocolConfig) -> str:
    """``--backup-workers`` as the user would have written it."""
    bw = config.backup_workers
    if isinstance(bw, dict):
        return "--backup-workers " + ",".join(f"{r}:{n}" for r, n in sorted(bw.items()))
    return f"--backup-workers {bw}"


def _check_backup_workers(config: ProtocolConfig, graph: Graph) -> None:
    for rank in range(graph.n):
        wanted = config.backup_workers_for(rank)
        degree = len(graph.in_peers(rank))
        if wanted > degree:
            noun = "in-neighbour" if degree == 1 else "in-neighbours"
            raise ConfigError(f"{backup_workers_flag(config)}: rank {rank} of {_graph_label(graph)} has "
                              f"{degree} {noun}, so it can go without at most {degree} of their updates")


def _lead_bound(config: ProtocolConfig, d: np.ndarray, i: int, j: int) -> float:
    """How far out-neighbour ``j`` can ever get ahead of its in-neighbour ``i`` (Table 1)."""
    if config.backup_workers_for(j) > 0:
        own = math.inf  # j can go on without i's updates
    elif config.staleness is not None:
        own = config.staleness + 1
    else:
        own = 1
    return min(own, config.max_ig * float(d[j][i]))


def largest_lead(config: ProtocolConfig, graph: Graph, d: np.ndarray | None = None) -> float:
    """The most any worker can ever be behind *all* its out-neighbours: what a skip threshold must stay below."""
    d = graph.shortest_path_lengths() if d is None else d
    best = 0.0
    for i in range(graph.n):
        outs = graph.out_peers(i)
        if outs:
            best = max(best, min(_lead_bound(config, d, i, j) for j in outs))
    return best


def _check_skipping(config: ProtocolConfig, graph: Graph, d: np.ndarray) -> list[str]:
    threshold, max_jump, max_ig = config.skip_threshold, config.max_jump, config.max_ig
    assert threshold is not None and max_jump is not None
    flag = f"--skip-threshold {threshold}"
    if max_ig < 2:
        raise ConfigError(f"{flag}: a jump is capped at max_ig - 1 iterations, so --max-ig {max_ig} "
                          "never skips (use --max-ig 2 or more)")
    lead = largest_lead(config, graph, d)
    if lead <= 1 and config.staleness is None and not config.has_backup_workers:
        raise ConfigError(f"{flag} is never passed: without --backup-workers or --staleness a worker is never "
                          "more than 1 iteration behind its out-neighbours (Hop Table 1), so nothing would skip")
    if threshold >= lead:
        limit = int(lead)
        if config.staleness is not None and not config.has_backup_workers and lead == config.staleness + 1:
            why = f"with --staleness {config.staleness}"
        elif lead == max_ig:
            why = f"with --max-ig {max_ig}"
        else:
            why = f"with these options on {_graph_label(graph)}"
        hint = f" (use a threshold below {limit})" if limit >= 2 else ""
        raise ConfigError(f"{flag} is never passed: {why} no worker falls more than {limit} "
                          f"iteration{'s' if limit != 1 else ''} behind all its out-neighbours, "
                          f"so nothing would skip{hint}")
    notes = []
    if max_jump > max_ig - 1:
        notes.append(f"--max-jump {max_jump} acts as {max_ig - 1}: a jump is capped at max_ig - 1 iterations "
                     f"(--max-ig {max_ig})")
    return notes


def _staleness_notes(config: ProtocolConfig, graph: Graph, d: np.ndarray) -> list[str]:
    staleness = config.staleness
    assert staleness is not None
    extra = 1 if config.serial else 0
    reach = max((config.max_ig * int(d[i][j]) + extra for i in range(graph.n) for j in graph.in_peers(i)),
                default=0)
    if staleness < reach:
        return []
    return [f"--staleness {staleness} never makes a worker wait here: the token queues (--max-ig {config.max_ig}) "
            f"stop it first, so it only sets the mixing weights (a bound that binds is below {reach})"]

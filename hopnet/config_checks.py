"""Protocol options checked against the graph they will run on, before anything starts.

:func:`check_config_for_graph` is the one check that `hopnet launch`, `hopnet simulate`
and :func:`hopnet.init` run, so all three refuse the same settings with the same
one-line :class:`ConfigError`. It returns notes: settings that are accepted but do
less than their name suggests.

It checks the options on their own (:meth:`ProtocolConfig.validate`), the options that
name ranks against the run's size, and then what the protocol's declaration asks
(``check_graph`` of :class:`hopnet.registry.ProtocolSpec`: Hop's Table 1 bounds in
:mod:`hopnet.protocols.hop.protocol`, AD-PSGD's bipartite graph, Prague's static schedule).
"""

from __future__ import annotations

from hopnet.config import ProtocolConfig
from hopnet.graph import Graph


def check_config_for_graph(config: ProtocolConfig, graph: Graph) -> list[str]:
    """Refuse (``ConfigError``) options that cannot work on ``graph``; return notes on the rest."""
    config.validate()
    config.validate_ranks(graph.n)
    check = config.spec.check_graph
    return check(config, config.options, graph) if check is not None else []


def graph_in_words(graph: Graph) -> str:
    """The graph as a refusal names it: its name, else its size."""
    return graph.name or f"the graph ({graph.n} nodes)"

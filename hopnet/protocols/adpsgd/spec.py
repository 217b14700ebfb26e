"""AD-PSGD's declaration (:mod:`hopnet.protocols.adpsgd.protocol` is the algorithm)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hopnet.config import ProtocolConfig
from hopnet.output_spec import Count, OutputSpec, Wait
from hopnet.registry import Averages, MessageKind, ProtocolSpec, register
from hopnet.protocols.adpsgd.options import REPLY, REQUEST, AdPsgdOptions, check_bipartite

if TYPE_CHECKING:
    import torch

    from hopnet.model_state import ModelState
    from hopnet.params import FlatGradients
    from hopnet.protocols.base import Protocol


def _no_notes(_: object) -> list[str]:
    return []


def _build(config: ProtocolConfig, options: AdPsgdOptions, model: ModelState | None,
           grads: FlatGradients | torch.Tensor | None) -> Protocol:
    from hopnet.protocols.adpsgd.protocol import AdPsgdProtocol

    return AdPsgdProtocol(config, model, options)


AD_PSGD_OUTPUT = OutputSpec(
    waits=(Wait("wait_updates_s", "wait for partner", "wait partner"),),
    counts=(Count("role", "role", "tally"), Count("averagings", "averagings"),
            Count("averagings_served", "averagings served"), Count("averagings_skipped", "averagings skipped")),
    gaps="all")


register(ProtocolSpec(
    name="ad-psgd",
    between_replicas=True,
    summary="asynchronous pairwise model averaging (AD-PSGD) on a bipartite graph: active workers average "
            "with one random passive neighbour per iteration.",
    options=AdPsgdOptions,
    build=_build,
    averages=Averages.MODELS,
    uses_graph=True,
    message_kinds=(MessageKind(REQUEST), MessageKind(REPLY)),
    check_graph=lambda config, options, graph: _no_notes(check_bipartite(graph)),
    resumable=True,
    restartable=True,
    restarts_replicas=True,
    output=AD_PSGD_OUTPUT,
))


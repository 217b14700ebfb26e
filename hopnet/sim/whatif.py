"""The report's predictions: simulate a run's :class:`~hopnet.report.diagnosis.Scenario` under other options.

Each rank computes its measured median step (``--slowdown`` stretches it as in the run), each
link that was waited on takes its measured transfer time as latency, every other link the
fastest one's; a lossy or jittery link also loses and jitters as measured
(:mod:`hopnet.transports.link_faults`). The predicted time of a config is the virtual time until every worker finished
the scenario's iterations, so options compare as ratios on the same model of this run.
"""

from __future__ import annotations

from collections.abc import Sequence

from hopnet.config import ProtocolConfig
from hopnet.errors import HopnetError
from hopnet.report.diagnosis import Scenario
from hopnet.sim.engine import ComputeModel, SimSpec, simulate
from hopnet.transports.inproc import LinkModel
from hopnet.transports.link_faults import LinkFaults

VIRTUAL_TIMEOUT_S = 1e5


def _compute_model(scenario: Scenario) -> ComputeModel:
    model = ComputeModel("const", 0.0)
    for rank, seconds in sorted(scenario.compute_s.items()):
        model = model.with_rank(rank, ComputeModel("const", max(0.0, seconds)))
    return model


def _link_model(scenario: Scenario) -> LinkModel:
    return LinkModel(latency_s=scenario.default_link_s,
                     overrides={link: (seconds, 0.0) for link, seconds in scenario.link_s.items()},
                     link_faults={link: LinkFaults(*faults) for link, faults in scenario.link_faults.items()})


def simulated_seconds(scenario: Scenario, config: ProtocolConfig) -> float | None:
    """Virtual seconds for every worker to finish the scenario's iterations under ``config``;
    ``None`` when the simulation fails (a deadlock or a wait that timed out)."""
    # In virtual time a long wait costs nothing real: let a wait last as long as the slowest step needs.
    timeout = max(config.timeout_s, VIRTUAL_TIMEOUT_S)
    spec = SimSpec(graph=scenario.graph, config=config.replace(timeout_s=timeout), iterations=scenario.iterations,
                   compute=_compute_model(scenario), link=_link_model(scenario), gap_matrix=False,
                   model_bytes=scenario.message_bytes)
    try:
        result = simulate(spec)
    except HopnetError:
        return None
    if min(result.iterations, default=0) < scenario.iterations:
        return None
    return result.virtual_time


def predict(scenario: Scenario, configs: Sequence[ProtocolConfig]) -> list[float | None]:
    """:data:`hopnet.report.diagnosis.Predictor`: the simulated run time under each config."""
    return [simulated_seconds(scenario, config) for config in configs]


__all__ = ["predict", "simulated_seconds"]

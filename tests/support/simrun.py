"""A run directory written from a simulated run: the workers' event records as `hopnet launch`
would leave them (rank logs, graph.json, launch.json), in virtual time, in a fraction of a second."""

from __future__ import annotations

import json
from pathlib import Path

from hopnet.config import ProtocolConfig
from hopnet.graph import Graph
from hopnet.sim.engine import ComputeModel, SimSpec, simulate
from hopnet.transports.inproc import LinkModel


def write_sim_run(run_dir: Path, graph: Graph, config: ProtocolConfig, *, compute_ms: float = 10.0,
                  link: LinkModel | None = None, iterations: int = 60) -> Path:
    result = simulate(SimSpec(graph=graph, config=config, iterations=iterations,
                              compute=ComputeModel.parse(str(compute_ms)), link=link or LinkModel(), keep_events=True))
    assert result.events is not None
    run_dir.mkdir(parents=True, exist_ok=True)
    for rank, recs in enumerate(result.events):
        (run_dir / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    graph.to_json(run_dir / "graph.json")
    (run_dir / "launch.json").write_text(json.dumps({"config": json.loads(config.to_json())}))
    return run_dir

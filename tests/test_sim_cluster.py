"""The simulator at cluster scale: gaps without the n x n matrix, and links per machine pair.

Scale itself is a benchmark (bench/simulator.py); these check, at small n, the properties the
large runs rely on. Every number asserted is virtual time, so deterministic.
"""

from __future__ import annotations

import json

import pytest

from hopnet import Graph, ProtocolConfig
from hopnet.analysis import GapTracker
from hopnet.cli.main import main
from hopnet.errors import ConfigError
from hopnet.sim.engine import ComputeModel, SimSpec, simulate
from hopnet.sim.links import apply_rules, parse_rules
from hopnet.transports.inproc import LinkModel


def cli(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code)


# ---------------------------------------------------------------------------- the largest gap
def _straggling_spec(gap_matrix: bool | None) -> SimSpec:
    compute = ComputeModel.parse("exp:10").with_rank(2, ComputeModel.parse("40"))
    cfg = ProtocolConfig(backup_workers=1, max_ig=3, slowdown=["random:4:0.2"], seed=5)
    return SimSpec(Graph.ring_based(10), cfg, 40, compute, gap_matrix=gap_matrix)


def test_largest_gap_is_the_matrix_maximum_at_its_first_pair():
    r = simulate(_straggling_spec(True))
    assert r.max_gap is not None
    gap, i, j = r.largest_gap
    flat = int(r.max_gap.argmax())
    assert (i, j) == divmod(flat, r.n)
    assert gap == r.max_gap.max() >= 2  # the straggler let its neighbours get ahead


def test_without_the_matrix_the_run_and_its_largest_gap_are_the_same():
    full, lean = simulate(_straggling_spec(True)), simulate(_straggling_spec(False))
    assert lean.max_gap is None
    assert lean.largest_gap == full.largest_gap
    a, b = full.to_dict(), lean.to_dict()
    assert b.pop("max_gap") is None and a.pop("max_gap") is not None
    assert a == b


def test_gap_tracker_names_the_first_pair_in_rank_order():
    t = GapTracker(4, matrix=False)
    t.entered(3, 1)  # 3 is one ahead of 0, 1 and 2
    assert t.largest == (1, 3, 0)
    t.entered(1, 1)
    assert t.largest == (1, 1, 0)  # the same gap, by an earlier pair
    t.entered(0, 1)
    t.entered(2, 1)
    t.entered(3, 3)  # everyone else in 1
    assert t.largest == (2, 3, 0)
    t.entered(0, 2)
    t.entered(1, 3)  # 2 is the one left behind now
    assert t.largest == (2, 1, 2)


def test_cli_gap_matrix_never_keeps_the_summary(tmp_path, capsys):
    argv = ["simulate", "--graph", "ring_based:8", "--iterations", "20", "--compute-ms", "exp:10",
            "--compute-ms-rank", "2:30"]
    assert main(argv + ["--json", str(tmp_path / "a.json")]) == 0
    with_matrix = capsys.readouterr().out
    assert main(argv + ["--gap-matrix", "never", "--json", str(tmp_path / "b.json")]) == 0
    without = capsys.readouterr().out
    assert with_matrix.split("wall clock:")[0] == without.split("wall clock:")[0]
    a, b = (json.loads((tmp_path / name).read_text()) for name in ("a.json", "b.json"))
    assert len(a["max_gap"]) == 8 and b["max_gap"] is None
    assert a["largest_gap"] == b["largest_gap"] and a["largest_gap"]["gap"] >= 1


# ---------------------------------------------------------------------------- links per machine pair
TWO_MACHINES = Graph.hierarchical([4, 4])  # m0 = ranks 0-3, m1 = ranks 4-7; only 0 <-> 4 crosses
ITERATIONS = 20
COMPUTE_S = 0.010


def _two_machine_run(latency_ms: float, gbps: float = 0, model_mb: float = 0):
    rules = parse_rules({"links": [{"between": ["m0", "m1"], "latency_ms": latency_ms, "gbps": gbps}]},
                        TWO_MACHINES)
    link = apply_rules(LinkModel(latency_s=1e-4), rules, TWO_MACHINES)
    return simulate(SimSpec(TWO_MACHINES, ProtocolConfig(), ITERATIONS, ComputeModel.parse("10"), link=link,
                            model_bytes=int(model_mb * 1_000_000)))


@pytest.mark.parametrize("latency_ms,gbps,model_mb,cross_s", [
    (0, 0, 0, 0.0),
    (5, 0, 0, 0.005),     # hidden behind the 10 ms compute
    (50, 0, 0, 0.050),
    (0, 1, 10, 0.080),    # 10 MB at 1 Gbit/s
    (20, 1, 10, 0.100),
])
def test_a_slow_link_between_machines_sets_the_iteration_time(latency_ms, gbps, model_mb, cross_s):
    # Under Hop's defaults every worker waits, through its neighbours, for the update that crosses
    # between the machines; it was sent when the iteration began, so an iteration takes the longer
    # of the compute and the crossing. The links inside a machine take 0.1 ms, also hidden.
    r = _two_machine_run(latency_ms, gbps, model_mb)
    assert r.virtual_time == pytest.approx(ITERATIONS * max(COMPUTE_S, cross_s))
    assert r.iterations == [ITERATIONS] * 8


def test_link_model_precedence_and_partial_rules():
    g = Graph.hierarchical([2, 2, 2])
    rules = parse_rules({"links": [
        {"between": ["*", "*"], "latency_ms": 1, "gbps": 100},
        {"between": [["m0", "m1"], "m2"], "latency_ms": 30},
        {"between": ["m2", "m0"], "gbps": 2},
    ]}, g)
    link = apply_rules(LinkModel(latency_s=0.5, bytes_per_s=7.0, overrides={(0, 1): (9.0, 9.0)}), rules, g)
    assert link.params(0, 1) == (9.0, 9.0)                 # a per-rank override first
    assert link.params(2, 3) == (0.001, 100e9 / 8)         # m1 -> m1: the "*" rule
    assert link.params(2, 4) == (0.030, 100e9 / 8)         # m1 -> m2: latency from the second rule
    assert link.params(4, 0) == (0.030, 2e9 / 8)           # m2 -> m0: the third sets only the bandwidth
    assert link.params(0, 4) == (0.030, 2e9 / 8)           # rules name both directions
    assert link.params(-1, 0) == (0.5, 7.0)                # the coordinator's links keep the defaults


@pytest.mark.parametrize("doc,message", [
    ({"links": [{"between": ["m0", "m9"], "latency_ms": 1}]}, "no node of the graph is on machine 'm9'"),
    ({"links": [{"between": ["m0"], "latency_ms": 1}]}, "a list of two sides"),
    ({"links": [{"between": ["m0", "m1"]}]}, "sets neither latency_ms nor gbps"),
    ({"links": [{"between": ["m0", "m1"], "gbps": -1}]}, "gbps must be a finite number >= 0"),
    ({"links": [{"between": ["m0", "m1"], "latency": 1}]}, "unknown key 'latency'"),
    ({"rules": []}, 'expected {"links": [RULE, ...]}'),
])
def test_bad_link_models_are_refused(doc, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("{", r"\{")):
        parse_rules(doc, TWO_MACHINES)


def test_cli_link_model_file(tmp_path, capsys):
    model = tmp_path / "links.json"
    model.write_text(json.dumps({"links": [{"between": ["m0", "m1"], "latency_ms": 50}]}))
    out = tmp_path / "r.json"
    assert main(["simulate", "--graph", "hierarchical:4,4", "--iterations", "10", "--link-model", str(model),
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["link"]["rules"] == [{"between": ["m0", "m1"], "latency_ms": 50.0}]
    assert data["virtual_time"] == pytest.approx(10 * 0.050)
    capsys.readouterr()
    model.write_text(json.dumps({"links": [{"between": ["m0", "dc-west"], "latency_ms": 50}]}))
    assert cli(["simulate", "--graph", "hierarchical:4,4", "--link-model", str(model)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "no node of the graph is on machine 'dc-west'" in err[0], err


def test_two_datacentres_as_in_the_readme():
    # hierarchical:2,2,2,2: machines m0-m3 joined in a ring m0-m1-m2-m3-m0, so m1-m2 and m3-m0 cross
    # between the datacentres {m0, m1} and {m2, m3}; 30 ms outweighs the 10 ms compute.
    doc = {"links": [{"between": ["*", "*"], "latency_ms": 0.05, "gbps": 100},
                     {"between": [["m0", "m1"], ["m2", "m3"]], "latency_ms": 30, "gbps": 1}]}
    g = Graph.hierarchical([2, 2, 2, 2])
    link = apply_rules(LinkModel(), parse_rules(doc, g), g)
    r = simulate(SimSpec(g, ProtocolConfig(), 10, ComputeModel.parse("10"), link=link))
    assert r.virtual_time == pytest.approx(10 * 0.030)

"""Churn in the simulator (`hopnet simulate --churn/--churn-rate`): each change is a new view over the
re-formed graph, begun at one iteration for every member. Every number asserted is virtual time."""

from __future__ import annotations

import json

import pytest

from hopnet import Graph, ProtocolConfig
from hopnet.cli.main import main
from hopnet.errors import ConfigError
from hopnet.graph.reform import BuilderSpec
from hopnet.sim.churn import ChurnEvent, parse_schedule
from hopnet.sim.engine import ComputeModel, SimSpec, simulate
from hopnet.sim.plot import throughput_series


def cli(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code)


# ---------------------------------------------------------------------------- the schedule
def test_a_schedule_parses_in_time_order():
    schedule = parse_schedule(["join:2@30s, leave:rank3@1", "leave:1@500ms"], "join=0.5")
    assert [(e.kind, e.at_s, e.count, e.rank) for e in schedule.events] == [
        ("leave", 0.5, 1, None), ("leave", 1.0, 1, 3), ("join", 30.0, 2, None)]
    assert (schedule.join_rate, schedule.leave_rate, schedule.explicit_joins) == (0.5, 0.0, 2)
    assert schedule.events[0] == ChurnEvent("leave", 0.5, 1, None, "leave:1@500ms")


@pytest.mark.parametrize(("argv", "says"), [
    (["--churn", "jump:1@1s"], "expected join:K@T"),
    (["--churn", "join:0@1s"], "K must be >= 1"),
    (["--churn", "leave:4@1s"], "would leave no worker"),
    (["--churn", "leave:rank7@1s"], "rank 7 is not a member"),
    (["--churn-rate", "join=fast"], "is not a number"),
    (["--churn", "join:1@1s", "--graph", "torus:2x2"], "cannot take 5 workers"),
    (["--churn", "join:1@1s", "--graph", "examples/ring.json"], "is a fixed graph"),
    (["--churn", "join:2@1s,leave:4@1s"], "no member of the view before would stay"),
    (["--churn", "join:1@1s", "--protocol", "prague"], "runs with a coordinator"),
    (["--churn", "join:1@1s", "--protocol", "ad-psgd"], "drift apart"),
    (["--churn", "join:1@1s", "--stop", "1:3"], "leave:rankR@T"),
])
def test_a_bad_schedule_is_refused_in_one_line(argv, says, capsys):
    assert cli(["simulate", "--nproc", "4", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("hopnet simulate: error: --churn") and says in err[-1], err


def test_a_fixed_graph_spec_refuses_churn():
    with pytest.raises(ConfigError, match="fixed graph"):
        simulate(SimSpec(Graph.ring(4), ProtocolConfig(), 10, churn=parse_schedule(["join:1@0s"], None)))


# ---------------------------------------------------------------------------- views
def _ring_run(**options: object):
    churn = parse_schedule(["join:2@0.2s,leave:rank1@0.5s"], None)
    return simulate(SimSpec(Graph.ring(6), ProtocolConfig(**options), 80, ComputeModel.parse("10"),
                            churn=churn, builder=BuilderSpec.parse("ring")))


def test_two_joins_and_a_leave_make_views_that_keep_iterating():
    r = _ring_run()
    views = r.views
    assert views is not None
    assert [(v["members"], v["joined"], v["left"]) for v in views] == [
        ([0, 1, 2, 3, 4, 5], [], []), ([0, 1, 2, 3, 4, 5, 6, 7], [6, 7], []), ([0, 2, 3, 4, 5, 6, 7], [], [1])]
    firsts = [v["iteration"] for v in views]
    assert firsts == sorted(firsts) and firsts[1] == 21 and firsts[2] == 51  # two past where the members were
    assert r.n == 8 and r.iterations == [80, 51, 80, 80, 80, 80, 80, 80]  # rank 1 ran to the view's start
    assert len(r.finish_times[6]) == 80 - 21  # the joiners from their view's first iteration on
    assert not r.churn_skipped


def test_throughput_rises_with_a_join_of_equal_speed_workers_and_falls_with_a_leave():
    views = _ring_run().views
    assert views is not None
    before, grown, shrunk = (v["throughput"] for v in views)
    assert grown == pytest.approx(before * 8 / 6) and shrunk == pytest.approx(before * 7 / 6)


def test_a_view_begins_at_the_protocols_safe_point():
    r = simulate(SimSpec(Graph.ring(4), ProtocolConfig(protocol="diloco", local_steps=4), 40,
                         churn=parse_schedule(["join:1@0.05s"], None), builder=BuilderSpec.parse("ring")))
    assert r.views is not None and [v["iteration"] for v in r.views] == [0, 8]  # 5 + 2, moved to an outer round
    assert r.iterations == [40] * 5 and len(r.finish_times[4]) == 32


def test_a_collective_protocol_goes_through_the_changes_and_the_json_repeats(tmp_path, capsys):
    argv = ["simulate", "--protocol", "allreduce", "--nproc", "4", "--iterations", "40", "--compute-ms", "exp:10",
            "--model-mb", "1", "--link-gbps", "10", "--churn-rate", "join=20,leave=10", "--seed", "3"]
    a, b, png = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "t.png"
    assert cli([*argv, "--json", str(a), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert cli([*argv, "--json", str(b)]) == 0
    assert a.read_bytes() == b.read_bytes()
    data = json.loads(a.read_text())
    assert len(data["views"]) >= 3 and data["churn"]["rates"] == {"join": 20.0, "leave": 10.0}
    last = data["views"][-1]
    assert all(data["iterations"][rank] == 40 for rank in last["members"])
    assert f"views:             {len(data['views'])}" in out and "  view 1: " in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_throughput_series_spreads_each_step_over_its_time():
    edges, rates = throughput_series([[0.1, 0.2, 0.3, 0.4], [0.2, 0.4]], [0.0, 0.0], 0.4, bins=4)
    assert edges == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert rates == pytest.approx([15.0, 15.0, 15.0, 15.0])

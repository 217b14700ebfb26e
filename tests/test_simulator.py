"""The virtual-time simulator (hopnet.sim.engine.simulate) and the `hopnet simulate` command."""

from __future__ import annotations

import json
import re

import pytest
import torch

from hopnet import Graph, ProtocolConfig
from hopnet.cli.main import main
from hopnet.errors import PeerFailure
from hopnet.sim.engine import ComputeModel, SimResult, SimSpec, simulate


def mean_rate(r: SimResult, ranks) -> float:
    return sum(r.rates[i] for i in ranks) / len(ranks)


# ---------------------------------------------------------------------------- determinism
def _random_spec(seed: int) -> SimSpec:
    compute = ComputeModel.parse("exp:10").with_rank(2, ComputeModel.parse("uniform:5:30"))
    cfg = ProtocolConfig(backup_workers=1, max_ig=3, slowdown=["random:4:0.2"], seed=seed)
    return SimSpec(Graph.ring_based(8), cfg, 40, compute, param_dim=4)


def test_same_spec_and_seed_give_identical_results():
    a = simulate(_random_spec(7)).to_dict()
    b = simulate(_random_spec(7)).to_dict()
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert "wall_seconds" not in a


def test_different_seed_gives_different_finish_times():
    a = simulate(_random_spec(7))
    b = simulate(_random_spec(8))
    assert a.finish_times != b.finish_times
    assert a.iterations == b.iterations == [40] * 8


def test_cli_json_is_byte_identical(tmp_path, capsys):
    argv = ["simulate", "--graph", "ring_based:8", "--iterations", "40", "--compute-ms", "exp:10",
            "--compute-ms-rank", "3:uniform:5:25", "--slowdown", "random:4:0.1", "--backup-workers", "1",
            "--link-latency-ms", "0.5", "--link-gbps", "10", "--model-mb", "4", "--seed", "11"]
    f1, f2, f3 = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    assert main(argv + ["--json", str(f1)]) == 0
    assert main(argv + ["--json", str(f2)]) == 0
    assert f1.read_bytes() == f2.read_bytes()
    assert main(argv[:-1] + ["12", "--json", str(f3)]) == 0  # another seed
    assert json.loads(f3.read_text())["finish_times"] != json.loads(f1.read_text())["finish_times"]
    assert "wall" not in f1.read_text()


# ---------------------------------------------------------------------------- a worker leaves for good
def test_backup_workers_keep_training_when_a_worker_stops():
    spec = SimSpec(Graph.ring_based(8), ProtocolConfig(backup_workers=1), 60, stop_at={3: 10})
    r = simulate(spec)
    for rank in range(8):
        assert len(r.finish_times[rank]) == (10 if rank == 3 else 60), rank
    assert [r.iterations[i] for i in range(8) if i != 3] == [60] * 7


def test_without_backup_workers_a_stopped_worker_is_named():
    spec = SimSpec(Graph.ring_based(8), ProtocolConfig(), 60, stop_at={3: 10})
    with pytest.raises(PeerFailure) as info:
        simulate(spec)
    # Rank 3 sent its update of iteration 10 when it entered it (parallel approach), then left:
    # its neighbours finish iteration 10 and cannot finish 11.
    message = str(info.value)
    assert re.fullmatch(r"rank [2478] cannot finish iteration 11: peer 3 left at iteration 10, before its last "
                        r"iteration 59, and rank [2478] needs 3 of its 3 in-neighbours' updates with 0 backup "
                        r"workers", message), message
    assert (info.value.peer, info.value.peer_state, info.value.iteration) == (3, "departed", 11)


# ---------------------------------------------------------------------------- iteration skipping
def test_skipping_lets_the_others_recover_from_a_deterministic_straggler():
    """ring_based:16, rank 0 always 4x slower, one backup worker, max_ig 4 (Hop Sec. 5)."""
    g = Graph.ring_based(16)
    compute = ComputeModel.parse("10")
    others = range(1, 16)

    def rate(**options) -> SimResult:
        return simulate(SimSpec(g, ProtocolConfig(backup_workers=1, max_ig=4, **options), 100, compute))

    fast = rate()
    slow = rate(slowdown=["rank=0:4"])
    skip = rate(slowdown=["rank=0:4"], skip_threshold=2, max_jump=4)
    r_fast, r_slow, r_skip = mean_rate(fast, others), mean_rate(slow, others), mean_rate(skip, others)
    # measured: r_fast = 100/s, r_slow = 27.6/s (the straggler's 25/s drags everyone), r_skip = 100/s
    assert r_slow < 0.4 * r_fast
    assert r_skip >= 0.8 * r_fast
    assert r_skip > 1.2 * r_slow
    assert fast.skips == [] and slow.skips == []
    assert skip.skips and {e["rank"] for e in skip.skips} == {0}
    for e in skip.skips:
        assert 1 < e["to"] - e["iter"] <= 1 + 4  # at most max_jump iterations skipped
        assert e["behind"] > 2
    skipped = sum(e["to"] - e["iter"] - 1 for e in skip.skips)
    assert len(skip.finish_times[0]) + skipped == 100
    assert skip.iterations == [100] * 16


# ---------------------------------------------------------------------------- averaging
@pytest.mark.parametrize("graph", [Graph.ring(8), Graph.ring_based(8), Graph.torus(3, 3)], ids=lambda g: g.name)
def test_gossip_without_gradients_converges_to_the_initial_mean(graph):
    n = graph.n
    cfg = ProtocolConfig(seed=5)
    # Every worker leaving before iteration 0 returns the initial parameters untouched.
    initial = simulate(SimSpec(graph, cfg, 1, param_dim=16, stop_at={r: 0 for r in range(n)})).params
    assert initial is not None and len(initial) == n
    assert not torch.allclose(initial[0], initial[1])
    mean = torch.stack(initial).mean(dim=0)
    assert graph.is_doubly_stochastic()
    final = simulate(SimSpec(graph, cfg, 150, ComputeModel.parse("uniform:5:15"), param_dim=16)).params
    assert final is not None
    for rank, p in enumerate(final):
        assert torch.allclose(p, mean, rtol=0, atol=1e-6), (rank, (p - mean).abs().max())


# ---------------------------------------------------------------------------- the command
def test_cli_writes_json_and_summary(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["simulate", "--graph", "ring_based:8", "--iterations", "30", "--compute-ms", "uniform:5:15",
                 "--max-ig", "3", "--stop", "5:20", "--backup-workers", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ring_based:8 (8 workers)" in text and "largest gap:" in text and "wall clock:" in text
    data = json.loads(out.read_text())
    assert len(data["rates"]) == 8 and all(r > 0 for r in data["rates"])
    assert len(data["max_gap"]) == 8 and all(len(row) == 8 for row in data["max_gap"])
    assert len(data["finish_times"]) == 8 and len(data["finish_times"][0]) == 30
    assert len(data["finish_times"][5]) == 20
    for key in ("queue_high_water", "token_high_water"):
        assert len(data[key]) == 8
    assert data["skips"] == []
    assert data["graph"] == "ring_based:8" and data["n"] == 8 and data["requested_iterations"] == 30
    assert data["config"]["max_ig"] == 3 and data["config"]["backup_workers"] == 1
    assert data["compute"]["spec"] == "uniform:5:15" and data["seed"] == 0
    assert data["stop"] == {"5": 20}
    assert list(data) == sorted(data)


def test_cli_default_graph_and_json_to_stdout(capsys):
    assert main(["simulate", "--nproc", "5", "--iterations", "10", "--link-latency-ms", "2",
                 "--link-gbps", "1", "--model-mb", "2", "--json", "-"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)  # nothing but the JSON on stdout
    assert data["graph"] == "ring:5" and len(data["rates"]) == 5
    assert data["link"]["latency_s"] == 0.002 and data["link"]["bytes_per_s"] == 1e9 / 8
    assert data["model_bytes"] == 2_000_000
    # The update sent on entering an iteration takes 2 MB / 1 Gbit/s = 16 ms plus 2 ms latency to
    # arrive, longer than the 10 ms compute: every iteration takes 18 ms.
    assert data["finish_times"][0][0] == pytest.approx(0.018)
    assert data["virtual_time"] == pytest.approx(10 * 0.018)
    assert "largest gap:" in captured.err


def cli(argv: list[str]) -> int:
    """``main(argv)``'s exit code, also when argparse exits."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code)


@pytest.mark.parametrize("argv", [
    ["--iterations", "0"],
    ["--iterations", "-3"],
    ["--iterations", "x"],
    ["--compute-ms", "abc"],
    ["--compute-ms", "uniform:5"],
    ["--compute-ms", "uniform:9:5"],
    ["--compute-ms-rank", "9:5"],
    ["--compute-ms-rank", "1"],
    ["--slowdown", "rank=99:2"],
    ["--slowdown", "random:0.5:0.1"],
    ["--link-latency-ms", "-1"],
    ["--link-gbps", "fast"],
    ["--model-mb", "-2"],
    ["--stop", "3"],
    ["--stop", "7:2"],
    ["--stop", "1:-1"],
    ["--graph", "ring_based:8", "--backup-workers", "4"],
    ["--backup-workers", "9:1"],
    ["--graph", "nosuch:8"],
    ["--graph", "missing.json"],
    ["--graph", "ring:4", "--nproc", "5"],
    ["--nproc", "0"],
    ["--max-ig", "0"],
    ["--max-ig", "abc"],
    ["--protocol", "gossip"],
    ["--skip-threshold", "2"],
    ["--json", "/nonexistent-dir/r.json"],
], ids=lambda a: " ".join(a))
def test_cli_bad_values_exit_2_with_one_line(argv, capsys):
    assert cli(["simulate", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hopnet simulate: error: "), captured.err


def test_cli_takes_no_prefix_of_a_flag(capsys):
    assert cli(["simulate", "--iter", "5"]) == 2  # not --iterations
    assert "unrecognized arguments: --iter 5" in capsys.readouterr().err


def test_cli_failed_run_exits_1_with_one_line(capsys):
    assert cli(["simulate", "--graph", "ring_based:8", "--iterations", "60", "--stop", "3:10"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.fullmatch(r"hopnet simulate: error: rank [2478] cannot finish iteration 11: peer 3 left at "
                        r"iteration 10, before its last iteration 59, and rank [2478] needs 3 of its 3 "
                        r"in-neighbours' updates with 0 backup workers\n", captured.err), captured.err


def test_cli_timeout_names_rank_peer_and_iteration(capsys):
    # Rank 0 computes for 2 s (virtual) while its neighbours give up after 0.5 s. They have its
    # update of iteration 0 (sent when it entered 0), so they wait in iteration 1.
    assert cli(["simulate", "--graph", "ring:4", "--iterations", "5", "--compute-ms-rank", "0:2000",
                "--timeout", "0.5"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.fullmatch(r"hopnet simulate: error: timed out waiting for updates \(rank [13]\) from peer 0 "
                        r"\(stalled\) in iteration 1 after 0\.5s\n", captured.err), captured.err

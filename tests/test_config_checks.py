"""Options checked against the graph before anything starts (hopnet.config_checks).

A refusal must be right: the simulator, which runs the real protocol code, shows that a
refused skip threshold never skips and that the threshold just below it does. And it
must look the same everywhere: `hopnet launch` (exit 2, one line, no run directory),
`hopnet simulate` and `hopnet.init`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hopnet import Graph, ProtocolConfig
from hopnet.cli.main import main as cli
from hopnet.config_checks import check_config_for_graph
from hopnet.protocols.hop.spec import largest_lead
from hopnet.errors import ConfigError
from hopnet.sim.engine import ComputeModel, SimSpec, simulate

from support.launch import run_launch

ROOT = Path(__file__).resolve().parent.parent
# Rank 0 is 30x slower than everyone else: the others run ahead as far as the protocol lets them.
STRAGGLER = ComputeModel.parse("1").with_rank(0, ComputeModel.parse("30"))


def directed_ring(n: int) -> Graph:
    return Graph(n, [(i, (i + 1) % n) for i in range(n)], name=f"directed_ring:{n}")


def message(config: ProtocolConfig, graph: Graph) -> str:
    with pytest.raises(ConfigError) as info:
        check_config_for_graph(config, graph)
    text = str(info.value)
    assert "\n" not in text
    return text


def test_hop_checks_need_no_path_length_matrix() -> None:
    # the n x n matrix would be 800 MB at 10,000 workers: the checks use Graph.back_lengths
    g = Graph.ring_based(64)
    for options in (dict(staleness=2), dict(staleness=30), dict(skip_threshold=2, staleness=3, max_ig=4, max_jump=2),
                    dict(token_queues=False, staleness=2)):
        check_config_for_graph(ProtocolConfig(**options), g)
    assert g._spl is None


# ---------------------------------------------------------------------------- skipping: refused means never skips
SKIP_CASES = [
    # (id, graph, options without the threshold, the largest lead any worker can have)
    ("backup, undirected: max_ig", Graph.ring(8), dict(backup_workers=1, max_ig=4), 4),
    ("staleness: s + 1", Graph.ring(8), dict(staleness=2, max_ig=4), 3),
    ("staleness capped by max_ig", Graph.ring(8), dict(staleness=5, max_ig=2), 2),
    ("backup, directed: max_ig * d(j, i)", directed_ring(6), dict(backup_workers=1, max_ig=2), 10),
]


@pytest.mark.parametrize("graph,options,lead", [c[1:] for c in SKIP_CASES], ids=[c[0] for c in SKIP_CASES])
def test_a_refused_skip_threshold_never_skips_and_the_one_below_does(graph, options, lead):
    assert largest_lead(ProtocolConfig(**options).options, graph) == lead
    refused = ProtocolConfig(**options, skip_threshold=lead, max_jump=2)
    assert f"--skip-threshold {lead} is never passed" in message(refused, graph)
    # run anyway, bypassing the check: nothing skips
    assert simulate(SimSpec(graph, refused, 80, STRAGGLER)).skips == []
    accepted = ProtocolConfig(**options, skip_threshold=lead - 1, max_jump=2)
    check_config_for_graph(accepted, graph)
    skips = simulate(SimSpec(graph, accepted, 80, STRAGGLER)).skips
    assert skips and {s["rank"] for s in skips} == {0}
    assert all(s["behind"] == lead for s in skips)  # the straggler was as far behind as the check says


def test_the_issue_example_is_refused():
    cfg = ProtocolConfig(backup_workers=1, skip_threshold=4, max_jump=3, max_ig=4)
    assert message(cfg, Graph.ring(4)) == (
        "--skip-threshold 4 is never passed: with --max-ig 4 no worker falls more than 4 iterations behind "
        "all its out-neighbours, so nothing would skip (use a threshold below 4)")


def test_skipping_without_backup_workers_or_staleness_is_refused():
    cfg = ProtocolConfig(skip_threshold=1, max_jump=3, max_ig=4)
    assert "without --backup-workers or --staleness" in message(cfg, Graph.ring(8))
    assert simulate(SimSpec(Graph.ring(8), cfg, 60, STRAGGLER)).skips == []


def test_skipping_with_max_ig_1_is_refused():
    cfg = ProtocolConfig(backup_workers=1, skip_threshold=1, max_jump=3, max_ig=1)
    assert "--max-ig 1 never skips" in message(cfg, directed_ring(6))
    assert simulate(SimSpec(directed_ring(6), cfg, 60, STRAGGLER)).skips == []


def test_max_jump_above_the_cap_is_accepted_with_a_note():
    cfg = ProtocolConfig(backup_workers=1, skip_threshold=2, max_jump=10, max_ig=4)
    notes = check_config_for_graph(cfg, Graph.ring_based(16))
    assert notes == ["--max-jump 10 acts as 3: a jump is capped at max_ig - 1 iterations (--max-ig 4)"]
    skips = simulate(SimSpec(Graph.ring(8), cfg, 80, STRAGGLER)).skips
    assert skips and max(s["to"] - s["iter"] - 1 for s in skips) == 3


# ---------------------------------------------------------------------------- staleness against max_ig
@pytest.mark.parametrize("serial", [False, True], ids=["parallel", "serial"])
def test_staleness_the_tokens_always_preempt_is_noted_and_only_changes_weights(serial):
    """With s >= max_ig (+1 serial) on an undirected graph the staleness bound never makes a
    worker wait: the simulator's timings are identical for any such s."""
    graph = Graph.ring_based(16)
    compute = ComputeModel.parse("exp:10")
    reach = 2 + (1 if serial else 0)
    results = []
    for s in (reach, reach + 3):
        cfg = ProtocolConfig(staleness=s, max_ig=2, serial=serial, slowdown=["random:6:0.0625"], seed=3)
        notes = check_config_for_graph(cfg, graph)
        assert len(notes) == 1 and notes[0].startswith(f"--staleness {s} never makes a worker wait")
        results.append(simulate(SimSpec(graph, cfg, 120, compute)).finish_times)
    assert results[0] == results[1]
    below = ProtocolConfig(staleness=reach - 1, max_ig=2, serial=serial)
    assert check_config_for_graph(below, graph) == []


def test_staleness_on_a_directed_graph_can_bind_further():
    # rank i is max_ig * d(i, j) = 2 * 5 ahead of its in-neighbour j at most: s = 5 still binds
    assert check_config_for_graph(ProtocolConfig(staleness=5, max_ig=2), directed_ring(6)) == []
    assert check_config_for_graph(ProtocolConfig(staleness=10, max_ig=2), directed_ring(6))


# ---------------------------------------------------------------------------- backup workers and ranks
def test_backup_workers_against_each_ranks_in_degree():
    assert message(ProtocolConfig(backup_workers=5), Graph.ring(4)) == (
        "--backup-workers 5: rank 0 of ring:4 has 2 in-neighbours, so it can go without at most 2 of their updates")
    check_config_for_graph(ProtocolConfig(backup_workers=2), Graph.ring(4))  # needs none: allowed (Fig. 8)
    # per rank: hierarchical graphs have uneven in-degrees
    g = Graph.hierarchical([4, 4])
    degrees = [len(g.in_peers(r)) for r in range(g.n)]
    low = degrees.index(min(degrees))
    check_config_for_graph(ProtocolConfig(backup_workers={low: min(degrees)}), g)
    text = message(ProtocolConfig(backup_workers={low: min(degrees) + 1}), g)
    assert text.startswith(f"--backup-workers {low}:{min(degrees) + 1}: rank {low} of ")
    check_config_for_graph(ProtocolConfig(backup_workers=1), directed_ring(4))
    assert "has 1 in-neighbour," in message(ProtocolConfig(backup_workers=2), directed_ring(4))


def test_options_naming_ranks_that_do_not_exist():
    assert "rank 9 out of range" in message(ProtocolConfig(backup_workers={9: 1}), Graph.ring(4))
    assert "rank" in message(ProtocolConfig(slowdown=["rank=7:3"]), Graph.ring(4))


def test_notify_ack_takes_no_hop_options():
    for option in (dict(staleness=1), dict(backup_workers=1), dict(max_ig=4), dict(token_queues=False)):
        with pytest.raises(ConfigError, match=r"option\(s\) that --protocol notify-ack does not take \(taken by hop\)"):
            ProtocolConfig(protocol="notify-ack", **option)
    assert check_config_for_graph(ProtocolConfig(protocol="notify-ack", serial=True), directed_ring(4)) == []


# ---------------------------------------------------------------------------- the same line everywhere
REFUSED = [
    ["--backup-workers", "5"],
    ["--backup-workers", "3:3"],
    ["--backup-workers", "7:1"],
    ["--backup-workers", "0:1,0:1"],
    ["--backup-workers", "1", "--skip-threshold", "4", "--max-jump", "3", "--max-ig", "4"],
    ["--skip-threshold", "1", "--max-jump", "3"],
    ["--staleness", "1", "--skip-threshold", "2", "--max-jump", "3", "--max-ig", "4"],
    ["--slowdown", "rank=4:2"],
]


@pytest.mark.parametrize("flags", REFUSED, ids=lambda a: " ".join(a))
def test_launch_and_simulate_refuse_with_the_same_line_and_no_run_dir(flags, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    run_dir = tmp_path / "run"
    assert cli(["launch", "--nproc", "4", *flags, "--run-dir", str(run_dir), str(script)]) == 2
    launch_err = capsys.readouterr()
    assert cli(["simulate", "--nproc", "4", *flags, "--iterations", "5"]) == 2
    sim_err = capsys.readouterr()
    assert launch_err.out == "" and sim_err.out == ""
    (launch_line,) = launch_err.err.splitlines()
    (sim_line,) = sim_err.err.splitlines()
    assert launch_line.startswith("hopnet launch: error: ")
    assert launch_line.removeprefix("hopnet launch: error: ") == sim_line.removeprefix("hopnet simulate: error: ")
    assert not run_dir.exists() and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_launch_refuses_before_spawning_anything(tmp_path):
    """The issue's case: `--backup-workers 5` on a ring, refused at once, as a user runs it."""
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    proc = run_launch(["--nproc", "4", "--backup-workers", "5", "--run-dir", str(tmp_path / "run"), str(script)],
                      cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["hopnet launch: error: --backup-workers 5: rank 0 of ring:4 has 2 "
                                        "in-neighbours, so it can go without at most 2 of their updates"]
    assert not (tmp_path / "run").exists() and not marker.exists()


@pytest.mark.slow
def test_init_refuses_options_from_code_with_the_same_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, hopnet\n"
        "from hopnet.errors import ConfigError\n"
        "try:\n"
        "    hopnet.init(params=torch.zeros(4), backup_workers=5)\n"
        "except ConfigError as exc:\n"
        "    print('REFUSED', exc, flush=True)\n"
        "    raise SystemExit(7)\n"
        "print('ACCEPTED', flush=True)\n")
    proc = run_launch(["--nproc", "2", "--timeout", "30", "--run-dir", str(tmp_path / "run"), str(script)],
                      cwd=tmp_path, timeout=180)
    assert proc.returncode == 1, proc.stderr
    expected = message(ProtocolConfig(backup_workers=5), Graph.ring(2))
    refused = [line for line in proc.stdout.splitlines() if "REFUSED" in line]
    assert refused and all(line.endswith("REFUSED " + expected) for line in refused), proc.stdout
    assert "ACCEPTED" not in proc.stdout


@pytest.mark.slow
def test_init_refuses_coordinator_options_from_code(tmp_path):
    """`hopnet launch` built the coordinator from its flags before the script ran: a group size
    set in code would leave it forming groups of another size."""
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, hopnet\n"
        "from hopnet.errors import ConfigError\n"
        "try:\n"
        "    hopnet.init(params=torch.zeros(4), group_size=2)\n"
        "except ConfigError as exc:\n"
        "    print('REFUSED', exc, flush=True)\n"
        "    raise SystemExit(7)\n"
        "print('ACCEPTED', flush=True)\n")
    proc = run_launch(["--nproc", "3", "--timeout", "30", "--protocol", "prague", "--group-generator", "random",
                       "--run-dir", str(tmp_path / "run"), str(script)], cwd=tmp_path, timeout=180)
    assert proc.returncode == 1, proc.stderr
    refused = [line for line in proc.stdout.splitlines() if "REFUSED" in line]
    assert refused and all(line.endswith(
        "REFUSED group_size=2 in hopnet.init(): the run's coordinator was started by `hopnet launch` from its "
        "flags before this worker ran; pass --group-size 2 to `hopnet launch` instead") for line in refused), proc.stdout
    assert "ACCEPTED" not in proc.stdout

"""Each protocol's output shows its own quantities and none of another's (issue 19, "Output that
fits the protocol"): `hopnet simulate`'s summary, and the launcher's summary table and `hopnet
report` built from run directories the simulator recorded (the same event records a real run's
workers write; the ``enter`` records, which only real workers write, are put back from the
iteration records)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hopnet import Graph, ProtocolConfig, registry
from hopnet.cli.main import main as cli
from hopnet.report import plots
from hopnet.report.build import write_report
from hopnet.report.content import ReportContent, build_content
from hopnet.report.live import ProgressState
from hopnet.report.rundir import load_run_dir
from hopnet.report.stats import run_stats
from hopnet.report.summary import summary_text
from hopnet.report.trace import span_order
from hopnet.sim.engine import ComputeModel, SimSpec, simulate

from support.paths import ROOT

# protocol -> (options, what its outputs must say, the graph)
OWN: dict[str, tuple[dict[str, Any], tuple[str, ...], str]] = {
    "hop": ({}, ("wait tokens", "skips"), "ring:4"),
    "notify-ack": ({}, ("wait acks", "skips"), "ring:4"),
    "prague": ({}, ("wait group", "own groups", "groups served", "no syncs"), "ring:4"),
    "partial-reduce": ({"group_size": 2}, ("wait group", "groups"), "ring:4"),
    "eager-sgd": ({}, ("wait round", "rounds started", "late contributions"), "ring:4"),
    "pipe-sgd": ({}, ("wait all-reduce", "pipeline depth", "all-reduces in flight"), "ring:4"),
    "ad-psgd": ({}, ("wait partner", "role", "averagings", "averagings served"), "ring:4"),
    "allreduce": ({}, ("wait all-reduce",), "ring:4"),
    "diloco": ({"local_steps": 2}, ("wait outer", "outer steps", "local steps (H)"), "ring:4"),
}
HOP_LIKE = ("hop", "notify-ack")
IN_STEP = ("eager-sgd", "pipe-sgd", "allreduce")  # no iteration gap worth showing
NO_GRAPH = ("partial-reduce", "eager-sgd", "pipe-sgd", "allreduce", "diloco")  # the graph plays no part


def test_every_protocol_is_covered() -> None:
    built_in = {spec.name for spec in registry.specs() if spec.build.__module__.startswith("hopnet.protocols.")}
    assert set(OWN) == built_in  # (other tests register protocols of their own)


# ------------------------------------------------------------------ hopnet simulate
def simulate_text(protocol: str, capsys: pytest.CaptureFixture[str]) -> str:
    options, _, graph = OWN[protocol]
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in options.items()]
    assert cli(["simulate", "--protocol", protocol, "--graph", graph, "--iterations", "12",
                "--compute-ms-rank", "1:30", *flags]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("protocol", sorted(OWN))
def test_simulate_shows_what_matters_for_the_protocol(protocol: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = simulate_text(protocol, capsys)
    labels = [line.split(":", 1)[0] for line in text.splitlines()]
    hop_like = protocol in HOP_LIKE
    assert ("skips" in labels) == hop_like and ("queue high water" in labels) == hop_like
    assert ("token high water" in labels) == (protocol == "hop")  # notify-ack has no token queues
    assert ("largest gap" in labels) == (protocol not in IN_STEP)
    assert ("graph" in labels) == (protocol not in NO_GRAPH) and ("workers" in labels) == (protocol in NO_GRAPH)
    assert ("coordinator" in labels) == (protocol in ("prague", "partial-reduce"))
    own = {"prague": ("own groups", "groups served"), "partial-reduce": ("groups",),
           "eager-sgd": ("rounds started", "late contributions"),
           "pipe-sgd": ("pipeline depth", "all-reduces in flight"),
           "ad-psgd": ("role", "averagings", "averagings served"),
           "diloco": ("outer steps", "local steps (H)")}.get(protocol, ())
    assert set(own) <= set(labels), text


def test_simulate_names_the_coordinators_own_counts(capsys: pytest.CaptureFixture[str]) -> None:
    prague = [line for line in simulate_text("prague", capsys).splitlines() if line.startswith("coordinator:")]
    assert len(prague) == 1 and "groups formed" in prague[0] and "left out by the slow filter" in prague[0]
    reduce = [line for line in simulate_text("partial-reduce", capsys).splitlines() if line.startswith("coordinator:")]
    assert len(reduce) == 1 and "groups formed" in reduce[0] and "frozen-group repairs" in reduce[0]
    assert "slow filter" not in reduce[0]


def test_simulate_allreduce_prints_no_graph_and_no_queue(capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's case: `hopnet simulate --protocol allreduce` printed `graph: ring:8` and a queue high-water mark."""
    assert cli(["simulate", "--protocol", "allreduce", "--nproc", "8", "--iterations", "5"]) == 0
    text = capsys.readouterr().out
    assert "workers:           8\n" in text
    assert "graph" not in text and "queue" not in text and "token" not in text and "gap" not in text


# ------------------------------------------------------------------ recorded runs: summary and report
def recorded_run(run_dir: Path, protocol: str, iterations: int = 6) -> Path:
    """A run directory as `hopnet launch` leaves it, from the simulator's records: 4 workers, rank 1 slow."""
    options, _, graph_spec = OWN[protocol]
    graph = Graph.ring(int(graph_spec.split(":")[1]))
    config = ProtocolConfig(protocol, **options)
    compute = ComputeModel.parse("10").with_rank(1, ComputeModel.parse("30"))
    result = simulate(SimSpec(graph, config, iterations, compute, keep_events=True))
    assert result.events is not None
    run_dir.mkdir(parents=True)
    graph.to_json(run_dir / "graph.json")
    (run_dir / "launch.json").write_text(json.dumps({"config": json.loads(config.to_json()),
                                                     "result": {"returncode": 0}}))
    for rank, records in enumerate(result.events):
        with_entries = []
        for rec in records:
            with_entries.append(rec)
            if rec["event"] == "iteration":  # it enters the next iteration as its step ends
                with_entries.append({"event": "enter", "rank": rank, "t": rec["t"], "mono": rec["mono"],
                                     "iter": rec["iter"] + 1})
        first = next(i for i, rec in enumerate(with_entries) if rec["event"] == "start")
        with_entries.insert(first + 1, {**with_entries[first], "event": "enter", "iter": 0})
        (run_dir / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in with_entries))
    if result.coordinator is not None:
        (run_dir / "coordinator.jsonl").write_text(json.dumps({"event": "stop", "rank": None, "t": 0.0,
                                                               "mono": 0.0, **result.coordinator}) + "\n")
    return run_dir


def content_text(content: ReportContent) -> str:
    """Every word the report says: titles, paragraphs, captions, table headers and cells."""
    parts = [content.title, *(cell for row in content.overview.rows for cell in row)]
    for section in content.sections:
        parts += [section.title, *section.paragraphs]
        parts += [f"{figure.title} {figure.caption}" for figure in section.figures]
        for table in section.tables:
            parts += [*table.headers, *(cell for row in table.rows for cell in row)]
    return "\n".join(parts)


@pytest.fixture
def no_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """The report's words without drawing its figures (drawing is tested once, below)."""
    for name in ("iteration_plot", "time_split_plot", "gap_plot", "loss_plot"):
        monkeypatch.setattr(plots, name, lambda *args: b"")


@pytest.mark.parametrize("protocol", sorted(OWN))
def test_summary_and_report_show_what_matters_for_the_protocol(protocol: str, tmp_path: Path,
                                                              no_figures: None) -> None:
    run = load_run_dir(recorded_run(tmp_path / "run", protocol))
    _, own, _ = OWN[protocol]
    hop_like = protocol in HOP_LIKE

    table = summary_text(run_stats(run))
    header = table.splitlines()[0]
    assert all(label in header for label in own), table
    assert ("wait tokens" in header) == (protocol == "hop") and ("skips" in header) == hop_like
    assert header.split()[:3] == ["rank", "iterations", "it/s"] and header.split()[-2:] == ["dropped", "status"]
    assert ("coordinator:" in table) == (protocol in ("prague", "partial-reduce"))

    text = content_text(build_content(run))
    assert ("wait for tokens" in text) == (protocol == "hop")
    assert ("Table 1" in text) == hop_like  # the bound on neighbours' gaps is Hop's alone
    assert ("Iteration gaps" in text) == (protocol not in IN_STEP)
    assert ("between any two workers" in text) == (protocol not in IN_STEP and not hop_like)
    assert ("skips" in text) == hop_like
    progress = build_content(run).sections[0].tables[0].headers
    assert [h for h in progress if h.startswith("wait")] == [w.label for w in run.config.spec.output.waits]


def test_prague_report_names_the_group_waits_and_the_coordinators_counts(tmp_path: Path) -> None:
    """The issue's case: the Prague report applied Hop's Table 1 bound to ring neighbours. Figures drawn."""
    run_dir = recorded_run(tmp_path / "run", "prague")
    page, *_ = write_report(run_dir, fmt="md", trace=tmp_path / "trace.json")
    text = page.read_text()
    assert "wait for group" in text and "coordinator: groups formed" in text
    assert "coordinator: left out by the slow filter" in text
    assert "Table 1" not in text and "wait for tokens" not in text and "skips" not in text
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert "compute" in names and not names & {"wait for tokens", "wait for updates"}
    assert dict(span_order(load_run_dir(run_dir)))["wait_updates_s"] == "wait for group"


def test_the_declarations_are_the_only_place_a_protocol_is_named() -> None:
    """The summary, report and simulator read ``ProtocolSpec.output``: none of them names a protocol.
    (The report's diagnosis, hopnet/report/diagnosis.py, still names the protocols it suggests options of.)"""
    report = ROOT / "hopnet" / "report"
    sources = [*(report / f"{name}.py" for name in ("content", "gaps", "html", "live", "markdown", "plots", "rundir",
                                                    "stats", "summary", "trace")),
               ROOT / "hopnet" / "cli" / "simulate_cmd.py", *(ROOT / "hopnet" / "sim").glob("*.py")]
    for path in sources:
        text = path.read_text()
        for name in registry.names():
            assert f'"{name}"' not in text and f"'{name}'" not in text, f"{path.name} names {name}"


def test_live_status_line_counts_skips_only_for_a_protocol_that_skips() -> None:
    def start(protocol: str) -> dict[str, Any]:
        return {"event": "start", "rank": 0, "t": 0.0, "mono": 1.0, "config": {"protocol": protocol}}

    step = {"event": "iteration", "rank": 0, "t": 1.0, "mono": 2.0, "iter": 0}
    for protocol, shown in (("hop", True), ("eager-sgd", False), ("allreduce", False), ("prague", False)):
        state = ProgressState(1)
        state.add(0, [start(protocol), step])
        assert ("skips 0" in state.status_text()) == shown, (protocol, state.status_text())

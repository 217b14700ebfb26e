"""``hopnet simulate``: run a protocol on a graph in virtual time, without training.

    hopnet simulate [--graph G] [--nproc N] [protocol flags, as for `hopnet launch`]
                    [--iterations N] [--compute-ms SPEC] [--compute-ms-rank R:SPEC ...]
                    [--link-latency-ms MS] [--link-gbps G] [--link-loss P] [--link-jitter-ms MS]
                    [--link-model FILE]
                    [--model-mb MB] [--stop R:K ...] [--gap-matrix WHEN] [--json FILE|-]
                    [--churn EVENTS] [--churn-rate RATES] [--plot FILE.png]

Every worker is the real protocol object (see :mod:`hopnet.sim.engine`); only time is
modelled. A short summary goes to stdout (to stderr when ``--json -`` takes stdout).
The JSON (``SimResult.to_dict()`` plus the inputs, keys sorted) depends only on the
inputs and the seed, so two runs give the same bytes.

Exit status: 0 on success; 1 when the simulated run fails (deadlock, a wait that timed
out, a worker that cannot go on without a peer that left); 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import TYPE_CHECKING, Any


from hopnet.errors import ConfigError, HopnetError
from hopnet.output_spec import Count, combine, format_value, present
from hopnet.sim import GAP_MATRIX_MAX_N

if TYPE_CHECKING:  # the simulator (torch) is imported once the arguments are checked
    from hopnet.graph import Graph
    from hopnet.sim.engine import ComputeModel, SimResult, SimSpec

NAME = "simulate"
HELP = "run a protocol on a graph in virtual time (no training)"

DEFAULT_ITERATIONS = 100
DEFAULT_COMPUTE = "10"
BYTES_PER_MB = 1_000_000

DESCRIPTION = """\
Run N workers of a protocol on a communication graph in one process, in virtual
time: compute phases are virtual sleeps drawn from --compute-ms (stretched by
--slowdown), messages arrive after the link model's latency plus size over
bandwidth, plus what lost segments and jitter cost over TCP. Reports each worker's iteration rate and what matters for the protocol: for
Hop the largest iteration gap, skips, queue and token high-water marks; for group
protocols their groups and coordinator; for eager-SGD who started the rounds. The same
inputs and seed give byte-identical --json output.
"""

EPILOG = """\
compute time SPEC (milliseconds): MS (constant), uniform:LO:HI, exp:MEAN, normal:MEAN:SD.
churn: --churn "join:2@0.5s,leave:1@1s,leave:rank3@1500ms" (K workers join or leave, or rank R
leaves, at a virtual time in s or ms); --churn-rate join=0.5,leave=0.5 (Poisson arrivals per
virtual second, from --seed). Each change is a new view over the graph re-formed for its members.
exit status: 0 on success; 1 when the simulated run deadlocks, times out or fails
for want of a departed peer; 2 for bad arguments.
"""


def register(subparsers: Any) -> None:
    from hopnet.launch.spec import DEFAULT_NPROC

    parser = subparsers.add_parser(
        NAME,
        help=HELP,
        description=DESCRIPTION,
        epilog=EPILOG,
        allow_abbrev=False,  # as for `hopnet launch`: a flag is taken whole, never as a prefix of another
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sim = parser.add_argument_group("simulation")
    sim.add_argument("--graph", default=None, metavar="G",
                     help="graph JSON file or builder spec such as ring:8, ring_based:16, torus:2x4 "
                          "(default: a ring over --nproc workers)")
    sim.add_argument("--nproc", default=None, metavar="N",
                     help=f"number of workers (default: the graph's size, or {DEFAULT_NPROC} without --graph)")
    sim.add_argument("--iterations", default=str(DEFAULT_ITERATIONS), metavar="N",
                     help=f"iterations every worker runs (default: {DEFAULT_ITERATIONS})")
    sim.add_argument("--compute-ms", default=DEFAULT_COMPUTE, metavar="SPEC",
                     help="compute time per iteration in ms: MS, uniform:LO:HI, exp:MEAN or "
                          f"normal:MEAN:SD (default: {DEFAULT_COMPUTE})")
    sim.add_argument("--compute-ms-rank", action="append", default=[], metavar="R:SPEC",
                     help="compute time of rank R, same forms as --compute-ms (repeatable)")
    sim.add_argument("--link-latency-ms", default="0", metavar="MS",
                     help="one-way latency of every link in ms (default: 0)")
    sim.add_argument("--link-gbps", default="0", metavar="G",
                     help="bandwidth of every link in Gbit/s; 0 = unlimited (default: 0)")
    sim.add_argument("--link-loss", default="0", metavar="P",
                     help="share of TCP segments every link loses, 0 to <1 (0.01 or 1%%); a lost segment costs a "
                          "round trip, or a retransmission timeout (200 ms + RTT) when it ends a message (default: 0)")
    sim.add_argument("--link-jitter-ms", default="0", metavar="MS",
                     help="each segment's extra delay on every link, uniform within +-MS; a message is whole "
                          "when its last segment is (default: 0)")
    sim.add_argument("--link-model", default=None, metavar="FILE",
                     help="latency, bandwidth, loss and jitter per pair of machines (the graph's machine labels), "
                          'as JSON: {"links": [{"between": [A, B], "latency_ms": MS, "gbps": G, "loss": P, '
                          '"jitter_ms": MS}, ...]}; a side is a machine, a list of machines or "*"; other links '
                          "keep the --link-* flags")
    sim.add_argument("--model-mb", default="0", metavar="MB",
                     help="bytes charged to the link per update, in MB of 10^6 bytes (default: 0)")
    sim.add_argument("--stop", action="append", default=[], metavar="R:K",
                     help="rank R leaves for good before iteration K (repeatable)")
    sim.add_argument("--churn", action="append", default=[], metavar="EVENTS",
                     help="workers join and leave at virtual times: join:K@T, leave:K@T, leave:rankR@T, "
                          "comma-separated, T in s or ms (repeatable)")
    sim.add_argument("--churn-rate", default=None, metavar="RATES",
                     help="workers join and leave at random: join=RATE,leave=RATE per virtual second (seeded)")
    sim.add_argument("--plot", default=None, metavar="FILE.png",
                     help="draw the throughput against virtual time, with each view change marked")
    sim.add_argument("--gap-matrix", default="auto", choices=("auto", "always", "never"),
                     help="report every pair's largest gap (max_gap in --json: O(N^2)); auto: up to "
                          f"{GAP_MATRIX_MAX_N} workers (default: auto)")
    sim.add_argument("--json", default=None, metavar="FILE",
                     help="write the full result as JSON to FILE ('-' = stdout; the summary then goes to stderr)")
    from hopnet.config import add_protocol_arguments  # here, not above: `hopnet --help` needs none of it

    add_protocol_arguments(parser)
    parser.set_defaults(func=run)

    def one_line_error(message: str) -> None:  # bad flag values: one line, exit 2, like ConfigError
        parser.exit(2, f"hopnet simulate: error: {message}\n")

    parser.error = one_line_error  # type: ignore[method-assign]


# ------------------------------------------------------------------------ parsing
def _int(flag: str, text: str) -> int:
    try:
        return int(str(text).strip())
    except ValueError:
        raise ConfigError(f"{flag}: expected an integer, got {text!r}") from None


def _number(flag: str, text: str) -> float:
    try:
        value = float(str(text).strip())
    except ValueError:
        raise ConfigError(f"{flag}: expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise ConfigError(f"{flag}: expected a finite number, got {text!r}")
    if value < 0:
        raise ConfigError(f"{flag} must be >= 0 (got {text})")
    return value


def _share(flag: str, text: str) -> float:
    """A share from 0 to below 1, as a fraction (0.01) or a percentage (1%)."""
    stripped = str(text).strip()
    percent = stripped.endswith("%")
    value = _number(flag, stripped[:-1] if percent else stripped) / (100 if percent else 1)
    if value >= 1:
        raise ConfigError(f"{flag} must be below 1 (100%) (got {text})")
    return value


def resolve_graph(source: str | None, nproc_text: str | None) -> tuple[Graph, str]:
    """The graph and a label for it: ``--graph`` (checked against ``--nproc``) or a ring."""
    from hopnet.launch.spec import resolve_graph as resolve_run_graph

    from hopnet.graph.members import MemberGraph
    from hopnet.graph.reform import KINDS, BuilderSpec
    from hopnet.launch.spec import DEFAULT_NPROC

    nproc = None if nproc_text is None else _int("--nproc", nproc_text)
    kind = (source or "").strip().lower().replace("-", "_")
    if kind in KINDS and not os.path.exists(source or ""):  # a kind alone (ring, torus): over --nproc workers
        n = DEFAULT_NPROC if nproc is None else nproc
        if n < 1:
            raise ConfigError(f"--nproc must be an integer >= 1 (got {n})")
        graph = MemberGraph.build(BuilderSpec.parse(kind), range(n)).graph
        return graph, graph.name or f"{kind}:{n}"
    graph, _ = resolve_run_graph(source, nproc)
    return graph, graph.name or source or f"ring:{graph.n}"


def _rank(flag: str, text: str, n: int, item: str) -> int:
    rank = _int(flag, text)
    if not 0 <= rank < n:
        raise ConfigError(f"{flag} {item!r}: rank {rank} out of range (there are {n} workers)")
    return rank


def parse_compute(default: str, per_rank: list[str], n: int) -> ComputeModel:
    """``--compute-ms`` and ``--compute-ms-rank`` (``n``: the ranks there may be, joiners included)."""
    from hopnet.sim.engine import ComputeModel

    model = ComputeModel.parse(default)
    for item in per_rank:
        rank_text, sep, spec = item.partition(":")
        if not sep or not spec:
            raise ConfigError(f"--compute-ms-rank {item!r}: expected R:SPEC, e.g. 3:50 or 3:exp:20")
        model = model.with_rank(_rank("--compute-ms-rank", rank_text, n, item), ComputeModel.parse(spec))
    return model


def parse_stops(items: list[str], n: int) -> dict[int, int]:
    stops: dict[int, int] = {}
    for item in items:
        parts = item.split(":")
        if len(parts) != 2:
            raise ConfigError(f"--stop {item!r}: expected R:K (rank R leaves before iteration K)")
        rank = _rank("--stop", parts[0], n, item)
        iteration = _int("--stop", parts[1])
        if iteration < 0:
            raise ConfigError(f"--stop {item!r}: iteration must be >= 0")
        if rank in stops:
            raise ConfigError(f"--stop: rank {rank} given twice")
        stops[rank] = iteration
    return stops


def build_spec(args: argparse.Namespace) -> tuple[SimSpec, dict[str, Any]]:
    """The simulation ``args`` ask for, and its inputs as a JSON-ready dict."""
    from hopnet.config import config_from_args
    from hopnet.config_checks import check_config_for_graph
    from hopnet.graph.source import GraphSource
    from hopnet.sim.churn import parse_schedule

    graph, label = resolve_graph(args.graph, args.nproc)
    n = graph.n
    churn = parse_schedule(list(args.churn), args.churn_rate)
    builder = None
    if churn:
        source = GraphSource.from_argument(args.graph)
        if source.builder is None:
            raise ConfigError(f"--churn: {source.label} is a fixed graph and cannot re-form when workers join or "
                              "leave: give a builder such as --graph ring or --graph torus")
        builder = source.builder
    config = config_from_args(args)
    for note in check_config_for_graph(config, graph):
        print(f"hopnet simulate: note: {note}", file=sys.stderr)
    iterations = _int("--iterations", args.iterations)
    if iterations < 1:
        raise ConfigError(f"--iterations must be >= 1 (got {iterations})")
    latency_ms = _number("--link-latency-ms", args.link_latency_ms)
    gbps = _number("--link-gbps", args.link_gbps)
    loss = _share("--link-loss", args.link_loss)
    jitter_ms = _number("--link-jitter-ms", args.link_jitter_ms)
    model_mb = _number("--model-mb", args.model_mb)
    stops = parse_stops(list(args.stop), n)
    # a joiner's rank counts up from the first world size: --compute-ms-rank may name the scheduled ones
    compute = parse_compute(args.compute_ms, list(args.compute_ms_rank), n + churn.explicit_joins)  # loads torch
    from hopnet.sim.engine import SimSpec
    from hopnet.sim.links import load_link_model
    from hopnet.transports.inproc import LinkModel
    from hopnet.transports.link_faults import LinkFaults

    link = LinkModel(latency_s=latency_ms / 1000.0, bytes_per_s=gbps * 1e9 / 8,
                     faults=LinkFaults(loss, jitter_ms / 1000.0))
    link_inputs: dict[str, Any] = {"latency_ms": latency_ms, "gbps": gbps, "latency_s": link.latency_s,
                                   "bytes_per_s": link.bytes_per_s}
    if link.faults:  # (absent when clean: the JSON of a run without them stays as it was)
        link_inputs.update(loss=loss, jitter_ms=jitter_ms)
    if args.link_model is not None:
        link, rules = load_link_model(args.link_model, graph, link)
        link_inputs["rules"] = [rule.to_dict() for rule in rules]
    gap_matrix = {"auto": None, "always": True, "never": False}[args.gap_matrix]
    spec = SimSpec(graph=graph, config=config, iterations=iterations, compute=compute, link=link,
                   model_bytes=int(round(model_mb * BYTES_PER_MB)), stop_at=stops, gap_matrix=gap_matrix,
                   churn=churn or None, builder=builder)
    spec.validate()
    per_rank: dict[str, str] = {}
    for item in args.compute_ms_rank:
        rank_text, _, rank_spec = item.partition(":")
        per_rank[str(int(rank_text))] = rank_spec.strip()
    inputs = {
        "graph": label,
        "config": json.loads(config.to_json()),
        "requested_iterations": iterations,
        "compute": {"spec": args.compute_ms.strip(), "per_rank": per_rank},
        "link": link_inputs,
        "model_bytes": spec.model_bytes,
        "stop": {str(r): k for r, k in sorted(stops.items())},
        "seed": config.seed,
    }
    if churn:
        inputs["churn"] = churn.to_dict()
    return spec, inputs


def result_json(result: SimResult, inputs: dict[str, Any]) -> str:
    """The ``--json`` document: deterministic (no wall-clock time, keys sorted)."""
    data = dict(inputs)
    data.update(result.to_dict())
    return json.dumps(data, sort_keys=True, indent=1) + "\n"


# ------------------------------------------------------------------------ output
def summary_lines(result: SimResult, inputs: dict[str, Any]) -> list[str]:
    """The summary: what every run has, then what the protocol's declaration says matters for it
    (``ProtocolSpec.output``: its counts, its coordinator's, the gaps; no graph line where the graph
    plays no part)."""
    from hopnet.config import ProtocolConfig

    n = result.n
    config = inputs["config"]
    protocol = ProtocolConfig.from_dict(config)
    spec = protocol.spec
    output = spec.output
    rates = result.rates
    settings = [config["protocol"], *protocol.options.settings()]
    done = [len(times) for times in result.finish_times]  # iterations each worker completed
    workers = f"{n} worker{'' if n == 1 else 's'}"
    if result.views:  # a run with churn: n counts every rank that ever was a member
        first = len(result.views[0]["members"])
        workers = f"{first} worker{'' if first == 1 else 's'} at the start, {n} ranks in all"
    lines = [
        f"graph:             {inputs['graph']} ({workers})" if spec.uses_graph else f"workers:           {workers if result.views else n}",
        f"protocol:          {', '.join(settings)}",
        f"iterations:        {inputs['requested_iterations']} requested; completed "
        + (f"{done[0]} by every worker" if len(set(done)) == 1 else f"min {min(done)}, max {max(done)}"),
        f"virtual time:      {result.virtual_time:.6g} s",
        f"iterations/s:      mean {sum(rates) / n:.6g}, min {min(rates):.6g} (rank {rates.index(min(rates))}), "
        f"max {max(rates):.6g} (rank {rates.index(max(rates))})",
    ]
    if output.gaps != "none":
        largest, gi, gj = result.largest_gap
        lines.append(f"largest gap:       {largest}" + (f" (Iter({gi}) - Iter({gj}))" if largest > 0 else ""))
    per_rank = dict(enumerate(result.counts))
    for count in present(output.counts, per_rank.values()):
        values = {rank: counts.get(count.field) for rank, counts in per_rank.items()}
        if count.in_summary or any(values.values()):  # a secondary count only when it happened
            lines.append(f"{count.label + ':':<18} {combine(count, values)}")
    if result.coordinator is not None:
        c = result.coordinator
        shown = present(output.coordinator_counts, [c]) or (Count("groups_formed", "groups formed"),)
        lines.append(f"coordinator:       {c.get('coordinator')}: "
                     + ", ".join(f"{format_value(c.get(count.field, 0))} {count.label}" for count in shown))
    lines += view_lines(result)
    lines.append(f"wall clock:        {result.wall_seconds:.3f} s")
    return lines


RUNS_SHOWN = 8
"""A view's members are listed as runs of consecutive ranks, this many at most."""
VIEWS_SHOWN = 20
"""The summary lists this many views at most: the first and the last half of them."""


def _ranks(ranks: list[int]) -> str:
    """``0-7, 9``: runs of consecutive ranks shortened."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    shown = ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs[:RUNS_SHOWN])
    return shown if len(runs) <= RUNS_SHOWN else f"{shown}, ..."


def view_lines(result: SimResult) -> list[str]:
    """A run with churn: one line per view (who, who joined and left, when it began, its throughput)."""
    if result.views is None:
        return []
    views = result.views
    lines = [f"views:             {len(views)}"]
    half = VIEWS_SHOWN // 2
    shown = views if len(views) <= VIEWS_SHOWN else [*views[:half], None, *views[-half:]]
    for view in shown:
        if view is None:
            lines.append(f"  ... {len(views) - 2 * half} more (--json has every view)")
            continue
        change = "; ".join([f"joined {_ranks(view['joined'])}"] * bool(view["joined"])
                           + [f"left {_ranks(view['left'])}"] * bool(view["left"]))
        count = len(view["members"])
        lines.append(f"  view {view['view']}: {count} member{'' if count == 1 else 's'} "
                     f"({_ranks(view['members'])})" + (f", {change}" if change else "")
                     + f"; from {view['began_s']:.6g} s, iteration {view['iteration']}; "
                     f"{view['throughput']:.6g} iterations/s")
    for line in result.churn_skipped:
        lines.append(f"  not applied: {line}")
    return lines


def write_plot(path: str, result: SimResult) -> None:
    from hopnet.sim.plot import throughput_plot

    try:
        with open(path, "wb") as fh:
            fh.write(throughput_plot(result))
    except OSError as exc:
        raise ConfigError(f"--plot {path}: cannot write file: {exc.strerror or exc}") from None


def run(args: argparse.Namespace) -> int:
    spec, inputs = build_spec(args)
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path not in (None, "-"):
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                raise ConfigError(f"{flag} {path}: no such directory {folder}")
    from hopnet.sim.engine import simulate

    try:
        result = simulate(spec)
    except ConfigError:
        raise
    except HopnetError as exc:  # Deadlock, WaitTimeout, PeerFailure, ProtocolError
        print(f"hopnet simulate: error: {exc}", file=sys.stderr)
        return 1
    if args.plot is not None:
        write_plot(args.plot, result)
    text = result_json(result, inputs)
    summary = "\n".join(summary_lines(result, inputs)) + "\n"
    if args.json == "-":
        sys.stdout.write(text)
        sys.stderr.write(summary)
        return 0
    if args.json is not None:
        try:
            with open(args.json, "w", encoding="utf-8") as fh:
                fh.write(text)
        except OSError as exc:
            raise ConfigError(f"--json {args.json}: cannot write file: {exc.strerror or exc}") from None
    sys.stdout.write(summary)
    return 0

"""What limited a run, and what to try: the conclusion at the top of `hopnet report`.

From the event records alone (docs/reference/events.md) this finds

- **stragglers**: ranks whose compute per step is well above the median rank's;
- **slow links**: directed links whose measured transfer time (an update's send on one
  rank to the end of the wait for it on the other) is large beside the compute;
- **who waited on whom**: the share of each rank's step time spent waiting on each peer
  (the ``wait_updates_from`` / ``wait_tokens_from`` fields of its iteration records);
- **lossy and high-latency links**: from the kernel's round trips and retransmissions per
  connection (the ``links`` records) and the update arrivals (:mod:`hopnet.report.links`);
- **CPU contention**: more busy workers than a machine's cores, waiting runnable for one
  (:mod:`hopnet.report.contention`); their waits are then no link's or straggler's, and no
  option is suggested.

It then builds a :class:`Scenario` of this run (its graph and options, each rank's measured
compute per step, each link's measured transfer time) and a few :class:`Option` s to try.
Predicting their effect needs the simulator, which sits above the report in the layers: the
caller passes a :data:`Predictor` (``hopnet.sim.whatif.predict``, wired in by ``hopnet
report``); without one the diagnosis names the limits and leaves the prediction out.
"""

from __future__ import annotations

import math
import signal
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hopnet.config import ProtocolConfig, option_text
from hopnet.errors import HopnetError
from hopnet.graph import Graph
from hopnet.report.contention import Contention, contention
from hopnet.report.links import LinkHealth, bytes_per_step, link_health, unhealthy
from hopnet.report.rundir import Record, RunData
from hopnet.report.stats import RunStats, run_stats

STRAGGLER_FACTOR = 2.0
"""A rank computing this many times the median rank's step time or more is a straggler."""
SLOW_LINK_SHARE = 0.5
"""A link is slow when its transfer time is at least this share of the median compute step..."""
SLOW_LINK_FACTOR = 4.0
"""...and this many times the fastest measured link's."""
NOTABLE_WAIT = 0.1
"""A peer that a rank spent this share of its step time or more waiting on is named."""
SENDS_ON_ENTERING = ("hop", "notify-ack")
"""Protocols whose workers send their update of an iteration to their out-neighbours on entering it,
and wait for their in-neighbours' updates of the same iteration: the ones with link times."""
PREDICT_ITERATIONS = 200
"""At most this many iterations are simulated per option (the report must stay fast)..."""
PREDICT_WORK = 3_200
"""...and at most this many worker-iterations (workers x iterations; 20 iterations at least)."""


@dataclass(frozen=True)
class Straggler:
    rank: int
    compute_s: float
    """Its median compute per step (seconds)."""
    factor: float
    """``compute_s`` over the median rank's."""
    waiters: dict[int, float]
    """Ranks that spent at least :data:`NOTABLE_WAIT` of their step time waiting on it, and that share."""


@dataclass(frozen=True)
class SlowLink:
    src: int
    dst: int
    transfer_s: float
    """Median time from ``src`` sending an update to ``dst`` having it, over the waits for it."""
    share: float
    """Share of ``dst``'s step time spent waiting on ``src``."""


@dataclass(frozen=True)
class Scenario:
    """This run as the simulator needs it."""

    graph: Graph
    config: ProtocolConfig
    iterations: int
    compute_s: dict[int, float]
    """Per rank, the median compute per step before ``--slowdown`` stretched it (the config's
    slowdown rules stretch it again in the simulation)."""
    link_s: dict[tuple[int, int], float]
    """Measured transfer time of the links that were waited on (src, dst)."""
    default_link_s: float
    """Transfer time of every other link: the fastest measured one (0 when none was)."""
    link_faults: dict[tuple[int, int], tuple[float, float, float | None]] = field(default_factory=dict)
    """Measured loss (the retransmitted share), jitter and round trip (seconds; None: unknown) of the
    lossy or high-latency links."""
    message_bytes: int = 0
    """Bytes a link carried per iteration (the kernel's count; 0: unknown): what a lost segment is out of."""

    def without_limits(self) -> Scenario:
        """Every rank at the median compute, every link at the default, no slowdowns or link faults."""
        median = statistics.median(self.compute_s.values())
        return Scenario(self.graph, self.config.replace(slowdown=[]), self.iterations,
                        dict.fromkeys(self.compute_s, median), {}, self.default_link_s, {}, self.message_bytes)


@dataclass(frozen=True)
class Option:
    """An option to try: ``config`` is this run's with ``flags`` changed."""

    flags: str
    config: ProtocolConfig
    why: str


Predictor = Callable[[Scenario, Sequence[ProtocolConfig]], list[float | None]]
"""Simulates the scenario under each config; returns the run time of each (None: it could not run)."""


@dataclass(frozen=True)
class Prediction:
    option: Option
    seconds: float | None
    baseline_s: float

    @property
    def speedup(self) -> float | None:
        if self.seconds is None or self.seconds <= 0:
            return None
        return self.baseline_s / self.seconds


@dataclass
class Diagnosis:
    median_compute_s: float
    stragglers: list[Straggler]
    slow_links: list[SlowLink]
    waits: dict[int, dict[int, float]]
    """``waits[i][j]``: share of rank i's step time spent waiting on peer j (updates and tokens)."""
    wait_shares: dict[int, float]
    """Share of each rank's step time spent waiting at all (updates and tokens)."""
    links: list[LinkHealth] = field(default_factory=list)
    """The lossy and high-latency links (:mod:`hopnet.report.links`), the worst first."""
    scenario: Scenario | None = None
    simulated_s: float | None = None
    """The simulator's run time for this run as measured (how well the scenario fits)."""
    unlimited_s: float | None = None
    """The simulator's run time with every rank at the median compute and every link fast."""
    predictions: list[Prediction] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failure: str | None = None
    """How the run ended, when not well (the launcher's words, from launch.json's result)."""
    contended: list[Contention] = field(default_factory=list)
    """Machines whose workers outnumbered their cores and waited for one (:mod:`hopnet.report.contention`):
    the waits are CPU contention, and no option is suggested."""

    @property
    def best(self) -> Prediction | None:
        ranked = [p for p in self.predictions if p.speedup is not None]
        return max(ranked, key=lambda p: p.speedup or 0.0) if ranked else None

    def lines(self) -> list[str]:
        """The conclusion in a few sentences, most important first."""
        lines: list[str] = [self.failure] if self.failure else []
        lines += [machine.words() for machine in self.contended]
        for s in self.stragglers:
            text = f"rank {s.rank} computes {_times(s.factor)} the median ({_ms(s.compute_s)} per step)"
            if s.waiters:
                low, high = min(s.waiters.values()), max(s.waiters.values())
                share = _pct(high) if math.isclose(low, high, abs_tol=0.005) else f"{_pct(low)}-{_pct(high)}"
                text += (f"; {_ranks(s.waiters)} wait {share} of their time for it" if len(s.waiters) > 1
                         else f"; {_ranks(s.waiters)} waits {share} of its time for it")
            lines.append(text)
        named = {(h.src, h.dst) for h in self.links}
        lines += [health.words() for health in self.links]
        for link in self.slow_links:
            if (link.src, link.dst) in named:
                continue
            lines.append(f"link {link.src}→{link.dst} takes {_ms(link.transfer_s)} per update, "
                         f"{_times(link.transfer_s / self.median_compute_s)} the median compute step "
                         f"({_ms(self.median_compute_s)}); rank {link.dst} waits {_pct(link.share)} of its time on it")
        if not self.stragglers and not self.slow_links and not self.links and not self.contended:
            top = max(self.wait_shares.values(), default=0.0)
            lines.append(f"no straggler or slow link: ranks compute within {_times(STRAGGLER_FACTOR)} of the "
                         f"median ({_ms(self.median_compute_s)} per step) and wait at most {_pct(top)} of their time")
        if (self.stragglers or self.slow_links or self.links) and self.simulated_s and self.unlimited_s:
            lines.append(f"without them the simulator predicts {_times(self.simulated_s / self.unlimited_s)} "
                         "faster (every rank at the median compute, every link at the fastest one's time)")
        if self.links and self.predictions:
            tried = [f"`{p.option.flags}` " + (f"{_times(p.speedup)} faster" if p.speedup >= 1.05 else
                                                 f"no gain ({p.speedup:.2f}x)")
                     for p in self.predictions if p.speedup is not None]
            if tried:
                lines.append("options that tolerate the link, simulated with its measured latency, loss and jitter: "
                             + ", ".join(tried))
        best = self.best
        if best is not None and best.speedup is not None:
            verdict = (f"simulator predicts {best.speedup:.1f}x faster" if best.speedup >= 1.05 else
                       f"simulator predicts no gain ({best.speedup:.2f}x)")
            lines.append(f"try `{best.option.flags}`: {verdict}")
        lines += [machine.advice() for machine in self.contended]
        lines.extend(self.notes)
        return lines


# ---------------------------------------------------------------------------- measuring
def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def _iterations(records: list[Record]) -> list[Record]:
    return [r for r in records if r.get("event") == "iteration" and isinstance(r.get("mono"), (int, float))]


def base_compute(records: list[Record]) -> float | None:
    """Median compute per step with ``--slowdown``'s stretch taken out; the first step (start-up) left out."""
    steps = _iterations(records)[1:] or _iterations(records)
    values = []
    for rec in steps:
        compute = rec.get("compute_s")
        if isinstance(compute, (int, float)) and math.isfinite(compute):
            factor = rec.get("slowdown")
            values.append(compute / factor if isinstance(factor, (int, float)) and factor > 0 else compute)
    return _median(values) if values else None


def _compute(records: list[Record]) -> float | None:
    steps = _iterations(records)[1:] or _iterations(records)
    values = [float(r["compute_s"]) for r in steps if isinstance(r.get("compute_s"), (int, float))]
    return _median(values) if values else None


def peer_waits(records: list[Record]) -> dict[int, float]:
    """Seconds this rank spent waiting on each peer, updates and tokens together."""
    waited: dict[int, float] = {}
    for rec in _iterations(records):
        for key in ("wait_updates_from", "wait_tokens_from"):
            by_peer = rec.get(key)
            if isinstance(by_peer, dict):
                for peer, seconds in by_peer.items():
                    if isinstance(seconds, (int, float)):
                        waited[int(peer)] = waited.get(int(peer), 0.0) + float(seconds)
    return waited


def entered_at(records: list[Record]) -> dict[int, float]:
    """When this rank entered each iteration (and so sent its update of it): its ``enter`` records,
    else the end of the step before (a skip enters the iteration it jumps to)."""
    entered: dict[int, float] = {}
    last_end: dict[int, float] = {}
    for rec in records:
        kind, mono = rec.get("event"), rec.get("mono")
        if not isinstance(mono, (int, float)) or not isinstance(rec.get("iter"), int):
            continue
        if kind == "enter":
            entered[rec["iter"]] = float(mono)
        elif kind == "iteration":
            last_end[rec["iter"]] = float(mono)
            entered.setdefault(rec["iter"] + 1, float(mono))
        elif kind == "skip" and isinstance(rec.get("to"), int) and rec["iter"] in last_end:
            entered.setdefault(rec["to"], last_end[rec["iter"]])
    return entered


def update_arrivals(run: RunData) -> list[tuple[int, int, int, float, float]]:
    """Each wait for an update that names its peer: (src, dst, iteration, sent, arrived); only for
    the protocols of :data:`SENDS_ON_ENTERING` (unknown options: Hop's, the default).

    ``sent``: when ``src`` entered the iteration (Hop sends its update on entering);
    ``arrived``: when ``dst``'s wait for it ended (the step's end less mixing and the token
    wait, the nominal order of the trace). Both on the shared monotonic clock, so the logs of
    one machine compare; across machines the clocks differ and so may these."""
    if run.config is not None and run.config.protocol not in SENDS_ON_ENTERING:
        return []
    if run.config is not None and getattr(run.config.options, "local_steps", 1) > 1:
        return []  # --local-steps: entries count rounds, the iteration records iterations; not paired (yet)
    entered = {rank: entered_at(records) for rank, records in run.events.items()}
    arrivals = []
    for dst, records in run.events.items():
        for rec in _iterations(records):
            by_peer = rec.get("wait_updates_from")
            if not isinstance(by_peer, dict):
                continue
            k = rec.get("iter")
            if not isinstance(k, int):
                continue
            arrived = float(rec["mono"]) - float(rec.get("mix_s") or 0.0) - float(rec.get("wait_tokens_s") or 0.0)
            for peer in by_peer:
                sent = entered.get(int(peer), {}).get(k)
                if sent is not None and arrived >= sent:
                    arrivals.append((int(peer), dst, k, sent, arrived))
    return arrivals


def link_times(run: RunData, arrivals: list[tuple[int, int, int, float, float]] | None = None
               ) -> dict[tuple[int, int], float]:
    """Median measured transfer time per directed link, over the waits that named its sender
    (``arrivals``: :func:`update_arrivals`, when the caller has them)."""
    samples: dict[tuple[int, int], list[float]] = {}
    for src, dst, k, sent, arrived in update_arrivals(run) if arrivals is None else arrivals:
        if k > 0:  # iteration 0's updates also wait for the connections to open
            samples.setdefault((src, dst), []).append(arrived - sent)
    return {link: _median(values) for link, values in sorted(samples.items())}


# ---------------------------------------------------------------------------- options
def candidate_options(config: ProtocolConfig, graph: Graph, stragglers: bool, slow_links: bool) -> list[Option]:
    """Options worth simulating for what limited the run (README, "Uneven clusters")."""
    changes: list[tuple[dict[str, object], str]] = []
    min_in = min((len(graph.in_peers(r)) for r in range(graph.n)), default=0)
    if config.protocol == "hop":
        if min_in >= 2:
            if stragglers:
                changes += [({"backup_workers": 1}, "no worker waits for its slowest in-neighbour"),
                            ({"backup_workers": 1, "skip_threshold": 2, "max_jump": 8, "max_ig": 4},
                             "a backup worker, and the straggler skips ahead instead of holding its neighbours back"),
                            ({"backup_workers": 1, "skip_threshold": 2, "max_jump": 16, "max_ig": 16},
                             "with a longer leash (larger gaps between neighbours)")]
            if slow_links:
                changes += [({"backup_workers": 1, "staleness": 8, "max_ig": 16},
                             "no worker waits for the update across the slow link")]
        elif stragglers:
            changes += [({"skip_threshold": 2, "max_jump": 8, "max_ig": 4},
                         "the straggler skips ahead instead of holding its neighbours back")]
    elif stragglers or slow_links:
        changes += [({"protocol": "hop", "backup_workers": 1, "skip_threshold": 2, "max_jump": 8, "max_ig": 4},
                     "Hop with a backup worker: no worker waits for the slowest neighbour")]
    if slow_links and config.protocol != "diloco":
        changes += [({"protocol": "diloco", "local_steps": 10},
                     "DiLoCo: one all-reduce every 10 local steps, a tenth of the messages on the link")]
    options: list[Option] = []
    for change, why in changes:
        try:
            candidate = config.replace(**change)
            candidate.validate_ranks(graph.n)
        except (HopnetError, TypeError, ValueError):
            continue
        if candidate.to_dict() == config.to_dict():
            continue  # what ran already
        flags = " ".join(f"--protocol {candidate.protocol}" if name == "protocol" else option_text(candidate, name)
                         for name in change)
        options.append(Option(flags, candidate, why))
    return options


# ---------------------------------------------------------------------------- the diagnosis
def diagnose(run: RunData, stats: RunStats | None = None, predictor: Predictor | None = None) -> Diagnosis:
    """What limited ``run``; with ``predictor``, what the options to try would gain."""
    stats = stats if stats is not None else run_stats(run)
    compute = {rank: c for rank in run.ranks if (c := _compute(run.events[rank])) is not None}
    median = _median(list(compute.values()))
    waits: dict[int, dict[int, float]] = {}
    wait_shares: dict[int, float] = {}
    for rank, s in stats.ranks.items():
        busy = s.busy_s
        waits[rank] = {peer: w / busy for peer, w in sorted(peer_waits(run.events.get(rank, [])).items())
                       if busy > 0}
        wait_shares[rank] = s.share("wait_updates_s") + s.share("wait_tokens_s")
    stragglers = []
    if median > 0:
        for rank, c in sorted(compute.items(), key=lambda item: -item[1]):
            if c >= STRAGGLER_FACTOR * median:
                waiters = {r: w[rank] for r, w in waits.items() if w.get(rank, 0.0) >= NOTABLE_WAIT}
                stragglers.append(Straggler(rank, c, c / median, waiters))
    arrivals = update_arrivals(run)
    links = link_times(run, arrivals)
    fastest = min(links.values(), default=0.0)
    straggling = {s.rank for s in stragglers}
    slow_links = []
    for (src, dst), transfer in links.items():
        share = waits.get(dst, {}).get(src, 0.0)
        if (src not in straggling and median > 0 and transfer >= SLOW_LINK_SHARE * median
                and transfer >= SLOW_LINK_FACTOR * max(fastest, 1e-6) and share >= NOTABLE_WAIT):
            slow_links.append(SlowLink(src, dst, transfer, share))
    slow_links.sort(key=lambda link: -link.transfer_s)
    health = unhealthy(link_health(run, arrivals, waits))
    contended = contention(run)
    if contended:  # the links' times are their ends' waits for a core (the kernel's retransmissions are not)
        slow_links = []
    diagnosis = Diagnosis(median, stragglers, slow_links, waits, wait_shares, health, failure=_failure(run),
                          contended=contended)
    if not any(waits.values()) and any(wait_shares.values()):
        diagnosis.notes.append("the logs do not say which peer each wait was for (a protocol or hopnet "
                               "version that does not record wait_updates_from)")
    if len(stats.views) > 1:
        diagnosis.notes.append(f"no prediction: the run went through {len(stats.views)} views (elastic) and the "
                               "simulator models one graph")
        return diagnosis
    scenario = _scenario(run, stats, links, fastest, health)
    diagnosis.scenario = scenario
    if scenario is None:
        diagnosis.notes.append("no prediction: the run directory lacks graph.json or the run's options")
    elif predictor is not None and not contended:
        _predict(diagnosis, scenario, predictor)
    return diagnosis


def _failure(run: RunData) -> str | None:
    """How the run ended, when not well: the launcher's one line on a failure (``result.summary``
    in launch.json), or the signal that stopped it."""
    result = run.launch.get("result")
    code = result.get("returncode") if isinstance(result, dict) else None
    if not isinstance(code, int) or code == 0:
        return None
    summary = result.get("summary") if isinstance(result, dict) else None
    if isinstance(summary, str) and summary:
        return f"the run failed: {summary}"
    if code > 128:
        try:
            return f"the run was stopped by {signal.Signals(code - 128).name} (exit {code})"
        except ValueError:
            pass
    return f"the run failed (exit {code})"


def _scenario(run: RunData, stats: RunStats, links: dict[tuple[int, int], float],
              fastest: float, health: list[LinkHealth]) -> Scenario | None:
    if run.graph is None or run.config is None:
        return None
    base = {rank: base_compute(run.events.get(rank, [])) for rank in range(run.graph.n)}
    known = [c for c in base.values() if c is not None]
    if not known:
        return None
    fill = _median(known)
    bound = min(PREDICT_ITERATIONS, max(20, PREDICT_WORK // run.graph.n))
    iterations = min(bound, max((s.iterations for s in stats.ranks.values()), default=0))
    if iterations < 1:
        return None
    config = run.config
    if config.slowdown and not any("slowdown" in rec for recs in run.events.values() for rec in _iterations(recs)):
        # The logs do not mark the stretched steps (the simulator's): the medians include the
        # slowdowns already, so they must not stretch them again.
        config = config.replace(slowdown=[])
    slow = {link: t for link, t in links.items() if t > fastest}
    for h in health:  # a link without update arrivals (an all-reduce's) takes the kernel's latency
        if h.latency_s is not None and (h.src, h.dst) not in slow:
            slow[(h.src, h.dst)] = h.latency_s
    faults = {(h.src, h.dst): (min(h.retransmitted or 0.0, 0.5), h.jitter_s or 0.0, h.rtt_s) for h in health}
    steps = max((s.iterations for s in stats.ranks.values()), default=0)
    return Scenario(run.graph, config, iterations, {r: (fill if c is None else c) for r, c in base.items()},
                    slow, fastest, faults, bytes_per_step(run, steps))


def _predict(diagnosis: Diagnosis, scenario: Scenario, predictor: Predictor) -> None:
    options = candidate_options(scenario.config, scenario.graph, bool(diagnosis.stragglers),
                                bool(diagnosis.slow_links or diagnosis.links))
    try:
        simulated = predictor(scenario, [scenario.config, *(o.config for o in options)])
        unlimited = predictor(scenario.without_limits(), [scenario.without_limits().config])
    except HopnetError as exc:
        diagnosis.notes.append(f"no prediction: the simulator could not run this scenario ({exc})")
        return
    baseline = simulated[0]
    diagnosis.simulated_s = baseline
    diagnosis.unlimited_s = unlimited[0]
    if baseline is None:
        diagnosis.notes.append("no prediction: the simulator could not run this run's own options")
        return
    diagnosis.predictions = [Prediction(option, seconds, baseline) for option, seconds in zip(options, simulated[1:])]


# ---------------------------------------------------------------------------- words
def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def _times(x: float) -> str:
    return f"{x:.1f}x" if x < 10 else f"{x:.0f}x"


def _ranks(ranks: dict[int, float]) -> str:
    names = [str(r) for r in sorted(ranks)]
    if len(names) == 1:
        return f"rank {names[0]}"
    return "ranks " + ", ".join(names[:-1]) + " and " + names[-1]


__all__ = ["Diagnosis", "Option", "Prediction", "Predictor", "Scenario", "SlowLink", "Straggler",
           "base_compute", "candidate_options", "diagnose", "entered_at", "link_times", "peer_waits",
           "update_arrivals"]

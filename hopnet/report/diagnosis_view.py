"""The report's first section: the :class:`~hopnet.report.diagnosis.Diagnosis` as words, tables and figures."""

from __future__ import annotations

from hopnet.report import plots
from hopnet.report.content import Figure, Section, Table
from hopnet.report.diagnosis import Diagnosis, Predictor, diagnose
from hopnet.report.rundir import RunData
from hopnet.report.stats import RunStats, run_stats


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _fit(stats: RunStats, diagnosis: Diagnosis) -> str:
    """How close the simulator came to this run: its time for the same iterations beside the measured one."""
    scenario = diagnosis.scenario
    began = [s.began for s in stats.ranks.values() if s.began is not None]
    ends = [s.last for s in stats.ranks.values() if s.last is not None]
    ran = max((s.iterations for s in stats.ranks.values()), default=0)
    if scenario is None or diagnosis.simulated_s is None or not began or not ends or scenario.iterations != ran:
        return ""
    return (f" For this run's options it predicts {diagnosis.simulated_s:.3g} s; the run took "
            f"{max(ends) - min(began):.3g} s from its first iteration to its last.")


def wait_table(diagnosis: Diagnosis) -> Table:
    """Per rank: its share of time waiting, and on whom (the peers it waited on, most first)."""
    rows = []
    for rank, by_peer in sorted(diagnosis.waits.items()):
        named = sorted(by_peer.items(), key=lambda item: -item[1])
        on = ", ".join(f"rank {peer}: {_pct(share)}" for peer, share in named if share >= 0.0005) or "-"
        rows.append([str(rank), _pct(diagnosis.wait_shares.get(rank, 0.0)), on])
    return Table(["rank", "waiting (updates and tokens)", "waited on (share of its time)"], rows)


def prediction_table(diagnosis: Diagnosis) -> Table:
    rows = []
    if diagnosis.simulated_s is not None:
        rows.append(["this run's options", f"{diagnosis.simulated_s:.3g} s", "1.0x", "the run as measured"])
    for p in diagnosis.predictions:
        rows.append([p.option.flags, "failed" if p.seconds is None else f"{p.seconds:.3g} s",
                     "-" if p.speedup is None else f"{p.speedup:.1f}x", p.option.why])
    if diagnosis.unlimited_s is not None:
        rows.append(["(no straggler, no slow link)", f"{diagnosis.unlimited_s:.3g} s",
                     f"{diagnosis.simulated_s / diagnosis.unlimited_s:.1f}x" if diagnosis.simulated_s
                     and diagnosis.unlimited_s > 0 else "-", "every rank at the median compute: the limit's cost"])
    return Table(["option", "simulated run time", "speedup", "why"], rows)


def diagnosis_section(run: RunData, stats: RunStats | None = None, predictor: Predictor | None = None,
                      diagnosis: Diagnosis | None = None) -> Section:
    stats = stats if stats is not None else run_stats(run)
    diagnosis = diagnosis if diagnosis is not None else diagnose(run, stats, predictor)
    section = Section("Diagnosis", paragraphs=[f"{line[0].upper()}{line[1:]}." for line in diagnosis.lines()])
    section.tables.append(wait_table(diagnosis))
    if diagnosis.predictions or diagnosis.simulated_s is not None:
        scenario = diagnosis.scenario
        assert scenario is not None
        section.paragraphs.append(
            f"Predictions: hopnet's simulator ran {scenario.iterations} iterations of this run's graph with each "
            "rank's measured median compute per step and each waited-on link's measured transfer time "
            f"(the fastest {scenario.default_link_s * 1000:.3g} ms, {len(scenario.link_s)} measured slower); "
            "speedups compare simulated run times." + _fit(stats, diagnosis))
        section.tables.append(prediction_table(diagnosis))
    elif predictor is None and diagnosis.scenario is not None:
        section.paragraphs.append("No prediction (hopnet report --no-predict).")
    highlight = {s.rank for s in diagnosis.stragglers}
    section.figures.append(Figure("stragglers", "Compute against waiting", "Each worker's step time split into "
                                  "compute, waits and mixing, the most computing worker first; stragglers are "
                                  "outlined and named.", plots.straggler_plot(stats, highlight)))
    section.figures.append(Figure("lag", "Lag behind the furthest worker", "Iterations each worker had finished "
                                  "fewer than the furthest one, against wall time.", plots.lag_plot(stats, highlight)))
    return section

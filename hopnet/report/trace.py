"""Chrome trace events (Perfetto, chrome://tracing) from a run's event logs.

One process per rank (``pid`` = rank). Each computed iteration becomes up to four
complete ("X") spans laid end to end, ending at the iteration record's ``mono``:
compute, wait for updates, mixing, wait for tokens (named as the protocol names its waits:
"wait for group"...). Their lengths are the measured
ones; their order inside a step is nominal (with the parallel approach the optimizer
step, counted as compute, actually runs after the mix). Skips, departures, dead peers
errors and rejoins are instant ("i") events, and so is each restart of a rank by the launcher
(``launch.json``'s ``restarts``, ``--max-restarts``), on the rank's track when its replacement started.
Each view change of an elastic run is a global instant (``view N``, its members and change in ``args``).

A wait that the protocol attributed to peers (``wait_updates_from``, ``wait_tokens_from``) names
them (``wait for updates from 1``), and a flow arrow runs from each such peer's send of the
update (when it entered the iteration) to the end of the wait it ended.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hopnet.output_spec import GENERIC_OUTPUT
from hopnet.report.diagnosis import update_arrivals
from hopnet.report.rundir import RunData
from hopnet.report.views import run_views

SPAN_ORDER = (("compute_s", "compute"), ("wait_updates_s", "wait for updates"),
              ("mix_s", "mixing"), ("wait_tokens_s", "wait for tokens"))
STEP_TID = 0
PEER_FIELDS = {"wait_updates_s": "wait_updates_from", "wait_tokens_s": "wait_tokens_from"}
FLOW_LIMIT = 20_000


def _us(seconds: float) -> int:
    return int(round(seconds * 1_000_000))


def _instant(name: str, rank: int, ts: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "cat": "event", "ph": "i", "s": "t", "ts": ts, "pid": rank, "tid": STEP_TID,
            "args": args}


def span_order(run: RunData) -> tuple[tuple[str, str], ...]:
    """:data:`SPAN_ORDER` with the waits named as the run's protocol names them ("wait for group")."""
    output = run.config.spec.output if run.config is not None else GENERIC_OUTPUT
    labels = {wait.part: wait.label for wait in output.waits}
    return tuple((field, labels.get(field, name)) for field, name in SPAN_ORDER)


def rank_trace_events(rank: int, records: list[dict[str, Any]], t0: float,
                      spans: tuple[tuple[str, str], ...] = SPAN_ORDER) -> list[dict[str, Any]]:
    """One rank's spans and instant events; its spans never overlap."""
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": rank, "tid": STEP_TID, "args": {"name": f"rank {rank}"}},
        {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": STEP_TID, "args": {"sort_index": rank}},
        {"name": "thread_name", "ph": "M", "pid": rank, "tid": STEP_TID, "args": {"name": "steps"}},
    ]
    previous_end: int | None = None
    for rec in records:
        kind = rec.get("event")
        mono = rec.get("mono")
        if not isinstance(mono, (int, float)):
            continue
        end = _us(mono - t0)
        if kind == "iteration":
            durations = [(field, name, _us(float(rec.get(field) or 0.0))) for field, name in spans]
            cursor = end - sum(d for _, _, d in durations)
            if previous_end is not None:
                cursor = max(cursor, previous_end)  # rounding and thread hand-offs: never overlap
            for field, name, duration in durations:
                stop = min(cursor + duration, end)
                if stop > cursor:
                    args: dict[str, Any] = {"iter": rec.get("iter")}
                    peers = rec.get(PEER_FIELDS.get(field, ""))
                    if isinstance(peers, dict) and peers:
                        name = f"{name} from {', '.join(sorted(peers, key=int))}"
                        args["seconds_by_peer"] = peers
                    events.append({"name": name, "cat": "step", "ph": "X", "ts": cursor, "dur": stop - cursor,
                                   "pid": rank, "tid": STEP_TID, "args": args})
                    cursor = stop
            previous_end = end if previous_end is None else max(end, previous_end)
        elif kind == "skip":
            events.append(_instant(f"skip {rec.get('iter')}→{rec.get('to')}", rank, end,
                                   {"iter": rec.get("iter"), "to": rec.get("to"), "behind": rec.get("behind")}))
        elif kind in ("peer_left", "peer_dead", "error", "rejoined"):
            args = {k: v for k, v in rec.items() if k not in ("event", "rank", "t", "mono")}
            events.append(_instant(str(kind), rank, end, args))
    return events


def restart_events(run: RunData, t0: float) -> list[dict[str, Any]]:
    """A "restart" instant on the rank's track for each replacement the launcher started."""
    restarts = run.launch.get("restarts")
    events = []
    for r in restarts if isinstance(restarts, list) else []:
        if isinstance(r, dict) and isinstance(r.get("rank"), int) and isinstance(r.get("mono"), (int, float)):
            args = {k: r.get(k) for k in ("restart", "reason", "old_pid", "new_pid")}
            events.append(_instant("restart", r["rank"], _us(r["mono"] - t0), args))
    return events


def view_events(run: RunData, t0: float) -> list[dict[str, Any]]:
    """A global instant (a line across every track) at each view change of an elastic run."""
    return [{"name": f"view {v.number}", "cat": "view", "ph": "i", "s": "g", "ts": _us(v.mono - t0), "pid": 0,
             "tid": STEP_TID, "args": {"members": list(v.members), "change": v.change(), "first_iter": v.first_iter}}
            for v in run_views(run) if v.number > 0 and v.mono is not None]


def update_flows(run: RunData, t0: float) -> list[dict[str, Any]]:
    """Flow arrows from a peer's send of an update to the end of the wait it ended (the first
    :data:`FLOW_LIMIT`); each end sits 1 us inside its span, so the viewer binds it there."""
    events: list[dict[str, Any]] = []
    for n, (src, dst, k, sent, arrived) in enumerate(update_arrivals(run)[:FLOW_LIMIT]):
        common = {"name": f"update {k}", "cat": "update", "id": n, "tid": STEP_TID}
        events.append({**common, "ph": "s", "ts": max(0, _us(sent - t0) - 1), "pid": src})
        events.append({**common, "ph": "f", "bp": "e", "ts": max(0, _us(arrived - t0) - 1), "pid": dst,
                       "args": {"from": src, "iter": k}})
    return events


def chrome_trace(run: RunData) -> dict[str, Any]:
    """The whole run as a Chrome trace object (``{"traceEvents": [...]}``), times relative to its start."""
    t0 = run.t0
    spans = span_order(run)
    events: list[dict[str, Any]] = []
    for rank, records in sorted(run.events.items()):
        events.extend(rank_trace_events(rank, records, t0, spans))
    events.extend(restart_events(run, t0))
    events.extend(view_events(run, t0))
    events.extend(update_flows(run, t0))
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"run_dir": str(run.path)}}


def write_trace(run: RunData, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(chrome_trace(run), separators=(",", ":")) + "\n", encoding="utf-8")
    return out

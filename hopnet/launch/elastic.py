"""The launcher's side of an elastic run: what `hopnet join` is told, the mark that tells a worker
the launcher's SIGTERM from a preemption, and the views the workers went through."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hopnet.elastic.settings import STOP_FILE
from hopnet.launch.exit_bound import ends_with_event
from hopnet.launch.spec import LaunchPlan


def join_info(plan: LaunchPlan, run_dir: Path, base_env: dict[str, str]) -> dict[str, Any]:
    """What a joining worker needs besides its rank and the run's configuration (served by the
    rendezvous to `hopnet join`)."""
    assert plan.elastic is not None
    passed = {k: v for k, v in base_env.items() if k.startswith("HOPNET_") and k != "HOPNET_CURVE_KEY"}
    return {"command": list(plan.command), "run_dir": str(run_dir), "explicit": list(plan.explicit_options),
            "elastic": plan.elastic.to_json(), "bind": plan.bind, "env": passed,
            "max_nproc": plan.elastic.max_nproc, "graph": plan.graph.to_dict(),
            "config": json.loads(plan.config.to_json())}


def mark_stopping(run_dir: Path) -> None:
    """Say, before the launcher's SIGTERMs, that they stop the run (:data:`STOP_FILE`)."""
    try:
        (run_dir / STOP_FILE).touch()
    except OSError:
        pass


def left_the_run(run_dir: Path, rank: int) -> bool:
    """Whether ``rank`` left an elastic run that goes on without it (a ``left`` record ends its log):
    its exit is not the run's end."""
    return ends_with_event(run_dir, rank, (b'"event":"left"', b'"event": "left"'), lines=8)


def is_leaving(run_dir: Path, rank: int) -> bool:
    """Whether ``rank`` asked to leave (a preemption's SIGTERM) or left, by the tail of its log: it is on
    its way out, and a SIGTERM from the launcher now would cut its exit short."""
    return ends_with_event(run_dir, rank, (b'"event":"leave_requested"', b'"event": "leave_requested"',
                                           b'"event":"left"', b'"event": "left"'), lines=256)


def read_views(run_dir: Path, first_members: int) -> list[dict[str, Any]]:
    """Every view of the run, from the workers' event logs: who joined, left or died, from which
    iteration (``first_iter``) and when (``mono``, the system's monotonic clock)."""
    views: dict[int, dict[str, Any]] = {0: {"view": 0, "members": list(range(first_members)), "joined": [],
                                            "left": [], "died": [], "refused": [], "mono": None, "first_iter": 0}}
    firsts: dict[int, int] = {}
    for path in sorted(run_dir.glob("rank*.jsonl")):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError:
            continue
        for line in lines:
            if '"view_' not in line and '"joined"' not in line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            event = record.get("event")
            number = record.get("view")
            if not isinstance(number, int):
                continue
            if event == "view_committed" and number not in views:
                views[number] = {"view": number, "members": record.get("members", []),
                                 "joined": record.get("joined", []), "left": record.get("left", []),
                                 "died": record.get("died", []), "refused": record.get("refused", []),
                                 "mono": record.get("mono")}
            elif event in ("view_entered", "joined", "view_change_at") and isinstance(record.get("iter"), int):
                firsts.setdefault(number, record["iter"])
    for number, first in firsts.items():
        if number in views:
            views[number]["first_iter"] = first
    return [views[n] for n in sorted(views)]

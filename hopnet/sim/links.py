"""Link models per machine pair, from a file: ``hopnet simulate --link-model FILE.json``.

    {"links": [
        {"between": ["*", "*"], "latency_ms": 0.05, "gbps": 100},
        {"between": [["m0", "m1"], ["m2", "m3"]], "latency_ms": 30, "gbps": 1, "loss": 0.01, "jitter_ms": 5}
    ]}

Each rule sets the latency, bandwidth, loss and jitter of every worker-to-worker link whose ends
are on machines of its two sides (in either direction), by the graph's ``machine`` labels. A side
is a label, a list of labels, or ``"*"`` (any machine, an unlabelled node included). A rule
may leave out any of ``latency_ms``, ``gbps``, ``loss`` (the share of TCP segments lost, 0 to
1) and ``jitter_ms`` (each segment's extra delay, uniform within +-jitter; see
:mod:`hopnet.transports.link_faults` for what they cost a message). When several rules name a
link, each sets what it gives, in order (the last one wins); what none sets comes from the links'
defaults (``--link-latency-ms``, ``--link-gbps``, ``--link-loss``, ``--link-jitter-ms``), as does
all of a link that no rule names.
Bandwidth is per directed worker-to-worker link, as for ``--link-gbps``: links between the
same two machines do not share it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hopnet.errors import ConfigError
from hopnet.graph import Graph
from hopnet.transports.inproc import LinkModel
from hopnet.transports.link_faults import LinkFaults

ANY = "*"
_RULE_KEYS = ("between", "latency_ms", "gbps", "loss", "jitter_ms")
_SETTINGS = _RULE_KEYS[1:]


@dataclass(frozen=True)
class LinkRule:
    """Links between a machine in ``a`` and one in ``b`` (None: any machine)."""

    a: frozenset[str] | None
    b: frozenset[str] | None
    latency_ms: float | None
    gbps: float | None
    loss: float | None = None
    jitter_ms: float | None = None

    def matches(self, src: str | None, dst: str | None) -> bool:
        return (_on(self.a, src) and _on(self.b, dst)) or (_on(self.a, dst) and _on(self.b, src))

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"between": [_side_json(self.a), _side_json(self.b)]}
        for key in _SETTINGS:
            if getattr(self, key) is not None:
                data[key] = getattr(self, key)
        return data


def _on(side: frozenset[str] | None, machine: str | None) -> bool:
    return side is None or machine in side


def _side_json(side: frozenset[str] | None) -> str | list[str]:
    if side is None:
        return ANY
    return next(iter(side)) if len(side) == 1 else sorted(side)


def parse_rules(data: Any, graph: Graph, where: str = "link model") -> list[LinkRule]:
    """The rules of a link-model document, checked against ``graph``'s machine labels."""
    if not isinstance(data, dict) or set(data) != {"links"} or not isinstance(data["links"], list):
        raise ConfigError(f'{where}: expected {{"links": [RULE, ...]}}')
    labels = {m for m in graph.machines if m is not None}
    return [_rule(item, k, labels, where) for k, item in enumerate(data["links"])]


def _rule(item: Any, k: int, labels: set[str], where: str) -> LinkRule:
    at = f"{where}: links[{k}]"
    if not isinstance(item, dict):
        raise ConfigError(f"{at}: expected an object with between and any of {', '.join(_SETTINGS)}")
    unknown = sorted(set(item) - set(_RULE_KEYS))
    if unknown:
        raise ConfigError(f"{at}: unknown key {unknown[0]!r} (allowed: {', '.join(_RULE_KEYS)})")
    between = item.get("between")
    if not isinstance(between, list) or len(between) != 2:
        raise ConfigError(f'{at}: "between" must be a list of two sides (a machine, a list of machines or "*")')
    if not any(key in item for key in _SETTINGS):
        raise ConfigError(f"{at}: sets neither latency_ms nor gbps, loss or jitter_ms")
    a, b = (_side(side, labels, at) for side in between)
    loss = _number(item, "loss", at)
    if loss is not None and loss >= 1:
        raise ConfigError(f"{at}: loss is a share of segments, from 0 to below 1, got {loss!r}")
    return LinkRule(a, b, _number(item, "latency_ms", at), _number(item, "gbps", at), loss,
                    _number(item, "jitter_ms", at))


def _side(side: Any, labels: set[str], at: str) -> frozenset[str] | None:
    if side == ANY:
        return None
    names = [side] if isinstance(side, str) else side
    if not isinstance(names, list) or not names or not all(isinstance(m, str) for m in names):
        raise ConfigError(f'{at}: a side is a machine label, a non-empty list of labels or "*", got {side!r}')
    missing = sorted(set(names) - labels)
    if missing:
        known = ", ".join(sorted(labels)) or "none"
        raise ConfigError(f"{at}: no node of the graph is on machine {missing[0]!r} (its machines: {known})")
    return frozenset(names)


def _number(item: dict[str, Any], key: str, at: str) -> float | None:
    if key not in item:
        return None
    value = item[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{at}: {key} must be a finite number >= 0, got {value!r}")
    return float(value)


def apply_rules(base: LinkModel, rules: list[LinkRule], graph: Graph) -> LinkModel:
    """``base`` (the default links) with every machine pair that a rule names set by the last such rule."""
    machines = tuple(graph.machines)
    present = sorted(set(machines), key=lambda m: (m is not None, m or ""))
    pairs: dict[tuple[str | None, str | None], tuple[float, float]] = {}
    faults: dict[tuple[str | None, str | None], LinkFaults] = {}
    for src in present:
        for dst in present:
            latency, bandwidth, named = base.latency_s, base.bytes_per_s, False
            loss, jitter_s = base.faults.loss, base.faults.jitter_s
            for rule in rules:
                if rule.matches(src, dst):
                    named = True
                    if rule.latency_ms is not None:
                        latency = rule.latency_ms / 1000.0
                    if rule.gbps is not None:
                        bandwidth = rule.gbps * 1e9 / 8
                    if rule.loss is not None:
                        loss = rule.loss
                    if rule.jitter_ms is not None:
                        jitter_s = rule.jitter_ms / 1000.0
            if named:
                pairs[(src, dst)] = (latency, bandwidth)
                faults[(src, dst)] = LinkFaults(loss, jitter_s)
    if not any(faults.values()) and not base.faults:
        faults = {}
    return replace(base, machines=machines if pairs else (), between_machines=pairs, machine_faults=faults)


def load_link_model(path: str, graph: Graph, base: LinkModel) -> tuple[LinkModel, list[LinkRule]]:
    """Read ``path`` (see the module's docstring): the link model for ``graph`` and its rules."""
    where = f"--link-model {path}"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read file: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not JSON ({exc.msg}, line {exc.lineno})") from None
    rules = parse_rules(data, graph, where)
    return apply_rules(base, rules, graph), rules

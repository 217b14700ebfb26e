"""What a simulated run depends on (:class:`SimSpec`, its :class:`ComputeModel`) and what it reports
(:class:`SimResult`)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hopnet.config import ProtocolConfig
from hopnet.errors import ConfigError
from hopnet.graph import Graph
from hopnet.graph.reform import BuilderSpec
from hopnet.sim import GAP_MATRIX_MAX_N
from hopnet.sim.churn import ChurnSchedule
from hopnet.transports.inproc import LinkModel


@dataclass(frozen=True)
class ComputeModel:
    """Compute time per iteration, in seconds: ``const:MS``, ``uniform:LO:HI``, ``exp:MEAN``
    or ``normal:MEAN:SD`` (milliseconds; a bare number means ``const``), optionally per rank."""

    kind: str = "const"
    a: float = 0.01
    b: float = 0.0
    per_rank: tuple[tuple[int, ComputeModel], ...] = ()

    @classmethod
    def parse(cls, text: str) -> ComputeModel:
        parts = text.strip().split(":")
        try:
            if len(parts) == 1:
                return cls._checked("const", float(parts[0]), 0.0, text)
            kind, numbers = parts[0], [float(x) for x in parts[1:]]
        except ValueError:
            raise ConfigError(f"compute time {text!r}: expected MS, uniform:LO:HI, exp:MEAN or normal:MEAN:SD") from None
        arity = {"const": 1, "uniform": 2, "exp": 1, "normal": 2}
        if kind not in arity or len(numbers) != arity[kind]:
            raise ConfigError(f"compute time {text!r}: expected MS, uniform:LO:HI, exp:MEAN or normal:MEAN:SD")
        return cls._checked(kind, numbers[0], numbers[1] if len(numbers) > 1 else 0.0, text)

    @classmethod
    def _checked(cls, kind: str, a_ms: float, b_ms: float, text: str) -> ComputeModel:
        if not (math.isfinite(a_ms) and math.isfinite(b_ms)) or a_ms < 0 or b_ms < 0:
            raise ConfigError(f"compute time {text!r}: times must be finite and >= 0")
        if kind == "uniform" and b_ms < a_ms:
            raise ConfigError(f"compute time {text!r}: HI must be >= LO")
        return cls(kind, a_ms / 1000.0, b_ms / 1000.0)

    def with_rank(self, rank: int, model: ComputeModel) -> ComputeModel:
        return ComputeModel(self.kind, self.a, self.b, self.per_rank + ((rank, model),))

    def for_rank(self, rank: int) -> ComputeModel:
        for r, model in reversed(self.per_rank):
            if r == rank:
                return model
        return self

    def sample(self, rng: random.Random) -> float:
        if self.kind == "const":
            return self.a
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b)
        if self.kind == "exp":
            return rng.expovariate(1.0 / self.a) if self.a > 0 else 0.0
        return max(0.0, rng.gauss(self.a, self.b))

    @property
    def mean(self) -> float:
        return {"const": self.a, "uniform": (self.a + self.b) / 2, "exp": self.a, "normal": self.a}[self.kind]




@dataclass
class SimSpec:
    """Everything a simulated run depends on."""

    graph: Graph
    config: ProtocolConfig
    iterations: int
    compute: ComputeModel = field(default_factory=ComputeModel)
    link: LinkModel = field(default_factory=LinkModel)
    model_bytes: int = 0
    param_dim: int = 0
    stop_at: dict[int, int] = field(default_factory=dict)
    keep_events: bool = False
    gap_matrix: bool | None = None
    """Keep every pair's largest gap (``SimResult.max_gap``, O(n^2) memory and O(n) per iteration
    entered); ``None``: only up to :data:`GAP_MATRIX_MAX_N` workers. Never with churn."""
    churn: ChurnSchedule | None = None
    """Workers joining and leaving (:mod:`hopnet.sim.churn`): each change is a new view, over the
    graph ``builder`` re-forms for its members (:mod:`hopnet.sim.views`)."""
    builder: BuilderSpec | None = None
    """The builder ``graph`` came from (``ring``, ``torus:2x4``...): needed by a run with churn."""

    def keeps_gap_matrix(self) -> bool:
        if self.churn:
            return False
        return self.graph.n <= GAP_MATRIX_MAX_N if self.gap_matrix is None else self.gap_matrix

    def validate(self) -> None:
        if self.iterations < 1:
            raise ConfigError(f"--iterations must be >= 1 (got {self.iterations})")
        if self.model_bytes < 0 or self.param_dim < 0:
            raise ConfigError("model size must be >= 0")
        for rank, it in self.stop_at.items():
            if not 0 <= rank < self.graph.n:
                raise ConfigError(f"stop_at: rank {rank} out of range")
            if it < 0:
                raise ConfigError(f"stop_at: iteration for rank {rank} must be >= 0")
        self.config.validate_ranks(self.graph.n)  # per-protocol graph checks run when each worker binds
        if self.churn:
            self._validate_churn(self.churn)

    def _validate_churn(self, churn: ChurnSchedule) -> None:
        """What the real runtime refuses for an elastic run, and what the simulator cannot re-form."""
        from hopnet.coordinator import needs_coordinator
        from hopnet.elastic.support import elastic_refusal
        from hopnet.sim.churn import check

        if self.builder is None:
            raise ConfigError("--churn: a fixed graph cannot re-form when workers join or leave: give a builder "
                              "such as --graph ring or --graph torus")
        refusal = elastic_refusal(self.config)
        if refusal is not None:
            raise ConfigError(f"--churn: {refusal}")
        if needs_coordinator(self.config):
            raise ConfigError(f"--churn: --protocol {self.config.protocol} runs with a coordinator, which the simulator "
                              "does not start per view yet")
        if self.stop_at:
            raise ConfigError("--churn with --stop: a worker leaves for good with leave:rankR@T")
        if self.link.overrides or self.link.between_machines:
            raise ConfigError("--churn with --link-model: links per machine pair cannot follow a re-formed graph yet")
        check(churn, range(self.graph.n), self.builder, self.config.seed)


@dataclass
class SimResult:
    n: int
    iterations: list[int]
    finish_times: list[list[float]]
    rates: list[float]
    max_gap: np.ndarray | None
    """``[i][j]``: the largest Iter(i) - Iter(j) observed; None unless the run kept it
    (:attr:`SimSpec.gap_matrix`)."""
    largest_gap: tuple[int, int, int]
    """``(gap, i, j)``: the largest gap between any two workers, and the first pair in rank order
    that showed it."""
    queue_high_water: list[int]
    token_high_water: list[int]
    skips: list[dict[str, Any]]
    virtual_time: float
    wall_seconds: float
    dropped_late_updates: int
    updates_not_sent: int
    params: list[torch.Tensor] | None = None
    events: list[list[dict[str, Any]]] | None = None
    coordinator: dict[str, Any] | None = None
    """The coordinator's summary (group protocols), None when the run had none."""
    coordinator_events: list[dict[str, Any]] | None = None
    counts: list[dict[str, Any]] = field(default_factory=list)
    """Per rank, what a real worker's ``stop`` record would carry of its protocol's counts
    (``protocol.summary()``, and ``skips``): what ``ProtocolSpec.output`` names."""
    views: list[dict[str, Any]] | None = None
    """A run with churn: each view's number, members, who joined and left, when it began (virtual
    time and iteration) and its throughput (:class:`hopnet.sim.views.ViewRecord`); None without churn."""
    churn_skipped: list[str] = field(default_factory=list)
    """Churn events that could not take effect, each with why (a rate's leave with one worker left...)."""

    def to_dict(self, include_wall: bool = False) -> dict[str, Any]:
        data: dict[str, Any] = {
            "n": self.n,
            "iterations": self.iterations,
            "virtual_time": rounded(self.virtual_time),
            "rates": [rounded(r) for r in self.rates],
            "mean_rate": rounded(sum(self.rates) / len(self.rates)),
            "max_gap": None if self.max_gap is None else self.max_gap.tolist(),
            "largest_gap": dict(zip(("gap", "i", "j"), self.largest_gap)),
            "queue_high_water": self.queue_high_water,
            "token_high_water": self.token_high_water,
            "skips": self.skips,
            "dropped_late_updates": self.dropped_late_updates,
            "updates_not_sent": self.updates_not_sent,
            "finish_times": [[rounded(t) for t in ts] for ts in self.finish_times],
        }
        if self.coordinator is not None:
            data["coordinator"] = self.coordinator
        if self.views is not None:
            data["views"] = self.views
            data["churn_skipped"] = self.churn_skipped
        if include_wall:
            data["wall_seconds"] = round(self.wall_seconds, 3)
        return data


def rounded(x: float) -> float:
    return float(f"{x:.9g}")

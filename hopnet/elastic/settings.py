"""An elastic run's settings, as `hopnet launch` and `hopnet join` pass them to a worker."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from hopnet.bootstrap.env import ELASTIC, JOIN
from hopnet.errors import ConfigError

# HOPNET_ELASTIC: JSON {"graph": BUILDER, "min": M, "max": N}, the run is elastic (--min-nproc/--max-nproc);
# HOPNET_JOIN=R1,R2,... in a worker `hopnet join` started: the ranks that join with it (its own among them),
# admitted together.
STOP_FILE = "stopping"
"""The launcher writes this file into the run directory before it stops the workers: a SIGTERM
is then the launcher's, not a preemption (which an elastic worker answers by leaving)."""


@dataclass(frozen=True)
class ElasticSettings:
    graph: str
    """The graph builder every view is formed with (``ring``, ``torus``...)."""
    min_nproc: int
    max_nproc: int
    joining: bool = False
    batch: tuple[int, ...] = ()
    """A joiner's: the ranks of its `hopnet join`, admitted in one view."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_nproc <= self.max_nproc:
            raise ConfigError(f"{ELASTIC}: need 1 <= min ({self.min_nproc}) <= max ({self.max_nproc})")

    def to_json(self) -> str:
        return json.dumps({"graph": self.graph, "min": self.min_nproc, "max": self.max_nproc})

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> ElasticSettings | None:
        text = environ.get(ELASTIC, "").strip()
        if not text:
            return None
        try:
            data = json.loads(text)
            joined = environ.get(JOIN, "").strip()
            batch = tuple(int(r) for r in joined.split(",") if r.strip()) if joined else ()
            return cls(str(data["graph"]), int(data["min"]), int(data["max"]), joining=bool(batch), batch=batch)
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{ELASTIC}={text!r}: {exc}") from None

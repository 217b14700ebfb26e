"""An elastic run's settings, as `hopnet launch` and `hopnet join` pass them to a worker."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from hopnet.bootstrap.env import ELASTIC, JOIN
from hopnet.errors import ConfigError

# HOPNET_ELASTIC: JSON {"graph": BUILDER, "min": M, "max": N}, the run is elastic (--min-nproc/--max-nproc);
# HOPNET_JOIN=1 in a worker `hopnet join` started: it asks the members to admit it.
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
            return cls(str(data["graph"]), int(data["min"]), int(data["max"]),
                       joining=environ.get(JOIN, "").strip() == "1")
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{ELASTIC}={text!r}: {exc}") from None

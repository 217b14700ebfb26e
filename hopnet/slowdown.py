"""Heterogeneity injection: make some workers' compute slower, the same way everywhere.

Specs (repeatable; factors multiply when several apply):

* ``random:FACTOR:PROB`` - each iteration, each worker is FACTOR times slower with
  probability PROB (Hop Sec. 7.3.1 uses ``random:6:0.0625`` for 16 workers).
* ``rank=R:FACTOR`` or ``rank=R1,R2:FACTOR`` - those workers are always FACTOR times
  slower (Hop Sec. 7.3.5, Prague Sec. 7.4).

The draw for (seed, rank, iteration) is a pure function, so the launcher, the examples
and the simulator slow down exactly the same iterations for the same seed.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from hopnet.errors import ConfigError


@dataclass(frozen=True)
class RandomSlowdown:
    factor: float
    probability: float

    def spec(self) -> str:
        return f"random:{self.factor:g}:{self.probability:g}"


@dataclass(frozen=True)
class RankSlowdown:
    ranks: frozenset[int]
    factor: float

    def spec(self) -> str:
        return f"rank={','.join(str(r) for r in sorted(self.ranks))}:{self.factor:g}"


SlowdownRule = RandomSlowdown | RankSlowdown


def _factor(text: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"slowdown {spec!r}: factor {text!r} is not a number") from None
    if not value >= 1.0:
        raise ConfigError(f"slowdown {spec!r}: factor must be >= 1 (got {text})")
    return value


def parse_slowdown(spec: str) -> SlowdownRule:
    """Parse one ``--slowdown`` value. Raises :class:`ConfigError` with a one-line reason."""
    text = spec.strip()
    if text.startswith("random:"):
        parts = text.split(":")
        if len(parts) != 3:
            raise ConfigError(f"slowdown {spec!r}: expected random:FACTOR:PROBABILITY")
        factor = _factor(parts[1], spec)
        try:
            prob = float(parts[2])
        except ValueError:
            raise ConfigError(f"slowdown {spec!r}: probability {parts[2]!r} is not a number") from None
        if not 0.0 <= prob <= 1.0:
            raise ConfigError(f"slowdown {spec!r}: probability must be in [0, 1]")
        return RandomSlowdown(factor, prob)
    if text.startswith("rank="):
        body = text[len("rank="):]
        if ":" not in body:
            raise ConfigError(f"slowdown {spec!r}: expected rank=R:FACTOR")
        ranks_text, factor_text = body.rsplit(":", 1)
        try:
            ranks = frozenset(int(r) for r in ranks_text.split(","))
        except ValueError:
            raise ConfigError(f"slowdown {spec!r}: ranks must be integers") from None
        if any(r < 0 for r in ranks):
            raise ConfigError(f"slowdown {spec!r}: ranks must be >= 0")
        return RankSlowdown(ranks, _factor(factor_text, spec))
    raise ConfigError(f"slowdown {spec!r}: expected random:FACTOR:PROB or rank=R:FACTOR")


class Slowdown:
    """The combined effect of several rules, as a compute-time multiplier."""

    def __init__(self, rules: list[SlowdownRule] | tuple[SlowdownRule, ...] = (), seed: int = 0) -> None:
        self.rules = tuple(rules)
        self.seed = seed

    @classmethod
    def from_specs(cls, specs: list[str] | tuple[str, ...], seed: int = 0) -> Slowdown:
        return cls([parse_slowdown(s) for s in specs], seed)

    def validate_ranks(self, world_size: int) -> None:
        for rule in self.rules:
            if isinstance(rule, RankSlowdown):
                bad = sorted(r for r in rule.ranks if r >= world_size)
                if bad:
                    raise ConfigError(f"slowdown {rule.spec()!r}: rank {bad[0]} out of range "
                                      f"(there are {world_size} workers)")

    def __bool__(self) -> bool:
        return bool(self.rules)

    def _uniform(self, rank: int, iteration: int, rule_index: int) -> float:
        digest = hashlib.blake2b(struct.pack("<qqqq", self.seed, rank, iteration, rule_index),
                                 digest_size=8).digest()
        return int.from_bytes(digest, "little") / 2.0**64

    def factor(self, rank: int, iteration: int) -> float:
        """How many times slower ``rank``'s compute is in ``iteration`` (1.0 = normal)."""
        total = 1.0
        for index, rule in enumerate(self.rules):
            if isinstance(rule, RankSlowdown):
                if rank in rule.ranks:
                    total *= rule.factor
            elif rule.probability > 0 and self._uniform(rank, iteration, index) < rule.probability:
                total *= rule.factor
        return total

    def specs(self) -> list[str]:
        return [r.spec() for r in self.rules]

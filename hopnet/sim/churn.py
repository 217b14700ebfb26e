"""Churn schedules for ``hopnet simulate``: workers joining and leaving at virtual times.

    --churn "join:2@0.5s,leave:1@1s,leave:rank3@1500ms"
    --churn-rate join=0.5,leave=0.5

An explicit event is ``join:K@T`` (K new workers), ``leave:K@T`` (K members, picked by the seed)
or ``leave:rankR@T`` (rank R); ``T`` is virtual time in ``s`` or ``ms`` (a bare number is
seconds). Rates are Poisson arrivals per virtual second, one worker each, drawn from the seed.
Events at the same instant make one view. A joiner's rank counts up from the first world size
and is never reused, as the rendezvous gives them.

Nothing here imports torch: the command checks a schedule before it loads the simulator.
"""

from __future__ import annotations

import heapq
import math
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from hopnet.errors import ConfigError, GraphError
from hopnet.graph.reform import BuilderSpec

JOIN, LEAVE = "join", "leave"
EVENT_USAGE = "expected join:K@T, leave:K@T or leave:rankR@T (T in s or ms, e.g. 30s, 500ms)"
RATE_USAGE = "expected join=RATE,leave=RATE (workers per virtual second, either may be left out)"
_EVENT = re.compile(r"(join|leave):(rank)?(\d+)@([0-9.eE+-]+)(s|ms)?")


@dataclass(frozen=True)
class ChurnEvent:
    """``count`` workers join or leave at virtual time ``at_s``; a leave may name its ``rank``."""

    kind: str
    at_s: float
    count: int = 1
    rank: int | None = None
    text: str = ""

    def describe(self) -> str:
        return self.text or f"{self.kind}:{'rank' + str(self.rank) if self.rank is not None else self.count}" \
                            f"@{self.at_s:g}s"


@dataclass(frozen=True)
class ChurnSchedule:
    """Explicit events (in time order; ties keep their order) and Poisson rates per virtual second."""

    events: tuple[ChurnEvent, ...] = ()
    join_rate: float = 0.0
    leave_rate: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.events) or self.join_rate > 0 or self.leave_rate > 0

    @property
    def explicit_joins(self) -> int:
        return sum(e.count for e in self.events if e.kind == JOIN)

    def to_dict(self) -> dict[str, object]:
        return {"events": [e.describe() for e in self.events],
                "rates": {JOIN: self.join_rate, LEAVE: self.leave_rate}}


def parse_events(text: str) -> tuple[ChurnEvent, ...]:
    """``--churn``: comma-separated events, returned in time order."""
    events = []
    for item in (part.strip() for part in text.split(",")):
        match = _EVENT.fullmatch(item.replace(" ", "").lower())
        if match is None:
            raise ConfigError(f"--churn {item!r}: {EVENT_USAGE}")
        kind, by_rank, number, time_text, unit = match.groups()
        try:
            at_s = float(time_text) / (1000.0 if unit == "ms" else 1.0)
        except ValueError:
            raise ConfigError(f"--churn {item!r}: {EVENT_USAGE}") from None
        if not math.isfinite(at_s) or at_s < 0:
            raise ConfigError(f"--churn {item!r}: the time must be finite and >= 0")
        if by_rank and kind == JOIN:
            raise ConfigError(f"--churn {item!r}: a joiner's rank is given to it (join:K@T)")
        if not by_rank and int(number) < 1:
            raise ConfigError(f"--churn {item!r}: K must be >= 1")
        events.append(ChurnEvent(kind, at_s, 1 if by_rank else int(number), int(number) if by_rank else None, item))
    return tuple(sorted(events, key=lambda e: e.at_s))


def parse_rates(text: str) -> tuple[float, float]:
    """``--churn-rate``: ``(join_rate, leave_rate)`` per virtual second."""
    rates = {JOIN: 0.0, LEAVE: 0.0}
    seen: set[str] = set()
    for item in (part.strip() for part in text.split(",")):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in rates or key in seen:
            raise ConfigError(f"--churn-rate {text!r}: {RATE_USAGE}")
        try:
            rate = float(value)
        except ValueError:
            raise ConfigError(f"--churn-rate {text!r}: {key} rate {value.strip()!r} is not a number") from None
        if not math.isfinite(rate) or rate < 0:
            raise ConfigError(f"--churn-rate {text!r}: a rate must be finite and >= 0")
        rates[key] = rate
        seen.add(key)
    return rates[JOIN], rates[LEAVE]


def parse_schedule(churn: Sequence[str], churn_rate: str | None) -> ChurnSchedule:
    """The schedule that ``--churn`` (repeatable) and ``--churn-rate`` give."""
    events = tuple(sorted((e for text in churn for e in parse_events(text)), key=lambda e: e.at_s))
    join_rate, leave_rate = parse_rates(churn_rate) if churn_rate is not None else (0.0, 0.0)
    return ChurnSchedule(events, join_rate, leave_rate)


# ------------------------------------------------------------------------ applying events
@dataclass
class Change:
    """What one instant's events did to the members."""

    members: tuple[int, ...]
    joined: tuple[int, ...] = ()
    left: tuple[int, ...] = ()
    skipped: list[str] = field(default_factory=list)
    """The events that could not take effect, each with why."""


def takes(builder: BuilderSpec, count: int) -> str | None:
    """Why the graph cannot re-form over ``count`` members (None: it can)."""
    if count < 1:
        return "it would leave no worker"
    try:
        builder.args_for(count)
    except GraphError as exc:
        return f"the graph cannot take {count} workers ({exc})"
    return None


class Membership:
    """The members as events change them: joiners get the next ranks, ``leave:K`` picks by the seed."""

    def __init__(self, members: Sequence[int], builder: BuilderSpec, seed: int) -> None:
        self.members = tuple(sorted(members))
        self.next_rank = max(self.members, default=-1) + 1
        self.builder = builder
        self._picks = random.Random(f"{seed}:churn-leavers")

    def apply(self, events: Sequence[ChurnEvent]) -> Change:
        """Apply ``events`` (one instant's) in order; one that cannot take effect is skipped, with why."""
        before = set(self.members)
        members = set(before)
        joined: list[int] = []
        skipped = []
        for event in events:
            if event.kind == JOIN:
                why = takes(self.builder, len(members) + event.count)
                if why is None:
                    new = list(range(self.next_rank, self.next_rank + event.count))
                    self.next_rank += event.count
                    joined += new
                    members.update(new)
            elif event.rank is not None:
                why = None if event.rank in members and event.rank in before else \
                    f"rank {event.rank} is not a member then"
                if why is None and members & before == {event.rank}:
                    why = "no member of the view before would stay (a joiner copies one's model)"
                why = why or takes(self.builder, len(members) - 1)
                if why is None:
                    members.discard(event.rank)
            else:
                why = takes(self.builder, len(members) - event.count)
                candidates = sorted(members & before)
                if why is None and len(candidates) <= event.count:
                    why = "no member of the view before would stay (a joiner copies one's model)" \
                        if len(candidates) == event.count else f"only {len(candidates)} member(s) can leave then"
                if why is None:
                    members.difference_update(self._picks.sample(candidates, event.count))
            if why is not None:
                skipped.append(f"{event.describe()!r}: {why}")
        self.members = tuple(sorted(members))
        return Change(self.members, tuple(joined), tuple(sorted(before - members)), skipped)


def check(schedule: ChurnSchedule, members: Sequence[int], builder: BuilderSpec, seed: int) -> None:
    """Refuse, in one line, an explicit event that could not take effect (rates are not known ahead:
    those events are skipped when they come, and counted)."""
    membership = Membership(members, builder, seed)
    for _, events in _instants(iter(schedule.events)):
        before = membership.members
        change = membership.apply(events)
        if change.skipped:
            shown = ", ".join(map(str, before[:16])) + (", ..." if len(before) > 16 else "")
            raise ConfigError(f"--churn {change.skipped[0]} (members then: {shown})")


def _instants(events: Iterator[ChurnEvent]) -> Iterator[tuple[float, list[ChurnEvent]]]:
    group: list[ChurnEvent] = []
    for event in events:
        if group and event.at_s != group[0].at_s:
            yield group[0].at_s, group
            group = []
        group.append(event)
    if group:
        yield group[0].at_s, group


def _poisson(kind: str, rate: float, seed: int) -> Iterator[ChurnEvent]:
    if rate <= 0:
        return
    rng = random.Random(f"{seed}:churn-{kind}")
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        yield ChurnEvent(kind, t, 1, None, f"{kind}:1@{t:.6g}s (--churn-rate)")


def instants(schedule: ChurnSchedule, seed: int) -> Iterator[tuple[float, list[ChurnEvent]]]:
    """The schedule's events grouped by instant, in time order, the Poisson arrivals drawn as they come
    (endless when a rate is set: the run's end stops the reader)."""
    streams = [iter(schedule.events), _poisson(JOIN, schedule.join_rate, seed),
               _poisson(LEAVE, schedule.leave_rate, seed)]
    merged = heapq.merge(*streams, key=lambda e: e.at_s)
    return _instants(merged)


__all__ = ["Change", "ChurnEvent", "ChurnSchedule", "Membership", "check", "instants", "parse_events",
           "parse_rates", "parse_schedule", "takes"]

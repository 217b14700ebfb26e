"""Where a step's time went: the Node times each step the trainer runs through its protocol and
splits it, in the iteration record, into computing, waiting for updates, waiting for tokens and
mixing (the rest).

The protocol finishes an iteration inside the step (``Node.iteration_done``); its record waits
here until the step ends and its timings are known."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hopnet.runtime.services import Timer


class StepTimes:
    """Where the current step's time went so far (seconds); reset at the start of each step."""

    __slots__ = ("wait_updates", "wait_tokens", "apply", "updates_from", "tokens_from")

    def __init__(self) -> None:
        self.wait_updates = 0.0
        self.wait_tokens = 0.0
        self.apply = 0.0
        self.updates_from: dict[int, float] = {}
        """Seconds of ``wait_updates`` blamed on each peer (the protocols that name it)."""
        self.tokens_from: dict[int, float] = {}

    def reset(self) -> None:
        self.wait_updates = self.wait_tokens = self.apply = 0.0
        if self.updates_from:
            self.updates_from.clear()
        if self.tokens_from:
            self.tokens_from.clear()


class StepTiming:
    """Times the step in progress and completes the iteration record it finished."""

    def __init__(self, timer: Timer) -> None:
        self.timer = timer
        self.times = StepTimes()
        self._in_step = False
        self._finished: dict[str, Any] | None = None  # the record of the iteration the step finished
        self._step_ended: float | None = None

    def start(self) -> float:
        """A step begins: returns when."""
        self.times.reset()
        began = self.timer()
        self._in_step = True
        return began

    def timed_apply(self, apply: Callable[[], None]) -> Callable[[], None]:
        """``apply``, its time counted as computing."""
        def timed() -> None:
            began = self.timer()
            try:
                apply()
            finally:
                self.times.apply += self.timer() - began
        return timed

    def waited(self, what: str, seconds: float, peers: Sequence[int] = ()) -> None:
        """The protocol waited ``seconds`` for ``"updates"`` or ``"tokens"`` (acks count as tokens);
        ``peers``: the neighbours it waited on (the wait is split evenly between them)."""
        times = self.times
        if what == "updates":
            times.wait_updates += seconds
            by_peer = times.updates_from
        else:
            times.wait_tokens += seconds
            by_peer = times.tokens_from
        for peer in peers:
            by_peer[peer] = by_peer.get(peer, 0.0) + seconds / len(peers)

    def keep_until_step_ends(self, record: dict[str, Any]) -> bool:
        """Keep an iteration's record for the step in progress to complete; False outside a step."""
        if not self._in_step:
            return False
        self._finished = record
        return True

    def end(self, began: float, compute_s: float) -> dict[str, Any] | None:
        """The step that began at ``began`` ended: the record of the iteration it finished, with the
        step's timings, or None if it finished none. ``compute_s`` is the trainer's time since its
        previous step returned."""
        self._in_step = False
        record = self._finished
        if record is None:
            return None
        self._finished = None
        times = self.times
        ended = self.timer()
        waited = times.wait_updates + times.wait_tokens
        record["compute_s"] = round(compute_s + times.apply, 6)
        record["wait_updates_s"] = round(times.wait_updates, 6)
        record["wait_tokens_s"] = round(times.wait_tokens, 6)
        # The rest of the interval since the previous step ended, so that the parts add
        # up to it: the hand-overs between the trainer and the loop count as mixing.
        since = began if self._step_ended is None else self._step_ended + compute_s
        record["mix_s"] = round(max(0.0, ended - since - waited - times.apply), 6)
        if times.updates_from:
            record["wait_updates_from"] = _by_peer(times.updates_from)
        if times.tokens_from:
            record["wait_tokens_from"] = _by_peer(times.tokens_from)
        record["mono"] = ended
        self._step_ended = ended
        return record


def _by_peer(seconds: dict[int, float]) -> dict[str, float]:
    """A per-peer wait as the record writes it: JSON keys are strings."""
    return {str(peer): round(s, 6) for peer, s in sorted(seconds.items())}

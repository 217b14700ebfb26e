"""An example trainer (``--example NAME``, default train_digits.py), unchanged, whose workers wait
at given iterations until their own membership has committed given joins or leaves, for the elastic
process tests: the run then cannot outrun its joiners and leavers however busy the machine, and it
needs hundreds of iterations rather than thousands.

``--view-gate 300:joined=4,5`` holds each worker before its optimizer step at its first iteration
from 300 on, until the views committed so far (its event log's ``view_committed`` records) have
admitted ranks 4 and 5; ``--view-gate 600:left=2``, until they have let rank 2 leave
(``died=2``: taken rank 2 for dead; in a run of
replica groups the ranks are replicas, as the views name them). A joiner that
enters after a gate's iteration checks that gate at its first step. A gate gives up after
``GATE_TIMEOUT_S``, and the run goes on (the test's own checks then fail, not hang). The wait sits in
the trainer's thread, so the membership, which commits on the event loop, is not held up."""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path

from hopnet.optim import DistributedOptimizer

GATE_TIMEOUT_S = 120.0
POLL_S = 0.05


class ViewLog:
    """The joins and leaves that this worker's event log shows committed, read as it grows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.seen: dict[str, set[int]] = {"joined": set(), "left": set(), "died": set()}

    def read(self) -> dict[str, set[int]]:
        try:
            with self.path.open("rb") as log:
                log.seek(self.offset)
                chunk = log.read()
        except OSError:
            return self.seen
        whole = chunk[:chunk.rfind(b"\n") + 1]  # a partial last line is read again next time
        self.offset += len(whole)
        for line in whole.splitlines():
            record = json.loads(line)
            if record.get("event") == "view_committed":
                for kind, ranks in self.seen.items():
                    ranks.update(record.get(kind, []))
        return self.seen


def parse_gate(text: str) -> tuple[int, str, set[int]]:
    at, _, condition = text.partition(":")
    kind, _, ranks = condition.partition("=")
    if kind not in ("joined", "left", "died"):
        raise SystemExit(f"view_gated.py: --view-gate {text}: expected ITER:joined=R,..., ITER:left=R,... or "
                         "ITER:died=R,...")
    return int(at), kind, {int(rank) for rank in ranks.split(",")}


gates: list[tuple[int, str, set[int]]] = []
while "--view-gate" in sys.argv:
    at = sys.argv.index("--view-gate")
    gates.append(parse_gate(sys.argv[at + 1]))
    del sys.argv[at:at + 2]
gates.sort()
example = "train_digits.py"
if "--example" in sys.argv:
    at = sys.argv.index("--example")
    example = sys.argv[at + 1]
    del sys.argv[at:at + 2]
# in a run of replica groups the views name replicas, and member 0's log (rank{R}.jsonl) holds them
replica_size = int(os.environ.get("HOPNET_REPLICA_SIZE") or 1)
views = ViewLog(Path(os.environ["HOPNET_RUN_DIR"]) / f"rank{int(os.environ['HOPNET_RANK']) // replica_size}.jsonl")
step = DistributedOptimizer.step


def gated(self: DistributedOptimizer, closure=None):  # type: ignore[no-untyped-def]
    iteration = self.worker.iteration
    while gates and iteration >= gates[0][0]:
        _, kind, ranks = gates.pop(0)
        deadline = time.monotonic() + GATE_TIMEOUT_S
        while not ranks <= views.read()[kind] and time.monotonic() < deadline:
            time.sleep(POLL_S)
        self.worker.record("view_gate", iter=iteration, kind=kind, ranks=sorted(ranks),
                           opened=ranks <= views.seen[kind])
    return step(self, closure)


DistributedOptimizer.step = gated  # type: ignore[method-assign]
script = Path(__file__).resolve().parents[2] / "examples" / example
sys.argv[0] = str(script)
sys.path.insert(0, str(script.parent))  # its digits_data module
runpy.run_path(str(script), run_name="__main__")

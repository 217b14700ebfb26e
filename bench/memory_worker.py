"""One worker of bench/memory.py: examples/synthetic.py, with its peak RSS written down.

Run by ``hopnet launch`` in place of the example (same arguments); ``$HOPNET_MEMORY_EXAMPLE``
names another example to run instead (bench/lm.py --table memory: examples/train_lm.py). Before the example
builds its model it resets the process's RSS high-water mark (``/proc/self/clear_refs``)
and reads the RSS; after the example returns it reads the high-water mark, and writes both
to ``$HOPNET_MEMORY_OUT/rank<R>.json``. torch and hopnet are imported first, so the
baseline holds them (the fork server imported them already).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

import torch  # noqa: F401  (in the baseline)

import hopnet  # noqa: F401  (in the baseline)

SYNTHETIC = Path(__file__).resolve().parent.parent / "examples" / "synthetic.py"


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    baseline = status_kb("VmRSS")
    example = Path(os.environ.get("HOPNET_MEMORY_EXAMPLE", SYNTHETIC))
    sys.argv = [str(example), *sys.argv[1:]]
    sys.path.insert(0, str(example.parent))  # its own imports (train_lm.py's lm_data), as when run directly
    runpy.run_path(str(example), run_name="__main__")
    peak = status_kb("VmHWM")
    out = Path(os.environ["HOPNET_MEMORY_OUT"])
    rank = os.environ.get("HOPNET_RANK", "0")
    (out / f"rank{rank}.json").write_text(json.dumps({"baseline_kb": baseline, "peak_kb": peak}))


if __name__ == "__main__":
    main()

"""bench/replica_worker.py (an MLP of --model-mb MB, AdamW) in a process whose address space is capped
at --cap-mb MB (RLIMIT_AS, as `ulimit -v` sets it): tests/test_replicas.py's memory budget."""

from __future__ import annotations

import resource
import runpy
import sys
from pathlib import Path

cap_mb = int(sys.argv[sys.argv.index("--cap-mb") + 1])
del sys.argv[sys.argv.index("--cap-mb"):sys.argv.index("--cap-mb") + 2]
resource.setrlimit(resource.RLIMIT_AS, (cap_mb << 20, cap_mb << 20))
script = Path(__file__).resolve().parents[2] / "bench" / "replica_worker.py"
sys.argv[0] = str(script)
runpy.run_path(str(script), run_name="__main__")

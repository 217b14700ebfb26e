"""bench/replica_worker.py (an MLP of --model-mb MB, AdamW) in a process whose address space is capped
at --cap-mb MB (RLIMIT_AS, as `ulimit -v` sets it; 0: no cap): tests/test_replicas.py's memory budget.
glibc keeps at most 2 malloc arenas here, so the address space follows what the process allocates
rather than how many threads touched malloc (each arena reserves 64 MB of it)."""

from __future__ import annotations

import ctypes
import resource
import runpy
import sys
from pathlib import Path

M_ARENA_MAX = -8
ctypes.CDLL(None).mallopt(M_ARENA_MAX, 2)
cap_mb = int(sys.argv[sys.argv.index("--cap-mb") + 1])
del sys.argv[sys.argv.index("--cap-mb"):sys.argv.index("--cap-mb") + 2]
if cap_mb:
    resource.setrlimit(resource.RLIMIT_AS, (cap_mb << 20, cap_mb << 20))
script = Path(__file__).resolve().parents[2] / "bench" / "replica_worker.py"
sys.argv[0] = str(script)
runpy.run_path(str(script), run_name="__main__")

"""bench/replica_worker.py (an MLP of --model-mb MB, AdamW) in a process whose address space may grow
by --budget-mb MB beyond what it holds when this script starts (torch, hopnet and whatever its fork
server imported: RLIMIT_AS, as `ulimit -v` sets it; 0: no cap): tests/test_replicas.py's memory budget.
glibc keeps at most 2 malloc arenas here, so the address space follows what the process allocates
rather than how many threads touched malloc (each arena reserves 64 MB of it)."""

from __future__ import annotations

import ctypes
import re
import resource
import runpy
import sys
from pathlib import Path

M_ARENA_MAX = -8
ctypes.CDLL(None).mallopt(M_ARENA_MAX, 2)
budget_mb = int(sys.argv[sys.argv.index("--budget-mb") + 1])
del sys.argv[sys.argv.index("--budget-mb"):sys.argv.index("--budget-mb") + 2]
if budget_mb:
    start_kb = int(re.search(r"^VmSize:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE).group(1))
    cap = (start_kb << 10) + (budget_mb << 20)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
script = Path(__file__).resolve().parents[2] / "bench" / "replica_worker.py"
sys.argv[0] = str(script)
runpy.run_path(str(script), run_name="__main__")

"""A worker for tests/test_process_titles.py started without `hopnet launch` (as srun would):
after hopnet.init it prints its own process title, then leaves."""

from __future__ import annotations

from pathlib import Path

import torch

import hopnet

with hopnet.init(torch.nn.Linear(2, 1)):
    title = Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    print(f"TITLE {title}", flush=True)

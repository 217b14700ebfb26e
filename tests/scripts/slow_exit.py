"""A worker for tests/test_exit_bound.py: every rank trains a few steps on a real worker and
closes it; then rank 1 blocks its own exit (``thread``: a non-daemon thread that never ends;
``atexit``: an atexit handler that hangs), or (``training``) keeps training instead of closing."""

from __future__ import annotations

import atexit
import sys
import threading
import time

import torch

import hopnet

how = sys.argv[1]
worker = hopnet.init(params=torch.zeros(8))
rank = worker.rank
for _ in worker.iterations(20):
    worker.step()
if rank == 1 and how == "training":
    while True:  # still "training": never closes
        time.sleep(0.1)
worker.close()
if rank == 1 and how == "thread":
    threading.Thread(target=lambda: time.sleep(3600), daemon=False).start()
if rank == 1 and how == "atexit":
    atexit.register(lambda: time.sleep(3600))

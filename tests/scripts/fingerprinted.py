"""An example trainer (``--example NAME``, default train_cnn.py), unchanged, with a digest of this
process's parameters recorded after every optimizer step (a ``fingerprint`` record):
tests/test_replicas.py compares a replica's members."""

from __future__ import annotations

import hashlib
import runpy
import sys
from pathlib import Path

import torch

from hopnet.optim import DistributedOptimizer

step = DistributedOptimizer.step


def fingerprinted(self: DistributedOptimizer, closure=None):  # type: ignore[no-untyped-def]
    iteration = self.worker.iteration
    out = step(self, closure)
    digest = hashlib.sha1()
    for group in self.param_groups:
        for param in group["params"]:
            local = param.to_local() if hasattr(param, "to_local") else param
            digest.update(local.detach().contiguous().view(torch.uint8).numpy().tobytes())
    self.worker.record("fingerprint", iter=iteration, digest=digest.hexdigest())
    return out


DistributedOptimizer.step = fingerprinted  # type: ignore[method-assign]
example = "train_cnn.py"
if "--example" in sys.argv:
    at = sys.argv.index("--example")
    example = sys.argv[at + 1]
    del sys.argv[at:at + 2]
script = Path(__file__).resolve().parents[2] / "examples" / example
sys.argv[0] = str(script)
sys.path.insert(0, str(script.parent))  # its digits_data module
runpy.run_path(str(script), run_name="__main__")

"""An example trainer (``--example NAME``, default train_cnn.py), unchanged, with a digest of this
process's parameters recorded after every optimizer step and after the consensus (a ``fingerprint``
record, ``iter`` -1 for the consensus): tests/test_replicas.py compares a replica's members."""

from __future__ import annotations

import hashlib
import runpy
import sys
from pathlib import Path

import torch

from hopnet.api import Worker
from hopnet.optim import DistributedOptimizer

step = DistributedOptimizer.step
consensus = Worker.consensus
trained: list[torch.Tensor] = []


def _digest(params: list[torch.Tensor]) -> str:
    digest = hashlib.sha1()
    for param in params:
        local = param.to_local() if hasattr(param, "to_local") else param
        digest.update(local.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def fingerprinted(self: DistributedOptimizer, closure=None):  # type: ignore[no-untyped-def]
    iteration = self.worker.iteration
    out = step(self, closure)
    trained[:] = [param for group in self.param_groups for param in group["params"]]
    self.worker.record("fingerprint", iter=iteration, digest=_digest(trained))
    return out


def fingerprinted_consensus(self: Worker, *args, **kwargs):  # type: ignore[no-untyped-def]
    out = consensus(self, *args, **kwargs)
    self.record("fingerprint", iter=-1, digest=_digest(trained))
    return out


DistributedOptimizer.step = fingerprinted  # type: ignore[method-assign]
Worker.consensus = fingerprinted_consensus  # type: ignore[method-assign]
example = "train_cnn.py"
if "--example" in sys.argv:
    at = sys.argv.index("--example")
    example = sys.argv[at + 1]
    del sys.argv[at:at + 2]
script = Path(__file__).resolve().parents[2] / "examples" / example
sys.argv[0] = str(script)
sys.path.insert(0, str(script.parent))  # its digits_data module
runpy.run_path(str(script), run_name="__main__")

"""One worker of bench/checkpoint_stall.py: sleep-emulated compute, a real model of --model-mb MB
with SGD momentum, and rank 0 alone saving a checkpoint every --every iterations.

Only rank 0 saves, so that the others' waits show what its checkpoints cost them (when every
rank saves at the same iteration, all are late alike and nobody waits). Rank 0 records
``checkpoint_cost`` with the seconds ``save_checkpoint`` took it (the copy, and the wait for a
previous write still running). ``--writer torch`` writes as hopnet did before format 2
(``torch.save`` into a buffered file, then fsync and rename), for the before/after comparison.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch

import hopnet
from hopnet import checkpoint

BYTES_PER_MB = 1_000_000


def torch_save_write(payload: dict[str, Any], path: Path) -> None:
    """hopnet's write_atomic before format 2."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(partial, "wb") as stream:
        torch.save(payload, stream)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(partial, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writer", choices=["format2", "torch", "none"], default="format2")
    parser.add_argument("--model-mb", type=float, default=16.0)
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--iterations", type=int, default=120)
    parser.add_argument("--every", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.writer == "torch":
        checkpoint.write_atomic = torch_save_write  # type: ignore[assignment]
    numel = max(1, int(args.model_mb * BYTES_PER_MB) // 4)
    model = torch.nn.Linear(numel, 1, bias=False)
    worker = hopnet.init(model)
    optimizer = hopnet.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9), worker)
    saving = worker.rank == 0 and args.writer != "none"
    if saving:
        directory = Path(os.environ["HOPNET_RUN_DIR"]) / "checkpoints"
        worker.checkpointer = checkpoint.Checkpointer(directory, 0, every=0)  # saved below, by hand
    for it in worker.iterations(args.iterations):
        time.sleep(args.compute_ms / 1e3)
        optimizer.zero_grad()
        model.weight.grad.normal_()  # type: ignore[union-attr]
        optimizer.step()
        if saving and (it + 1) % args.every == 0 and it < args.iterations - 1:
            began = time.perf_counter()
            worker.save_checkpoint(it)
            worker.record("checkpoint_cost", iter=it, save_s=time.perf_counter() - began)
    worker.close()


if __name__ == "__main__":
    main()

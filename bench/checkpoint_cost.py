"""What one checkpoint costs a worker: the copy of its state and the atomic write
(:class:`hopnet.checkpoint.Checkpointer`), for the digits MLP and a ~100 MB model with SGD momentum.

    python bench/checkpoint_cost.py [--dir DIR] [--repeats 5]

The trainer (and so, under the synchronous protocols, its neighbours) waits only for the copy;
the write runs in a background thread (``Worker.save_checkpoint``), and is waited for only
when the next checkpoint comes before it is done.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hopnet import checkpoint


def models() -> dict[str, torch.nn.Module]:
    return {"digits MLP (4.8k params)": torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                                             torch.nn.Linear(64, 10)),
            "~100 MB MLP (25M params)": torch.nn.Sequential(*[torch.nn.Linear(2500, 2500) for _ in range(4)])}


def measure(model: torch.nn.Module, directory: Path, repeats: int) -> tuple[float, float, float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, model[0].in_features)).sum().backward()
    optimizer.step()  # momentum buffers exist, as in training
    writer = checkpoint.Checkpointer(directory, rank=0, every=1)
    copies, writes = [], []
    for i in range(repeats):
        started = time.perf_counter()
        payload = checkpoint.copied({"iteration": i, "model": model.state_dict(),
                                     "states": {"optimizer": optimizer.state_dict()}, "rng": checkpoint.rng_states()})
        copied = time.perf_counter()
        writer.save(i, payload)
        copies.append(copied - started)
        writes.append(time.perf_counter() - copied)
    size = (directory / checkpoint.checkpoint_name(0, repeats - 1)).stat().st_size
    return statistics.median(copies) * 1e3, statistics.median(writes) * 1e3, size / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name, model in models().items():
        with tempfile.TemporaryDirectory(dir=args.dir) as folder:
            copy_ms, write_ms, mb = measure(model, Path(folder), args.repeats)
        print(f"{name}: {mb:.1f} MB file, copy {copy_ms:.1f} ms, write+fsync+rename {write_ms:.1f} ms "
              f"(median of {args.repeats})", flush=True)


if __name__ == "__main__":
    main()

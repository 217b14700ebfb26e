"""What one checkpoint costs a worker: the copy of its state, the atomic write
(:class:`hopnet.checkpoint.Checkpointer`), and how long the writer thread holds the GIL, for the
digits MLP and a ~100 MB model with SGD momentum; format 2 (:func:`hopnet.checkpoint.dump`)
against ``torch.save`` (format 1, what hopnet wrote before).

    python bench/checkpoint_cost.py [--dir DIR] [--repeats 5]

The trainer (and so, under the synchronous protocols, its neighbours) waits only for the copy;
the write runs in a background thread (``Worker.save_checkpoint``), and is waited for only
when the next checkpoint comes before it is done. What the writer still takes from the
trainer's thread and the node's event loop is the time it holds the GIL: measured as the
writer's CPU time serialising into a sink that discards the bytes (no system call, so all of
that CPU time is spent holding the GIL, unless the serialiser releases it, which format 2 does
around every tensor's write(2)). CPU time, not wall time: the load of a shared machine
hardly changes it.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hopnet import checkpoint


def models() -> dict[str, torch.nn.Module]:
    return {"digits MLP (4.8k params)": torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                                             torch.nn.Linear(64, 10)),
            "~100 MB MLP (25M params)": torch.nn.Sequential(*[torch.nn.Linear(2500, 2500) for _ in range(4)])}


class Discard(io.RawIOBase):
    """A stream that takes every byte and keeps none: serialising into it makes no system call."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return memoryview(data).nbytes


def torch_save_write(payload: dict[str, Any], path: Path) -> None:
    """hopnet's write_atomic before format 2."""
    partial = path.with_name(f".{path.name}.tmp")
    with open(partial, "wb") as stream:
        torch.save(payload, stream)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(partial, path)


WRITERS: dict[str, tuple[Callable[[dict[str, Any], Path], None], Callable[[Any, Any], None]]] = {
    "torch.save": (torch_save_write, lambda payload, stream: torch.save(payload, stream)),
    "format 2": (checkpoint.write_atomic, checkpoint.dump),
}


def measure(model: torch.nn.Module, directory: Path, repeats: int) -> dict[str, list[float]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, model[0].in_features)).sum().backward()
    optimizer.step()  # momentum buffers exist, as in training
    found: dict[str, list[float]] = {"copy": [], "size": []}
    for i in range(repeats):
        started = time.perf_counter()
        payload = checkpoint.copied({"iteration": i, "model": model.state_dict(),
                                     "states": {"optimizer": optimizer.state_dict()}, "rng": checkpoint.rng_states()})
        found["copy"].append(time.perf_counter() - started)
        for name, (write, serialise) in WRITERS.items():  # alternated: the machine's load hits both alike
            path = directory / f"{name}-{i}.pt"
            began = time.perf_counter()
            write(payload, path)
            found.setdefault(f"{name} write", []).append(time.perf_counter() - began)
            found["size"].append(path.stat().st_size)
            path.unlink()
            cpu = time.thread_time()
            serialise(payload, Discard())
            found.setdefault(f"{name} gil", []).append(time.thread_time() - cpu)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name, model in models().items():
        with tempfile.TemporaryDirectory(dir=args.dir) as folder:
            found = measure(model, Path(folder), args.repeats)
        ms = {key: statistics.median(values) * 1e3 for key, values in found.items() if key != "size"}
        print(f"{name}: {max(found['size']) / 1e6:.1f} MB file, copy {ms['copy']:.2f} ms; "
              + "; ".join(f"{writer}: write+fsync+rename {ms[f'{writer} write']:.1f} ms, "
                          f"GIL held {ms[f'{writer} gil']:.2f} ms" for writer in WRITERS)
              + f" (medians of {args.repeats})", flush=True)


if __name__ == "__main__":
    main()

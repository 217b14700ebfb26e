"""torch DDP's reference runs, whose parameters hopnet's gradient protocols must match.

A DDP script (tests/workers/ddp_*.py) joins its group with :func:`init_gloo`, which reads
torchrun's variables (``RANK``, ``WORLD_SIZE``) or, failing them, `hopnet launch`'s
(``HOPNET_RANK``, ``HOPNET_WORLD_SIZE``, and the run's store ``HOPNET_STORE``).
:func:`run_ddp` runs one on ``world`` processes that `hopnet launch`'s fork server forks (the
script never calls ``hopnet.init``: hopnet only starts the processes). torchrun would start each
as a fresh interpreter, about 2.5 CPU-s of imports apiece; what the processes compute is the
same."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from support.env import clean_env
from support.launch import run_launch


def init_gloo() -> None:
    """In a DDP script: join the gloo group of its run, under torchrun (its variables) or under
    `hopnet launch` (its rank, world size and c10d store: no port to agree on)."""
    import torch.distributed as dist

    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        return
    from hopnet.rendezvous.store import connect_store

    store = dist.PrefixStore("ddp", connect_store(os.environ["HOPNET_STORE"]))
    dist.init_process_group("gloo", store=store, rank=int(os.environ["HOPNET_RANK"]),
                            world_size=int(os.environ["HOPNET_WORLD_SIZE"]))


def end_now() -> NoReturn:
    """In a DDP script, its result saved and its group past a barrier: exit 0 at once, before the
    DDP objects are freed. Freeing the reducer tears its gloo group down, which now and then hangs
    joining a gloo thread (seen in ~1 run in 3 of 4 processes on a loaded machine) or aborts
    ("terminate called without an active exception")."""
    sys.stdout.flush()
    os._exit(0)


def run_ddp(script: Path, world: int, args: Sequence[str], run_dir: Path) -> None:
    """``script ARGS`` on ``world`` processes to its end (its run directory: ``run_dir``, replaced
    if a failed attempt left one)."""
    done = run_launch(["--nproc", str(world), "--no-progress", "--overwrite", "--run-dir", str(run_dir), str(script),
                       *args], env=clean_env())
    assert done.returncode == 0, done.stderr[-3000:]

"""Per-rank checkpoints: atomic files, the common resume point, and the RNG states.

Each rank writes ``rank{R}-iter{K:08d}.pt`` into the checkpoint directory after finishing
iteration ``K`` (:class:`Checkpointer`). A file is written under a temporary name, fsynced and
renamed into place (``os.replace``), then the directory is fsynced: a name of that form
always holds a complete checkpoint, and a kill during a write leaves only a ``.tmp`` file
that nothing reads. The :data:`KEEP` newest checkpoints of each rank are kept, so that ranks a
few iterations apart (Hop) still share one.

The file (:func:`dump`, format 2) is a small header, the payload pickled with every CPU tensor
left out (a reference to its place instead), then each tensor's bytes as they lie in memory. The
writer thread holds the GIL only to pickle that skeleton; the tensor bytes go out by
``write(2)`` from a view of the tensor, which runs with the GIL released, so the trainer's
thread and the node's event loop (and so the neighbours waiting on them) are not held up by
the write (``torch.save`` held it through the pickling, the copies and the CRC of every byte:
docs/performance/index.md, "Checkpoints"). :func:`load` also reads the ``torch.save`` files of format 1.

The resume point (:func:`common_iteration`) is the highest iteration for which every rank has
a complete checkpoint: the synchronous protocols need all ranks to resume from the same one.

Variables (set by ``hopnet launch --checkpoint-every/--checkpoint-dir/--resume``, or by hand
under torchrun and srun):

=============================  ===========================================================
``HOPNET_CHECKPOINT_EVERY``    save every N iterations (0 or unset: never)
``HOPNET_CHECKPOINT_DIR``      where (default: ``RUN_DIR/checkpoints``)
``HOPNET_RESUME``              an iteration to resume from (the launcher sets it), or
                               ``auto``: each rank finds the common resume point itself
=============================  ===========================================================
"""

from __future__ import annotations

import io
import os
import pickle
import random
import struct
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from hopnet.errors import ConfigError

from hopnet.checkpoint_files import (CHECKPOINT_DIR, CHECKPOINT_EVERY, DEFAULT_SUBDIR, KEEP, OPTIMIZER_STATE,  # noqa: F401
                                     PROTOCOL_STATE, RESUME, checkpoint_name, common_iteration, rank_iterations)


MAGIC = b"HOPNETCK"
FORMAT = 2
_HEADER = struct.Struct("<8sIQQ")  # magic, format, skeleton bytes, tensor bytes
_ALIGN = 64


class _TensorsOut(pickle.Pickler):
    """Pickles a payload's skeleton: each plain CPU tensor becomes a reference to its bytes,
    written after the skeleton."""

    def __init__(self, stream: IO[bytes]) -> None:
        super().__init__(stream, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self.offset = 0

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor) or obj.layout != torch.strided or obj.is_quantized \
                or obj.device.type != "cpu" or obj.requires_grad:
            return None  # pickled as torch pickles it (a CUDA tensor, say: copied() moves none there)
        tensor = obj.resolve_conj().resolve_neg().contiguous()
        place = (self.offset, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
        self.tensors.append(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        self.offset += -(-nbytes // _ALIGN) * _ALIGN
        return place


class _TensorsIn(pickle.Unpickler):
    def __init__(self, stream: IO[bytes], blob: IO[bytes], start: int) -> None:
        super().__init__(stream)
        self.blob = blob
        self.start = start

    def persistent_load(self, pid: Any) -> torch.Tensor:
        offset, dtype, shape = pid
        tensor = torch.empty(shape, dtype=getattr(torch, dtype))
        view = _bytes_of(tensor)
        self.blob.seek(self.start + offset)
        while view:  # a read(2) returns at most about 2 GB
            got = self.blob.readinto(view)  # type: ignore[attr-defined]
            if not got:
                raise ConfigError(f"checkpoint {getattr(self.blob, 'name', '')}: truncated")
            view = view[got:]
        return tensor


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (a 0-d or empty one included)."""
    if tensor.numel() == 0:
        return memoryview(b"")
    data: memoryview = tensor.reshape(-1).view(torch.uint8).numpy().data  # 1-d uint8: format "B"
    return data


def dump(payload: Any, stream: IO[bytes]) -> None:
    """Write ``payload`` in format 2 (see the module's docstring) to the binary ``stream``."""
    skeleton = io.BytesIO()
    pickler = _TensorsOut(skeleton)
    pickler.dump(payload)
    _write_all(stream, memoryview(_HEADER.pack(MAGIC, FORMAT, skeleton.tell(), pickler.offset)))
    _write_all(stream, skeleton.getbuffer())
    _write_all(stream, memoryview(b"\0" * (-(_HEADER.size + skeleton.tell()) % _ALIGN)))
    position = 0
    for tensor in pickler.tensors:
        view = _bytes_of(tensor)
        _write_all(stream, view)  # write(2) from the tensor's memory, the GIL released
        position += len(view)
        padding = -position % _ALIGN
        _write_all(stream, memoryview(b"\0" * padding))
        position += padding


def _write_all(stream: IO[bytes], view: memoryview) -> None:
    while view:
        written = stream.write(view)
        view = view[written if written is not None else len(view):]


def read(path: Path) -> Any:
    """A checkpoint file of either format: 2 (:func:`dump`), or 1 (``torch.save``)."""
    with open(path, "rb", buffering=0) as stream:
        head = stream.read(_HEADER.size)
        if len(head) < _HEADER.size or not head.startswith(MAGIC):
            stream.seek(0)
            return torch.load(stream, map_location="cpu", weights_only=False)
        _, version, skeleton_size, tensor_bytes = _HEADER.unpack(head)
        if version != FORMAT:
            raise ConfigError(f"checkpoint {path}: format {version}, this hopnet reads {FORMAT} and 1")
        start = -(-(_HEADER.size + skeleton_size) // _ALIGN) * _ALIGN
        if os.fstat(stream.fileno()).st_size < start + tensor_bytes:
            raise ConfigError(f"checkpoint {path}: truncated")
        skeleton = stream.read(skeleton_size)
        return _TensorsIn(io.BytesIO(skeleton), stream, start).load()


def write_atomic(payload: dict[str, Any], path: Path) -> None:
    """:func:`dump` to ``path`` through a temporary file in the same directory: fsync, rename,
    fsync the directory. ``path`` is either absent or complete, whenever the writer dies."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(partial, "wb", buffering=0) as stream:
            dump(payload, stream)
            os.fsync(stream.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(directory: Path, rank: int, iteration: int) -> dict[str, Any]:
    path = directory / checkpoint_name(rank, iteration)
    try:
        state: dict[str, Any] = read(path)
    except FileNotFoundError:
        raise ConfigError(f"resume: rank {rank} has no checkpoint of iteration {iteration} in {directory}") from None
    return state


def rng_states() -> dict[str, Any]:
    """The generators a trainer draws from: torch (CPU, and CUDA when initialised), ``random``,
    and numpy's global one when numpy is imported."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states["numpy"] = numpy.random.get_state()
    return states


def restore_rng_states(states: Mapping[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states:
        import numpy

        numpy.random.set_state(states["numpy"])


def state_of(obj: Any) -> Any:
    """What :meth:`hopnet.api.Worker.register_state` saves of ``obj``."""
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    if hasattr(obj, "state_dict"):
        return obj.state_dict()
    if isinstance(obj, dict):
        return dict(obj)
    raise ConfigError(f"register_state: {type(obj).__name__} has no state_dict()/load_state_dict() "
                      "and is not a dict or a torch.Generator")


def load_state_into(obj: Any, state: Any) -> None:
    if isinstance(obj, torch.Generator):
        obj.set_state(state)
    elif hasattr(obj, "load_state_dict"):
        obj.load_state_dict(state)
    elif isinstance(obj, dict):
        obj.clear()
        obj.update(state)
    else:
        raise ConfigError(f"register_state: cannot load into {type(obj).__name__}")


@dataclass(frozen=True)
class CheckpointSettings:
    """What the ``HOPNET_CHECKPOINT_*`` and ``HOPNET_RESUME`` variables ask for."""

    every: int = 0
    directory: Path | None = None
    resume: int | str | None = None
    """An iteration, ``"auto"``, or ``None`` (a fresh start)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], run_dir: str) -> CheckpointSettings:
        text = environ.get(CHECKPOINT_EVERY, "").strip() or "0"
        try:
            every = int(text)
        except ValueError:
            raise ConfigError(f"{CHECKPOINT_EVERY}={text!r} is not an integer") from None
        if every < 0:
            raise ConfigError(f"{CHECKPOINT_EVERY}={every} must be >= 0")
        folder = environ.get(CHECKPOINT_DIR, "").strip()
        directory = Path(folder) if folder else (Path(run_dir) / DEFAULT_SUBDIR if run_dir else None)
        resume_text = environ.get(RESUME, "").strip().lower()
        resume: int | str | None = None
        if resume_text in ("auto", "1", "true", "yes"):
            resume = "auto"
        elif resume_text not in ("", "0", "false", "no"):
            try:
                resume = int(resume_text)
            except ValueError:
                raise ConfigError(f"{RESUME}={resume_text!r}: expected auto or an iteration") from None
        if (every or resume is not None) and directory is None:
            raise ConfigError(f"{CHECKPOINT_EVERY}/{RESUME} need {CHECKPOINT_DIR} (or HOPNET_RUN_DIR)")
        return cls(every=every, directory=directory, resume=resume)

    def resume_iteration(self, world_size: int) -> int | None:
        """The iteration this rank resumes after (its checkpoint's), or ``None``: start afresh."""
        if self.resume is None or self.directory is None:
            return None
        if self.resume == "auto":
            return common_iteration(self.directory, world_size)
        return int(self.resume)


def copied(obj: Any) -> Any:
    """``obj`` with every tensor in it copied to the CPU: a snapshot training cannot change."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: copied(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(copied(value) for value in obj)
    return obj


class Checkpointer:
    """Writes one rank's checkpoints every ``every`` iterations, keeping the :data:`KEEP` newest.

    :meth:`submit` writes in a thread of its own, so the trainer (and the neighbours waiting on
    it) pay only for the copy; a write still in progress at the next submit, or at :meth:`wait`,
    is waited for, and its error raised there."""

    def __init__(self, directory: Path, rank: int, every: int) -> None:
        self.directory = directory
        self.rank = rank
        self.every = every
        directory.mkdir(parents=True, exist_ok=True)
        self._pending: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, iteration: int, payload: dict[str, Any]) -> Path:
        """Write ``payload`` (already a snapshot: :func:`copied`) in the background."""
        self.wait()
        path = self.directory / checkpoint_name(self.rank, iteration)

        def write() -> None:
            try:
                self.save(iteration, payload)
            except BaseException as exc:  # raised to the trainer at the next submit or wait
                self._error = exc

        self._pending = threading.Thread(target=write, name=f"hopnet-checkpoint-rank{self.rank}", daemon=True)
        self._pending.start()
        return path

    def wait(self) -> None:
        """Wait for the write in progress, if any; raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def due(self, iteration: int) -> bool:
        return self.every > 0 and (iteration + 1) % self.every == 0

    def save(self, iteration: int, payload: dict[str, Any]) -> Path:
        path = self.directory / checkpoint_name(self.rank, iteration)
        write_atomic(payload, path)
        for old in rank_iterations(self.directory, self.rank)[:-KEEP]:
            (self.directory / checkpoint_name(self.rank, old)).unlink(missing_ok=True)
        return path

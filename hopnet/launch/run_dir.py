"""A run directory holds one run: refuse to mix a new run into an old one's files.

Workers append to ``rank{R}.jsonl``, so a reused directory would get two ``start``
events in one log, and a smaller run would leave a larger run's ``rank3.jsonl``
behind for analysis to trip over. `hopnet launch --run-dir DIR` therefore refuses a
directory that already holds a run, and with ``--overwrite`` removes that run's
hopnet files first: the ones listed in :data:`RUN_FILE_PATTERNS`, nothing else.
Without ``--run-dir`` a fresh ``runs/<time>-<protocol>-<graph>`` is made
(:func:`hopnet.bootstrap.run_name.make_run_dir`).

Claiming a directory is atomic (:func:`claim_run_dir`): of two launches started at the
same instant on one directory, one wins and the other is refused before it writes
anything. The claim is ``launch.lock``, held with ``flock`` for as long as the launch
runs:

* without ``--overwrite`` a launch refuses a directory holding any run file, the lock
  included, then creates the lock with ``O_CREAT | O_EXCL``: of two launches that both
  found the directory empty, only one creates it;
* with ``--overwrite`` it opens (or creates) the lock and takes the ``flock`` without
  waiting: a directory whose lock is held belongs to a running launch and is refused;
  otherwise the earlier run's files go, all but the lock, which is never removed (a
  launch holding a removed lock would hold nothing the next one could see).

The kernel drops the ``flock`` of a launcher that dies, even by SIGKILL, so the lock it
leaves is an earlier run's like its other files: refused without ``--overwrite``,
replaced with it. The lock's content (the launcher's pid and host) is only for the
message naming a running launch. Where the file system has no ``flock``, the exclusive
create still keeps two launches without ``--overwrite`` apart.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from hopnet.errors import ConfigError

CLAIM_FILE = "launch.lock"
"""The launch that holds this file's ``flock`` owns the directory (see the module docstring)."""
RUN_FILE_PATTERNS = ("launch.json", "launch.json.tmp", CLAIM_FILE, "graph.json", "graph.json.*.tmp", "rank*.jsonl",
                     "lane*/rank*.jsonl", "coordinator.jsonl", "model.pt")
"""The files a launch writes into its run directory (scripts may add their own, which stay)."""


def previous_run_files(path: str | os.PathLike[str]) -> list[Path]:
    """The hopnet files of an earlier run found in ``path`` (sorted; empty when there is none)."""
    folder = Path(path)
    if not folder.is_dir():
        return []
    found = {p for pattern in RUN_FILE_PATTERNS for p in folder.glob(pattern) if p.is_file()}
    return sorted(found)


def _describe(files: list[Path]) -> str:
    logs = [f for f in files if f.suffix == ".jsonl"]
    named = [f.name for f in files
             if f.suffix != ".jsonl" and not f.name.endswith(".tmp") and f.name != CLAIM_FILE]
    if logs:
        named.append(f"{len(logs)} event log{'' if len(logs) == 1 else 's'}")
    return ", ".join(named) if named else ", ".join(f.name for f in files)


def _refuse(shown: str, files: list[Path]) -> ConfigError:
    return ConfigError(f"--run-dir {shown} already holds a run ({_describe(files)}): choose another directory "
                       "or pass --overwrite to replace it")


class RunDirClaim:
    """A launch's hold on its run directory: :attr:`path`, until :meth:`release` (or the
    process's end). A context manager that releases on exit."""

    def __init__(self, path: Path, fd: int, cleared: str | None) -> None:
        self.path = path
        self.cleared = cleared
        """What ``--overwrite`` removed, in one line (``None``: nothing)."""
        self._fd: int | None = fd
        self.created = False
        """This launch made the directory (it did not exist before): :meth:`discard` may remove it."""

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Give the directory up (closing the lock drops the ``flock``); the lock file stays."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def discard(self) -> bool:
        """Remove this launch's hopnet files and, when this launch made it and nothing else is
        left in it, the directory itself; then release it. Whether the directory is gone."""
        for f in previous_run_files(self.path):
            try:
                f.unlink()
            except OSError:
                pass
        self.release()
        if not self.created:
            return False
        try:
            self.path.rmdir()
        except OSError:  # the script's own files, or another process's
            return False
        return True

    def __enter__(self) -> RunDirClaim:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def _try_lock(fd: int) -> bool:
    """Take the ``flock`` without waiting: ``False`` when another launch holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF):
            return True  # no flock here: the exclusive create is all the protection there is
        raise
    return True


def _open_and_lock(lock: Path, flag: str, held: Callable[[str], str]) -> int:
    """Open (creating) the claim file and lock it; ``held(holder)`` is the refusal when a running
    launch holds it."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot open {CLAIM_FILE}: {exc.strerror or exc}") from None
    if not _try_lock(fd):
        holder = _holder(fd)
        os.close(fd)
        raise ConfigError(held(holder))
    return fd


def _holder(fd: int) -> str:
    """`` (pid N on HOST)`` from the lock's content, or nothing when it cannot be read."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError):
        return ""
    if isinstance(data, dict) and isinstance(data.get("pid"), int):
        host = f" on {data['host']}" if isinstance(data.get("host"), str) else ""
        return f" (pid {data['pid']}{host})"
    return ""


def _stamp(fd: int) -> None:
    data = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode() + b"\n"
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    except OSError:
        pass  # only the message to a launch refused later loses its pid


def _remove(files: list[Path]) -> None:
    for f in files:
        try:
            f.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise ConfigError(f"--overwrite: cannot remove {os.fspath(f)}: {exc.strerror or exc}") from None


PREVIOUS_DIR = "attempts"
"""Where a resumed run moves the earlier attempts' logs (``attempts/1/rank0.jsonl``...)."""


def claim_for_resume(run_dir: str | os.PathLike[str]) -> RunDirClaim:
    """Claim ``run_dir``, an earlier run's, to resume it: refused when it holds no
    ``launch.json`` or a running launch holds it. Its logs (``rank*.jsonl``, ``coordinator.jsonl``,
    ``model.pt``) move to ``attempts/N/``, so the resumed run's logs start afresh; ``launch.json``
    (copied there too), ``graph.json`` and everything else stay."""
    path = Path(run_dir).resolve()
    shown = os.fspath(run_dir)
    if not (path / "launch.json").is_file():
        raise ConfigError(f"--resume {shown}: no launch.json there (not a hopnet run directory)")
    fd = _open_and_lock(path / CLAIM_FILE, f"--resume {shown}",
                        lambda holder: f"--resume {shown}: a running launch holds it{holder}")
    try:
        attempt = 1
        while (path / PREVIOUS_DIR / str(attempt)).exists():
            attempt += 1
        previous = path / PREVIOUS_DIR / str(attempt)
        previous.mkdir(parents=True)
        (previous / "launch.json").write_bytes((path / "launch.json").read_bytes())
        for f in previous_run_files(path):
            if f.name not in (CLAIM_FILE, "launch.json", "graph.json"):
                os.replace(f, previous / f.name)
    except OSError as exc:
        os.close(fd)
        raise ConfigError(f"--resume {shown}: cannot move the earlier logs: {exc.strerror or exc}") from None
    _stamp(fd)
    return RunDirClaim(path, fd, f"resume: moved the earlier attempt's logs to {previous}")


def claim_run_dir(run_dir: str | os.PathLike[str], overwrite: bool) -> RunDirClaim:
    """Claim the existing directory ``run_dir`` for one launch (see the module docstring);
    messages name it as given, :attr:`RunDirClaim.path` is resolved.

    Raises :class:`ConfigError`, having written nothing, when it holds a run and
    ``overwrite`` is false, or when a running launch holds it. With ``overwrite`` the
    earlier run's files are removed; :attr:`RunDirClaim.cleared` says which.
    """
    path = Path(run_dir).resolve()
    shown = os.fspath(run_dir)
    lock = path / CLAIM_FILE
    cleared: str | None = None
    if not overwrite:
        files = previous_run_files(path)
        if files:
            raise _refuse(shown, files)
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            raise _refuse(shown, previous_run_files(path) or [lock]) from None
        except OSError as exc:
            raise ConfigError(f"--run-dir {shown}: cannot create {CLAIM_FILE}: {exc.strerror or exc}") from None
        if not _try_lock(fd):  # an --overwrite launch opened it first
            os.close(fd)
            raise _refuse(shown, [lock])
    else:
        fd = _open_and_lock(lock, f"--run-dir {shown}", lambda holder: (
            f"--run-dir {shown} is in use by a running launch{holder}: choose another directory"))
        files = [f for f in previous_run_files(path) if f.name != CLAIM_FILE]
        if files:
            try:
                _remove(files)
            except BaseException:
                os.close(fd)
                raise
            kept = sorted(p.name for p in path.iterdir() if p.name != CLAIM_FILE)
            tail = f"; kept {len(kept)} other file{'' if len(kept) == 1 else 's'}" if kept else ""
            cleared = f"--overwrite: removed the previous run's {_describe(files)} from {shown}{tail}"
    _stamp(fd)
    return RunDirClaim(path, fd, cleared)

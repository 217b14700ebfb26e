"""Once per process, glibc's malloc tuned for the large buffers libzmq receives messages into."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys

log = logging.getLogger(__name__)

_malloc_tuned: bool | None = None


def tune_malloc() -> bool:
    """Stop glibc from handing large message buffers back to the kernel after every use.

    libzmq allocates a fresh buffer for every frame it receives. With glibc's defaults a
    large buffer is ``mmap``-ed, or the heap top is trimmed after ``free``, so the next
    message faults its pages in again: receiving 64 MiB messages faulted on 0.24-0.44 of
    all 4 KiB pages on the reference VM, and throughput dropped by a quarter (see
    docs/performance/index.md, "Transport: throughput and latency"). Fixing ``M_MMAP_THRESHOLD`` at 32 MiB and
    ``M_TRIM_THRESHOLD`` at 512 MiB keeps those buffers in the heap for reuse. This is
    process-wide (it also makes PyTorch's CPU allocations reuse memory instead of
    faulting it in again) and is what ``MALLOC_MMAP_THRESHOLD_`` /
    ``MALLOC_TRIM_THRESHOLD_`` would do; the cost is up to that much freed memory kept
    by the process. Done once per process by :meth:`ZmqTransport.start` unless
    ``tune_malloc=False`` or ``HOPNET_TUNE_MALLOC=0``. Returns whether it is in effect.
    """
    global _malloc_tuned
    if _malloc_tuned is not None:
        return _malloc_tuned
    _malloc_tuned = False
    if sys.platform != "linux" or os.environ.get("HOPNET_TUNE_MALLOC", "1") == "0":
        return False
    _malloc_tuned = _set_thresholds(mmap=32 << 20, trim=512 << 20)
    log.debug("glibc malloc tuned for message buffers: %s", _malloc_tuned)
    return _malloc_tuned


LOW_MEMORY_MMAP_THRESHOLD = 1 << 20


def prefer_low_memory() -> bool:
    """The opposite trade, for a process whose memory is the budget (a member of an FSDP replica
    group): every buffer of 1 MiB or more is ``mmap``-ed and handed back to the kernel when freed.
    FSDP all-gathers each module's parameters and frees them again every step; with
    :func:`tune_malloc`'s thresholds (or glibc's own, which rise to the largest buffer freed) those
    buffers stay in the heap, and peak RSS grows past what the sharding saved (measured on the
    performance page, "Replica groups"). Later calls of :func:`tune_malloc` do nothing. Returns
    whether it is in effect."""
    global _malloc_tuned
    _malloc_tuned = False
    if sys.platform != "linux":
        return False
    return _set_thresholds(mmap=LOW_MEMORY_MMAP_THRESHOLD, trim=LOW_MEMORY_MMAP_THRESHOLD)


def _set_thresholds(*, mmap: int, trim: int) -> bool:
    """glibc's ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` (fixed: no longer adjusted as buffers are
    freed); False where the C library is not glibc."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, mmap)) and bool(mallopt(m_trim_threshold, trim))

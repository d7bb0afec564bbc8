"""Transparent huge pages under the weights a load brings into memory (Linux).

A decode step streams every weight of the target once (~540 MB for SmolLM2-135M in float32): with 4 KiB pages that
is ~130k pages, far more than the TLB holds, so each step also pays a page walk per page. ONNX Runtime keeps its
weights (MatMul's prepacked copies included) in ordinary heap memory, which on a kernel whose THP mode is "madvise"
(the common default) never gets huge pages. After the sessions are open, `NewMemory.collapse` asks the kernel
(madvise MADV_COLLAPSE, Linux 6.1+) to move the memory the load made resident into 2 MiB pages, once.

Only 2 MiB chunks that were fully resident after the load and not before it are collapsed: the weights, not memory
the process had already (another pipeline's, the caller's), and not buffers allocated but never touched (the KV
buffers: collapsing them would fault in the whole capacity). It trades a little load time for faster steps
(docs/design.md: Huge pages under the weights). The collapse changes where pages sit, never what they hold: outputs
are unchanged.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import time
from dataclasses import dataclass

import numpy as np

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_NOHUGEPAGE = 15
_MADV_COLLAPSE = 25


@dataclass(frozen=True)
class HugePageReport:
    """What one collapse did: MiB moved into huge pages, MiB the kernel refused, its seconds; `skipped` says why
    nothing was tried (not Linux, no madvise) and is None otherwise."""

    collapsed_mib: int
    refused_mib: int
    seconds: float
    skipped: str | None = None


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        return libc
    except (OSError, AttributeError):
        return None


def release_free_heap() -> None:
    """Hand the C heap's free memory back to the system (glibc's malloc_trim; elsewhere nothing): a load's transient
    buffers (a graph's bytes patched or expanded at load, protobuf's copies) are freed but would stay resident, and
    `NewMemory.collapse` would move them into huge pages with the weights."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:
        trim(0)


def small_pages(array: np.ndarray) -> None:
    """Keep `array`'s memory in 4 KiB pages (best effort, Linux): for a buffer written a little at a time in many
    places, such as KV slots of a whole context each, where a huge page would make its first write to any of 2 MiB
    resident (and zeroed) at once."""
    libc = _libc()
    if libc is None or array.nbytes < HUGE_PAGE:
        return
    start = -(-array.ctypes.data // mmap.PAGESIZE) * mmap.PAGESIZE
    libc.madvise(start, array.ctypes.data + array.nbytes - start, _MADV_NOHUGEPAGE)


def _anonymous_ranges():
    """The process's private anonymous read-write mappings, trimmed to whole huge pages."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if not parts[1].startswith("rw") or parts[1][3] != "p" or (len(parts) > 5 and parts[5] != "[heap]"):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            start, end = -(-lo // HUGE_PAGE) * HUGE_PAGE, hi // HUGE_PAGE * HUGE_PAGE
            if end > start:
                yield start, end


def resident_chunks(libc) -> set[int]:
    """Start addresses of the huge-page-sized chunks whose every page is resident now."""
    per_chunk = HUGE_PAGE // mmap.PAGESIZE
    chunks: set[int] = set()
    for start, end in _anonymous_ranges():
        pages = (end - start) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(start, end - start, vec):  # unmapped since /proc was read: skip the range
            continue
        full = (np.frombuffer(vec, np.uint8).reshape(-1, per_chunk) & 1).all(axis=1)
        chunks.update(start + int(i) * HUGE_PAGE for i in np.flatnonzero(full))
    return chunks


def _runs(chunks: set[int]) -> list[tuple[int, int]]:
    runs: list[list[int]] = []
    for c in sorted(chunks):
        if runs and runs[-1][1] == c:
            runs[-1][1] = c + HUGE_PAGE
        else:
            runs.append([c, c + HUGE_PAGE])
    return [(a, b) for a, b in runs]


class NewMemory:
    """Remembers which memory was resident when made; `collapse()` moves what became resident since into huge
    pages. Best effort: where the kernel refuses the collapse (THP off, a kernel before 6.1) the report counts it as
    refused and the pages stay as they were."""

    def __init__(self) -> None:
        self._libc = _libc()
        self._before = resident_chunks(self._libc) if self._libc is not None else set()

    def collapse(self) -> HugePageReport:
        if self._libc is None:
            return HugePageReport(0, 0, 0.0, skipped="huge pages are collapsed on Linux only")
        started = time.perf_counter()
        collapsed = refused = 0
        for start, end in _runs(resident_chunks(self._libc) - self._before):
            self._libc.madvise(start, end - start, _MADV_HUGEPAGE)  # later faults in the range get huge pages too
            if self._libc.madvise(start, end - start, _MADV_COLLAPSE) == 0:
                collapsed += end - start
            else:  # EINVAL: no MADV_COLLAPSE (before Linux 6.1) or THP off; EAGAIN/ENOMEM: no free huge page now
                refused += end - start
        return HugePageReport(collapsed >> 20, refused >> 20, time.perf_counter() - started)

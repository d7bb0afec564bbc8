"""Huge pages under the weights a load brings in (runtime/huge_pages.py).

- Memory made resident after the snapshot is moved into huge pages (the kernel's own accounting says so), memory
  allocated but never touched is not (collapsing it would fault it all in), and memory resident before is left alone.
- A pipeline loaded with it reports what it did and generates exactly what one loaded without it does.
- A buffer kept in small pages (the engine's KV slots) makes resident only the pages written, where numpy's own
  huge pages would make 2 MiB resident per write.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import pytest

from mirror_sd.runtime.huge_pages import HUGE_PAGE, NewMemory, small_pages
from mirror_sd.runtime.pipeline import Pipeline

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are collapsed on Linux only")

SIZE = 48 << 20


def _mapping(touch: bool) -> mmap.mmap:
    """A private anonymous mapping of SIZE bytes, written through (resident) or not. Not numpy: numpy asks for huge
    pages itself on large arrays, and its arrays would be huge with or without the collapse."""
    m = mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if touch:
        for offset in range(0, SIZE, mmap.PAGESIZE):
            m[offset] = 7
    return m


def _huge_kib(m: mmap.mmap) -> int:
    """AnonHugePages (KiB) of the kernel's mappings inside `m` (the collapse's madvise splits its huge-page range off
    into a mapping of its own)."""
    lo = ctypes.addressof(ctypes.c_char.from_buffer(m))
    return _smaps_kib(lo, lo + len(m), "AnonHugePages:")


def _smaps_kib(lo: int, hi: int, field: str) -> int:
    """A /proc/self/smaps field (KiB) summed over the mappings inside [lo, hi)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start >= lo and end <= hi
            elif inside and line.startswith(field):
                total += int(line.split()[1])
    return total


def test_new_resident_memory_is_collapsed_and_nothing_else():
    before = _mapping(touch=True)  # resident before the snapshot: not ours to move
    memory = NewMemory()
    touched = _mapping(touch=True)
    untouched = _mapping(touch=False)  # mapped, never written: no page of it is resident
    report = memory.collapse()
    assert report.skipped is None and report.seconds >= 0
    if report.collapsed_mib == 0:
        pytest.skip(f"this kernel refused MADV_COLLAPSE ({report.refused_mib} MiB refused)")
    # every whole huge page inside the touched array went over, and the report counts at least those
    assert _huge_kib(touched) >= (SIZE - 2 * HUGE_PAGE) >> 10
    assert report.collapsed_mib >= (SIZE - 2 * HUGE_PAGE) >> 20
    # ... and little else: neither the memory resident before nor the untouched array (48 MiB each) went with it
    assert report.collapsed_mib <= (SIZE >> 20) + 16
    assert _huge_kib(untouched) == 0 and _huge_kib(before) == 0
    assert touched[::mmap.PAGESIZE] == bytes([7]) * (SIZE // mmap.PAGESIZE)  # contents unchanged
    assert touched[1:mmap.PAGESIZE] == bytes(mmap.PAGESIZE - 1)


def test_pipeline_reports_its_collapse_and_generates_the_same(bundle_factory):
    bundle = bundle_factory("llama")
    plain = Pipeline.load(bundle, huge_pages=False)
    huge = Pipeline.load(bundle)  # the default
    assert plain.huge_pages is None
    assert huge.huge_pages is not None and huge.huge_pages.skipped is None
    prompt = [1, 200, 64, 9, 9, 120, 3]
    for mode in ("ar", "sd", "mirror"):
        a = plain.generate(prompt, mode=mode, max_new_tokens=12, temperature=0.0)
        b = huge.generate(prompt, mode=mode, max_new_tokens=12, temperature=0.0)
        assert a.token_ids == b.token_ids


def test_small_pages_make_resident_only_what_is_written():
    array = np.empty((SIZE // 4,), np.float32)  # numpy asks for huge pages on an array this large
    small_pages(array)
    array[:: HUGE_PAGE // 4] = 1.0  # one value per 2 MiB, as KV slots are written: a few positions in each
    # the advised range, which the kernel splits into a mapping of its own: the array's whole pages (its first, which
    # holds the allocator's header, may share a mapping with other memory of this process)
    lo = -(-array.ctypes.data // mmap.PAGESIZE) * mmap.PAGESIZE
    hi = -(-(array.ctypes.data + array.nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE
    assert _smaps_kib(lo, hi, "AnonHugePages:") == 0
    assert _smaps_kib(lo, hi, "Rss:") <= (SIZE // HUGE_PAGE + 2) * mmap.PAGESIZE >> 10  # a page per write

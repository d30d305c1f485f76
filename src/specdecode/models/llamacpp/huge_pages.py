"""Transparent huge pages for a llama.cpp model's weights on Linux (``MADV_COLLAPSE``).

Why. Decoding one token streams every weight once (the default target: ~1 GB of repacked Q4_K per
pass, bound by memory bandwidth on a 2-core CPU). ggml keeps the repacked weights in one anonymous
buffer, which Linux maps in 4 KiB pages unless asked otherwise (``transparent_hugepage`` is
``madvise`` on most distributions): ~250,000 pages a pass, a TLB miss and a page walk at every
4 KiB, and hardware prefetchers that stop at each page's edge. In 2 MiB pages the same pass ran
2-5% faster on the 2-core AMD EPYC (one-token passes of the default target, 2026-11-28:
lab/notebook/2026-11-28-huge-pages.md). llama.cpp does not ask for them (its pull request for a
``MADV_HUGEPAGE`` hint, ggml-org/llama.cpp#22022, is open), and glibc does only with
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` set before the process starts.

How. :func:`anonymous_mappings` lists the process's large anonymous read-write mappings (from
``/proc/self/maps``) before and after llama.cpp loads a model; the new ones are its buffers (and
any older mapping the kernel merged one of them into: collapsed too, harmlessly).
:func:`collapse` marks each one ``MADV_HUGEPAGE`` (later faults get huge pages) and collapses its
resident 4 KiB pages into 2 MiB ones with ``MADV_COLLAPSE`` (Linux 6.1+), chunk by chunk, best
effort: a chunk the kernel refuses stays as it was. The contents never change, so neither do the
results (bit for bit). Nowhere else (another OS, an older kernel, no ``libc.so.6``) is anything done.
Costs 1.5-1.7 s at load for the default target on that machine (the kernel copies the pages).
"""

from __future__ import annotations

import ctypes
import sys
from functools import cache
from typing import Any

HUGE_PAGE = 2 << 20
"""Bytes of an x86-64 / arm64 transparent huge page (PMD size)."""

MIN_MAPPING = 32 << 20
"""Anonymous mappings smaller than this are not a model's weights: left alone."""

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


@cache
def _madvise() -> Any:
    """libc's ``madvise`` (ctypes), or None where there is none (not Linux, not glibc-compatible)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None
    function = libc.madvise
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def anonymous_mappings(min_bytes: int = MIN_MAPPING) -> set[tuple[int, int]]:
    """The process's anonymous read-write mappings of at least ``min_bytes``, as ``(start, end)``
    addresses (bytes, end exclusive); empty where ``/proc/self/maps`` cannot be read."""
    found: set[tuple[int, int]] = set()
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if len(fields) != 5 or not fields[1].startswith("rw"):  # a sixth field names a file or [heap]
            continue
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if high - low >= min_bytes:
            found.add((low, high))
    return found


def collapse(mappings: set[tuple[int, int]]) -> int:
    """Ask for 2 MiB pages on ``mappings`` (from :func:`anonymous_mappings`) and collapse what is
    resident there; returns the bytes now in huge pages (0 where the system offers none).

    Best effort: a chunk the kernel refuses is skipped and nothing is raised (on the 2-core AMD EPYC
    all 298 chunks of the default target's repacked buffer collapse; the ``EINVAL`` refusals seen
    there were in a 64 MiB mapping that is not the model's)."""
    madvise = _madvise()
    if madvise is None:
        return 0
    collapsed = 0
    for low, high in sorted(mappings):
        start = (low + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
        end = high & ~(HUGE_PAGE - 1)
        if end <= start or madvise(start, end - start, MADV_HUGEPAGE) != 0:
            continue
        for chunk in range(start, end, HUGE_PAGE):
            if madvise(chunk, HUGE_PAGE, MADV_COLLAPSE) == 0:
                collapsed += HUGE_PAGE
    return collapsed

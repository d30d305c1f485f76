"""Huge pages for llama.cpp's weights (specdecode.models.llamacpp.huge_pages): the mappings it finds,
a collapse that keeps every byte, and nothing done where the system has no madvise. The model-level
check (the same logits with and without) is in tests/test_llamacpp.py."""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import sys

import pytest

from specdecode.models.llamacpp import huge_pages

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps and madvise: Linux")


def anon_huge_kb(start: int, end: int) -> int:
    """AnonHugePages (kB) of the mappings inside [start, end) per /proc/self/smaps."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low >= start and high <= end
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


@linux_only
def test_a_touched_anonymous_mapping_is_found_and_collapsed_without_changing_a_byte() -> None:
    size = 16 << 20
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        pattern = bytes(range(256)) * (size // 256)
        region[:] = pattern
        digest = hashlib.sha256(region[:]).hexdigest()
        address = ctypes.addressof(ctypes.c_char.from_buffer(region))
        found = {m for m in huge_pages.anonymous_mappings(8 << 20) if m[0] <= address and address + size <= m[1]}
        assert len(found) == 1  # the mapping that holds the region
        collapsed = huge_pages.collapse(found)
        start, end = next(iter(found))
        assert collapsed % huge_pages.HUGE_PAGE == 0 and 0 <= collapsed <= end - start
        assert hashlib.sha256(region[:]).hexdigest() == digest
        if collapsed:  # the kernel took it (Linux 6.1+ with THP): smaps says so
            assert anon_huge_kb(start, end) * 1024 >= collapsed
    finally:
        region.close()


@linux_only
def test_small_mappings_are_not_listed() -> None:
    assert all(high - low >= huge_pages.MIN_MAPPING for low, high in huge_pages.anonymous_mappings())


def test_nothing_is_done_without_madvise(monkeypatch) -> None:
    monkeypatch.setattr(huge_pages, "_madvise", lambda: None)
    assert huge_pages.collapse({(0, 64 << 20)}) == 0
    assert huge_pages.collapse(set()) == 0

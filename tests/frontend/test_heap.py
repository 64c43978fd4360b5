"""frontend/heap.py: freed C-heap memory goes back to the OS once enough is free."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from frontend import heap

pytestmark = pytest.mark.skipif(
    heap.free_heap_bytes() is None or not Path("/proc/self/status").exists(),
    reason="needs glibc 2.33+ (mallinfo2, malloc_trim) and /proc for VmRSS",
)


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _churn(mib: int) -> None:
    """Allocate ``mib`` MiB in 4 KiB bytes objects (glibc's heap, not mmap),
    keep a small one after each block so the heap's top stays in use, then
    free the big ones: glibc keeps their pages."""
    held, pins = [], []
    for i in range(mib * 256):
        held.append(bytes(4096 - 33) + i.to_bytes(4, "little"))
        if i % 256 == 255:
            pins.append(bytes(1024))  # past pymalloc's 512 bytes: on the glibc heap too
    del held
    _churn.pins = pins  # type: ignore[attr-defined]


def test_a_trim_returns_what_was_freed_and_then_waits_for_more_to_be_freed() -> None:
    trimmer = heap.HeapTrimmer(threshold=16 << 20)
    assert not trimmer.check() and trimmer.trims == 0  # the first look: the low point
    low = heap.free_heap_bytes() or 0
    _churn(64)
    free, before = heap.free_heap_bytes() or 0, _rss()
    assert free - low > 32 << 20
    assert trimmer.check()
    assert trimmer.trims == 1 and trimmer.released >= 24 << 20
    assert _rss() < before - (24 << 20)
    # The trimmed pages stay counted free: no second trim until more is freed.
    assert not trimmer.check() and not trimmer.check() and trimmer.trims == 1
    # The same pages used again and freed: the free count is what it was, the
    # resident size is not, and the next look trims.
    grown = _rss()
    _churn(48)
    assert _rss() > grown + (24 << 20)
    assert trimmer.check() and trimmer.trims == 2
    assert _rss() < grown + (8 << 20)


async def test_the_service_trims_on_its_interval() -> None:
    trimmer = heap.HeapTrimmer(interval=0.05, threshold=16 << 20)
    async with trio.open_nursery() as nursery:
        await nursery.start(trimmer.run)
        await trio.sleep(0.2)  # its first look
        _churn(48)
        with trio.fail_after(5):
            while trimmer.trims == 0:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert trimmer.statistics().trims >= 1

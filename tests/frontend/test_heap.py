"""frontend/heap.py: freed C-heap memory goes back to the OS once enough is free.

Each scenario runs in a fresh interpreter: in the test process, hundreds of MB
that earlier tests freed sit in glibc's heap, and new allocations reuse them
instead of growing it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import trio

from frontend import heap

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    heap.free_heap_bytes() is None or not Path("/proc/self/status").exists(),
    reason="needs glibc 2.33+ (mallinfo2, malloc_trim) and /proc for VmRSS",
)


def _rss() -> int:
    return heap.resident_bytes() or 0


_pins: list[bytes] = []


def _churn(mib: int) -> None:
    """Allocate ``mib`` MiB in 4 KiB bytes objects (glibc's heap, not mmap),
    keep a small one after each block so the heap's top stays in use, then
    free the big ones: glibc keeps their pages."""
    held = []
    for i in range(mib * 256):
        held.append(bytes(4096 - 33) + i.to_bytes(4, "little"))
        if i % 256 == 255:
            _pins.append(bytes(1024))  # past pymalloc's 512 bytes: on the glibc heap too
    del held


def scenario_trim() -> None:
    trimmer = heap.HeapTrimmer(threshold=16 << 20)
    assert not trimmer.check() and trimmer.trims == 0  # the first look: the low point
    low = heap.free_heap_bytes() or 0
    _churn(64)
    free, before = heap.free_heap_bytes() or 0, _rss()
    assert free - low > 32 << 20, (free, low)
    assert trimmer.check()
    assert trimmer.trims == 1 and trimmer.released >= 24 << 20, trimmer.released
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


def scenario_waves() -> None:
    """Memory freed in two waves, the second under the threshold: each is
    trimmed (a hostile connection's streams are reset, then it closes)."""
    trimmer = heap.HeapTrimmer(threshold=16 << 20, step=2 << 20)
    assert not trimmer.check()
    first, second = [], []
    for i in range(96 * 256):  # interleaved: the second wave's pages sit among the first's
        (first if i % 8 else second).append(bytes(4096 - 33) + i.to_bytes(4, "little"))
        if i % 256 == 255:
            _pins.append(bytes(1024))
    del first
    assert trimmer.check() and trimmer.trims == 1
    assert not trimmer.check()  # nothing freed since
    before = _rss()
    del second  # 12 MiB: under the threshold, over the step
    assert trimmer.check() and trimmer.trims == 2
    assert _rss() < before - (8 << 20), (before, _rss())


def scenario_service() -> None:
    async def main() -> None:
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

    trio.run(main)


def _fresh(name: str) -> None:
    done = subprocess.run([sys.executable, "-c", f"from tests.frontend.test_heap import {name}; {name}()"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_trim_returns_what_was_freed_and_then_waits_for_more_to_be_freed() -> None:
    _fresh("scenario_trim")


def test_memory_freed_in_waves_is_trimmed_wave_by_wave() -> None:
    _fresh("scenario_waves")


def test_the_service_trims_on_its_interval() -> None:
    _fresh("scenario_service")

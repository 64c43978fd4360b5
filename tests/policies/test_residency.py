"""Placement of engine replicas by memory (policies/residency.py): a replica
that does not fit the memory left is refused with both numbers; replicas
still starting and a headroom count against what is left; a stale reading
is not trusted; the file estimate expands GGUF weights, a report wins."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from policies.residency import (
    GGUF_EXPANSION,
    GiB,
    MemoryReading,
    MiB,
    estimate_footprint,
    footprint_from_report,
    place,
)

READING = MemoryReading("cpu", available=10 * GiB, total=16 * GiB, at=100.0)


def test_a_gguf_file_is_estimated_expanded_plus_kv_cache_and_overhead() -> None:
    fp = estimate_footprint({"/m/model.gguf": 100 * MiB}, 1 * GiB, overhead=500 * MiB)
    assert fp.weights == int(100 * MiB * GGUF_EXPANSION) and fp.kv_cache == GiB and fp.source == "estimate"
    assert fp.total == fp.weights + GiB + 500 * MiB
    safetensors = estimate_footprint({"/m/a.safetensors": 300 * MiB, "/m/b.safetensors": 200 * MiB}, 0, overhead=0)
    assert safetensors.total == 500 * MiB


def test_a_cpu_report_grows_by_its_kv_cache_a_cuda_one_holds_it_already() -> None:
    cpu = footprint_from_report(weights=300 * MiB, kv_cache=GiB, resident=800 * MiB)  # KV reserved, not yet resident
    assert (cpu.total, cpu.overhead, cpu.source) == (800 * MiB + GiB, 500 * MiB, "report")
    cuda = footprint_from_report(weights=300 * MiB, kv_cache=GiB, resident=1424 * MiB, kv_resident=True, extra=512 * MiB)
    assert (cuda.total, cuda.overhead) == (1424 * MiB + 512 * MiB, 100 * MiB + 512 * MiB)


def test_a_replica_that_fits_is_placed_and_one_too_big_is_refused_with_both_numbers() -> None:
    small = footprint_from_report(GiB, GiB, 3 * GiB, kv_resident=True)
    ok = place("qwen", small, READING, now=101.0)
    assert ok.fits and ok.need == 3 * GiB
    refused = place("qwen", small, READING, now=101.0, count=4)  # 12 GiB > 10 - 0.8 headroom
    assert not refused.fits
    assert "4 replicas of qwen need 12.00 GiB" in refused.reason and "9.20 GiB left on cpu" in refused.reason


def test_replicas_still_starting_count_against_the_memory_left() -> None:
    fp = footprint_from_report(GiB, GiB, 3 * GiB, kv_resident=True)
    assert place("m", fp, READING, now=100.0, count=2).fits
    refused = place("m", fp, READING, now=100.0, count=2, pending=4 * GiB)
    assert not refused.fits and "4.00 GiB promised to replicas starting" in refused.reason


def test_a_stale_reading_is_refused() -> None:
    fp = footprint_from_report(0, 0, MiB)
    d = place("m", fp, READING, now=200.0, max_age=5.0)
    assert not d.fits and "old" in d.reason


@given(st.integers(0, 64 * GiB), st.integers(0, 64 * GiB), st.integers(1, 8), st.integers(0, 32 * GiB))
def test_the_decision_is_need_against_left(resident: int, available: int, count: int, pending: int) -> None:
    reading = MemoryReading("cuda:0", available=available, total=80 * GiB, at=0.0)
    fp = footprint_from_report(0, 0, resident)
    d = place("m", fp, reading, now=0.0, count=count, pending=pending, headroom=0.0)
    assert d.fits == (resident * count <= available - pending)

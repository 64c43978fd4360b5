"""Model residency: will one more engine replica fit in the memory left? (sans-I/O)

``headrace serve`` asks before it starts a replica (router/engines.py): at
startup, for every replica and warm-pool member of ``[[engines]]``, and at
runtime, for each one ``POST /admin/engines`` would add. The caller reads
the memory (``MemAvailable`` of /proc/meminfo on CPU, the device's free
memory on CUDA) and passes it in with ``now``; this module decides::

    need   = the replica's footprint (a running replica's own report of the
             model when there is one, else an estimate from its files)
    left   = reading.available - pending (replicas started whose memory the
             reading may not show yet) - headroom
    need <= left  ─> place it          need > left  ─> refuse, saying both

The estimate from files (:func:`estimate_footprint`) is deliberately on the
high side: GGUF weights are dequantised when loaded (a 4-bit file holds about
a quarter of its bfloat16 weights, an eighth of float32), so the file's
size times ``GGUF_EXPANSION``; safetensors load at their size; plus the KV
cache the replica will allocate and a runtime overhead (torch and the
server). A reading older than ``max_age`` seconds is not trusted: refused as
stale rather than placed on old numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CUDA_CONTEXT",
    "GGUF_EXPANSION",
    "RUNTIME_OVERHEAD",
    "Footprint",
    "MemoryReading",
    "Placement",
    "estimate_footprint",
    "footprint_from_report",
    "place",
]

MiB = 1 << 20
GiB = 1 << 30
GGUF_EXPANSION = 4.0  # in-memory weights per GGUF byte (4-bit codes -> bfloat16, plus packed copies)
CUDA_CONTEXT = 512 * MiB  # a process's CUDA context and allocator slack, outside torch.cuda.memory_allocated
RUNTIME_OVERHEAD = 768 * MiB  # torch, the tokenizer and the server in one engine process (RSS past weights and KV: ~750 MiB measured on CPU)


@dataclass(frozen=True)
class Footprint:
    """What one replica of a model holds (bytes); ``source`` says where the numbers come from."""

    weights: int
    kv_cache: int
    overhead: int
    source: str  # "estimate" (from files) or "report" (a running replica's)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.overhead


@dataclass(frozen=True)
class MemoryReading:
    device: str  # "cpu", "cuda:0", ...
    available: int  # bytes free for a new process (MemAvailable; cudaMemGetInfo's free)
    total: int
    at: float  # when it was read (the caller's clock)


@dataclass(frozen=True)
class Placement:
    fits: bool
    need: int
    left: int
    reason: str  # one line for an operator: why it fits or not


def estimate_footprint(weight_files: dict[str, int], kv_cache_bytes: int, *, overhead: int = RUNTIME_OVERHEAD) -> Footprint:
    """A replica's footprint from its model files (``{path: size}``) and the
    KV cache it will allocate."""
    weights = 0
    for path, size in weight_files.items():
        weights += int(size * GGUF_EXPANSION) if path.endswith(".gguf") else size
    return Footprint(weights=weights, kv_cache=kv_cache_bytes, overhead=overhead, source="estimate")


def footprint_from_report(weights: int, kv_cache: int, resident: int, *, kv_resident: bool = False, extra: int = 0) -> Footprint:
    """A running replica's report. On CPU (``kv_resident`` false) the KV
    cache is reserved but becomes resident only as it is used, so the
    resident set past the weights is the runtime's, and the replica grows to
    weights + KV cache + that; on CUDA (``kv_resident``) the allocation holds
    the KV cache already, and ``extra`` (the CUDA context, outside
    memory_allocated) comes on top."""
    past = resident - weights - (kv_cache if kv_resident else 0)
    return Footprint(weights=weights, kv_cache=kv_cache, overhead=max(0, past) + extra, source="report")


def place(
    model: str,
    footprint: Footprint,
    reading: MemoryReading,
    now: float,
    *,
    count: int = 1,
    pending: int = 0,
    headroom: float = 0.05,
    max_age: float = 5.0,
) -> Placement:
    """Whether ``count`` more replicas of ``model`` fit in ``reading``'s memory,
    less ``pending`` bytes promised to replicas still starting and a
    ``headroom`` fraction of the total kept free."""
    need = footprint.total * count
    reserve = int(reading.total * headroom)
    left = reading.available - pending - reserve
    if now - reading.at > max_age:
        return Placement(False, need, left, f"the {reading.device} memory reading is {now - reading.at:.0f} s old; not placing {model} on it")
    what = f"{count} replica{'s' if count != 1 else ''} of {model}"
    have = (f"{_gib(left)} left on {reading.device} ({_gib(reading.available)} available"
            f"{f', {_gib(pending)} promised to replicas starting' if pending else ''}, {_gib(reserve)} kept free)")  # fmt: skip
    if need > left:
        return Placement(False, need, left, f"{what} need {_gib(need)} ({footprint.source}: weights {_gib(footprint.weights * count)}, "
                                            f"KV cache {_gib(footprint.kv_cache * count)}) but there is {have}")  # fmt: skip
    return Placement(True, need, left, f"{what} need {_gib(need)} ({footprint.source}); {have}")


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"

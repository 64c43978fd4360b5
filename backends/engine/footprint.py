"""What a loaded engine holds: its load time and memory footprint.

``headrace engine`` measures these once the model is loaded and the KV cache
allocated, prints them in its startup line and reports them in
``/v1/models`` (each model's ``footprint``), where ``headrace serve``'s
replica actors read them (router/replicas.py) to place the next replica of
the same model (policies/residency.py)::

    {"load_seconds": 2.41, "weights_bytes": ..., "kv_cache_bytes": ...,
     "rss_bytes": ..., "device": "cpu", "cuda_allocated_bytes": null}

``weights_bytes`` counts the model's parameters and buffers and every packed
layout beside them, and ``kv_cache_bytes`` the KV cache reserved, as the
runner's own ``memory()`` counts them (the live breakdown ``/v1/models``
reports as ``memory``), so the two reports agree; ``rss_bytes`` is the process's resident set
(VmRSS); on CUDA ``cuda_allocated_bytes`` is ``torch.cuda.memory_allocated``.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

__all__ = ["Footprint", "measure", "rss_bytes"]


class Footprint(msgspec.Struct, frozen=True, kw_only=True):
    load_seconds: float
    weights_bytes: int
    kv_cache_bytes: int
    rss_bytes: int
    device: str
    cuda_allocated_bytes: int | None = None

    def line(self) -> str:
        """The startup line's numbers."""
        mib = 1 << 20
        cuda = f", CUDA allocated {self.cuda_allocated_bytes / mib:.1f} MiB" if self.cuda_allocated_bytes is not None else ""
        return (f"in {self.load_seconds:.2f} s: weights {self.weights_bytes / mib:.1f} MiB, "
                f"KV cache {self.kv_cache_bytes / mib:.1f} MiB, RSS {self.rss_bytes / mib:.1f} MiB{cuda}")  # fmt: skip


def rss_bytes() -> int:
    """This process's resident set size (VmRSS), 0 where /proc has none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure(runner: Any, load_seconds: float) -> Footprint:
    """The footprint of an engine whose model runner is ``runner`` (a
    tensor-parallel runner reports rank 0's share, its ``local`` runner's;
    zeros where this process keeps no model)."""
    device = getattr(runner, "device", torch.device("cpu"))
    allocated = None
    if isinstance(device, torch.device) and device.type == "cuda":
        allocated = int(torch.cuda.memory_allocated(device))
    memory = getattr(getattr(runner, "local", runner), "memory", None)  # runner.MemoryFootprint: the one count
    m = memory() if memory is not None else None
    weights, kv_bytes = (m.weights + m.packed, m.kv_reserved) if m is not None else (0, 0)
    return Footprint(
        load_seconds=round(load_seconds, 3),
        weights_bytes=weights,
        kv_cache_bytes=kv_bytes,
        rss_bytes=rss_bytes(),
        device=str(device),
        cuda_allocated_bytes=allocated,
    )

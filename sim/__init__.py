"""``headrace simulate``: routing policies driven in virtual time against
modelled backends (prefill per uncached token, decode per step, an LRU prefix
cache), on workloads or traces. See :mod:`sim.model` for the model,
:mod:`sim.trace` for the trace format, :mod:`sim.workloads` for the built-ins."""

from __future__ import annotations

from sim.model import ModelConfig, SimResult, simulate
from sim.trace import SimRequest, TraceRecord, prepare, read_trace, write_trace
from sim.workloads import WORKLOADS, SharedPrefix, shared_prefix

__all__ = [
    "WORKLOADS",
    "ModelConfig",
    "SharedPrefix",
    "SimRequest",
    "SimResult",
    "TraceRecord",
    "prepare",
    "read_trace",
    "shared_prefix",
    "simulate",
    "write_trace",
]

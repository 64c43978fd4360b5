"""GPU time per tenant, from the engine's own batch accounting.

Each engine step's wall time (the runner's forward pass, the sampling that
waits on it, the commit: everything but scheduling) is split across the
sequences that step computed, by their share of the tokens computed in it::

    step 7: 40 ms   alice: prefill chunk 96 tokens ─> 96/100 x 40 ms = 38.4 ms
                    bob:   4 decodes    4 tokens   ─>  4/100 x 40 ms =  1.6 ms

The shares of a step add up to its time, so the tenants' GPU-seconds add up
to the engine's busy time (to float rounding), whatever the batch mixes. A
sequence's own total comes back with its final output (``Usage.gpu_seconds``),
so the router can account each request; a tenant's total stays here for the
engine's ``/metrics``. Pure bookkeeping: the engine passes the seconds.

Tenant names come from the caller (the router's header): at most
``max_tenants`` are kept apart, any further one is counted as ``other``, so a
client talking to the engine directly cannot grow its memory or series.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

__all__ = ["OTHER", "MeterStatistics", "StepMeter", "TenantUsage"]

OTHER = "other"


class TenantUsage(msgspec.Struct, frozen=True, kw_only=True):
    gpu_seconds: float = 0.0
    computed_tokens: int = 0  # prefill (not prefix-cache hits) and decode tokens the steps computed
    generated_tokens: int = 0


class MeterStatistics(msgspec.Struct, frozen=True, kw_only=True):
    busy_seconds: float  # the steps' wall time, all of it attributed
    steps: int
    tenants: dict[str, TenantUsage]


class _Tenant:
    __slots__ = ("computed", "generated", "seconds")

    def __init__(self) -> None:
        self.seconds, self.computed, self.generated = 0.0, 0, 0


class StepMeter:
    """Attributes each step's time to the tenants of the sequences in it."""

    def __init__(self, max_tenants: int = 256) -> None:
        self.max_tenants = max_tenants
        self._tenant_of: dict[str, str] = {}  # sequence id -> tenant
        self._seconds: dict[str, float] = {}  # sequence id -> its GPU-seconds so far
        self._tenants: dict[str, _Tenant] = {}
        self._busy = 0.0
        self._steps = 0

    def admit(self, seq_id: str, tenant: str) -> None:
        if tenant not in self._tenants and len(self._tenants) >= self.max_tenants:
            tenant = OTHER
        self._tenants.setdefault(tenant, _Tenant())
        self._tenant_of[seq_id] = tenant
        self._seconds[seq_id] = 0.0

    def charge(self, seconds: float, computed: Iterable[tuple[str, int]]) -> None:
        """One step took ``seconds`` computing ``(sequence id, tokens)``."""
        shares = [(seq_id, n) for seq_id, n in computed if n > 0]
        total = sum(n for _, n in shares)
        self._steps += 1
        self._busy += seconds
        if total == 0:
            self._tenant(OTHER).seconds += seconds  # nothing computed (cannot happen in a real step): kept, not lost
            return
        for seq_id, n in shares:
            part = seconds * n / total
            tenant = self._tenant(self._tenant_of.get(seq_id, OTHER))
            tenant.seconds += part
            tenant.computed += n
            if seq_id in self._seconds:
                self._seconds[seq_id] += part

    def generated(self, seq_id: str, n: int = 1) -> None:
        self._tenant(self._tenant_of.get(seq_id, OTHER)).generated += n

    def release(self, seq_id: str) -> float:
        """The sequence is done: its GPU-seconds (it is forgotten; its tenant's total stays)."""
        self._tenant_of.pop(seq_id, None)
        return self._seconds.pop(seq_id, 0.0)

    def _tenant(self, name: str) -> _Tenant:
        tenant = self._tenants.get(name)
        if tenant is None:
            tenant = self._tenants[name] = _Tenant()
        return tenant

    def statistics(self) -> MeterStatistics:
        """(Read from another thread than the steps': the dict is copied first.)"""
        tenants = {
            name: TenantUsage(gpu_seconds=t.seconds, computed_tokens=t.computed, generated_tokens=t.generated)
            for name, t in dict(self._tenants).items()
        }
        return MeterStatistics(busy_seconds=self._busy, steps=self._steps, tenants=tenants)

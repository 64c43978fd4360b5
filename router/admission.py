"""The pipeline's stages for issue 15: per-tenant rate limits, then admission
and the fair queue. They own the clocks, the waiting and the slot counts;
every decision is a sans-I/O policy's (policies.ratelimit, .admission,
.fairness)::

    request ─> RateLimits.admit ── acquire(tenant, key; prompt tokens) ── refused: 429 rate_limited
                  │                                                         + Retry-After, x-ratelimit-*
                  └─> Queue.admit ── class = min(X-Priority, tenant's max)
                        decide(capacity, busy, queued, measured rate, deadline)
                          admit ─────────────────────────────────┐
                          queue ── wait for a slot (fair order) ─┤ timeout: 503 queue_timeout
                          reject ── 503 queue_full / shed / no_healthy_backend
                                                                  v
                        hold ``n`` slots until the last byte; streamed tokens charged
                        to the tenant's rate limit and its fair share as they arrive

Capacity is the sum of the concurrency limits of the backends eligible now
(up, not draining, breaker not open): ``capacity()`` comes from the router.
A request holds ``min(n, capacity)`` slots; a freed slot goes to the queue's
choice at once. Waiting requests also look again every ``POLL`` seconds, so
capacity that appears (a backend coming up) is used without a release.

Tokens are counted per event (``token_ids``, or one per event with text
when a backend sends no ids) and corrected from the final usage.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager

import msgspec
import trio

from backends.base import Backend, BackendInfo, Event, GenerateRequest, Health
from backends.errors import BackendUnavailable, RateLimited
from frontend.call import Call
from frontend.context import PriorityClass, RequestContext
from policies.admission import AdmissionPolicy, AdmissionView, ServiceRate
from policies.fairness import CLASSES, QueuePolicy, Waiting, rank_of
from policies.ratelimit import Limits, RateDecision, RateLimitPolicy
from router.actors import closing_stream
from router.config import AdmissionConfig, TenantConfig

__all__ = ["ENGINE_PRIORITY", "Overloaded", "Queue", "QueueStatistics", "RateLimits", "TenantRateLimited", "Tenants"]

POLL = 0.25  # seconds between a waiting request's looks at the capacity
# GenerateRequest.priority ("higher runs first") for each class: the engine's scheduler orders by it.
ENGINE_PRIORITY = {"interactive": 1, "default": 0, "batch": -1}
CHARS_PER_TOKEN = 4  # prompt estimate when the request carries no token ids


class TenantRateLimited(RateLimited):
    """429 from the tenant's or the key's limits, with ``x-ratelimit-*`` headers."""

    code = "rate_limited"

    def __init__(self, message: str, *, retry_after: float, headers: list[tuple[str, str]]) -> None:
        super().__init__(message, retry_after=retry_after)
        self.headers = headers


class Overloaded(BackendUnavailable):
    """503 from admission: ``code`` is queue_full, queue_timeout, shed or no_healthy_backend."""


class Tenants:
    """Tenant settings by name, and each request's class under its tenant's cap."""

    def __init__(self, tenants: Mapping[str, TenantConfig], keys: Mapping[str, Limits] | None = None) -> None:
        self.tenants = dict(tenants)
        self.keys = dict(keys or {})  # key id -> that key's limits
        self.default = TenantConfig()

    def get(self, name: str) -> TenantConfig:
        return self.tenants.get(name, self.default)

    def classify(self, context: RequestContext) -> PriorityClass:
        """The request's class, capped by its tenant's maximum."""
        cap = self.get(context.tenant).max_priority
        asked = context.priority
        chosen: PriorityClass = asked if rank_of(asked) >= rank_of(cap) else cap
        context.priority = chosen
        return chosen


def prompt_tokens(call: Call) -> int:
    """Prompt tokens of all its choices (each choice prefills its prompt)."""
    return sum(_prompt_tokens(sub) for sub in call.subs)


def _prompt_tokens(sub: GenerateRequest) -> int:
    if sub.prompt_token_ids is not None:
        return len(sub.prompt_token_ids)
    text = sub.prompt or ""
    if sub.messages:
        text += "".join(m.content for m in sub.messages if isinstance(m.content, str))
    return math.ceil(len(text) / CHARS_PER_TOKEN)


class _Metered:
    """The call's backend, with every generated token reported to ``on_tokens``
    (a wrapper around one call's streams: CONVENTIONS #3)."""

    def __init__(self, inner: Backend, on_tokens: Callable[[int], None]) -> None:
        self.inner, self.on_tokens = inner, on_tokens

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
        counted = 0
        async with closing_stream(self.inner.stream(request)) as events:
            async for event in events:
                n = len(event.token_ids) or (1 if event.text else 0)
                if event.usage is not None:  # the backend's own count is the truth
                    n = max(0, event.usage.completion_tokens - counted)
                if n:
                    counted += n
                    self.on_tokens(n)
                yield event

    def info(self) -> BackendInfo:
        return self.inner.info()

    async def health(self) -> Health:
        return await self.inner.health()

    async def aclose(self) -> None:
        await self.inner.aclose()


def meter(call: Call, on_tokens: Callable[[int], None]) -> None:
    call.backend = _Metered(call.backend, on_tokens)


class RateLimits:
    """Stage: the tenant's and the key's limits (requests, tokens, concurrency)."""

    def __init__(self, tenants: Tenants, policy: RateLimitPolicy) -> None:
        self.tenants, self.policy = tenants, policy

    def _subjects(self, context: RequestContext) -> list[tuple[str, Limits]]:
        t = self.tenants.get(context.tenant)
        subjects = [(f"tenant:{context.tenant}", Limits(requests_per_minute=t.requests_per_minute,
                                                         tokens_per_minute=t.tokens_per_minute,
                                                         concurrent=t.concurrent))]  # fmt: skip
        key = self.tenants.keys.get(context.key_id or "")
        if key is not None:
            subjects.append((f"key:{context.key_id}", key))
        return [(name, limits) for name, limits in subjects if limits != Limits()]

    @asynccontextmanager
    async def admit(self, context: RequestContext, call: Call) -> AsyncIterator[None]:
        subjects = self._subjects(context)
        if not subjects:
            yield
            return
        names = [name for name, _ in subjects]
        decision = self.policy.acquire(subjects, prompt_tokens(call), trio.current_time())
        if not decision.allowed:
            raise _refusal(decision)
        meter(call, lambda n: self.policy.charge(names, n, trio.current_time()))
        try:
            yield
        finally:
            self.policy.release(names, trio.current_time())


def _refusal(d: RateDecision) -> TenantRateLimited:
    subject, limit = d.limited or ("", "requests")
    what = subject.split(":", 1)[0] or "tenant"
    headers = []
    for kind, limit_v, remaining, reset in (("requests", d.limit_requests, d.remaining_requests, d.reset_requests),
                                            ("tokens", d.limit_tokens, d.remaining_tokens, d.reset_tokens)):  # fmt: skip
        if limit_v is not None:
            headers += [(f"x-ratelimit-limit-{kind}", f"{limit_v:g}"),
                        (f"x-ratelimit-remaining-{kind}", f"{remaining or 0:g}"),
                        (f"x-ratelimit-reset-{kind}", f"{reset or 0:.3f}s")]  # fmt: skip
    return TenantRateLimited(
        f"Rate limit reached for this {what} ({limit}); retry after {d.retry_after:.3g} s.",
        retry_after=d.retry_after,
        headers=headers,
    )


class QueueStatistics(msgspec.Struct, frozen=True, kw_only=True):
    capacity: int  # slots of the eligible backends now
    busy: int  # slots held
    queued: dict[str, int]  # waiting, per class
    admitted_at_once: int
    admitted_after_wait: int
    service_rate: float | None  # measured completions per second per slot


class _Waiter:
    __slots__ = ("event", "slots")

    def __init__(self, slots: int) -> None:
        self.event = trio.Event()
        self.slots = slots


class Queue:
    """Stage: admission, the bounded per-class queues and the slots."""

    def __init__(
        self,
        tenants: Tenants,
        config: AdmissionConfig,
        policy: AdmissionPolicy,
        queue: QueuePolicy,
        capacity: Callable[[], int],
        *,
        retry_after: float = 1.0,
    ) -> None:
        self.tenants, self.config, self.policy, self.queue = tenants, config, policy, queue
        self.capacity = capacity
        self.retry_after = retry_after  # suggested when no backend is eligible
        self.busy = 0
        self.rate = ServiceRate()
        self._waiters: dict[int, _Waiter] = {}
        self._ids = itertools.count()
        self._counts = {"at_once": 0, "after_wait": 0}

    @asynccontextmanager
    async def admit(self, context: RequestContext, call: Call) -> AsyncIterator[None]:
        cls = self.tenants.classify(context)
        for i, sub in enumerate(call.subs):
            call.subs[i] = msgspec.structs.replace(sub, priority=ENGINE_PRIORITY[cls])
        tenant = self.tenants.get(context.tenant)
        now = trio.current_time()
        capacity = self.capacity()
        slots = max(1, min(len(call.subs), capacity))
        timeout = self.config.queue_timeout.of(cls)
        time_left = timeout if context.deadline is None else min(timeout, context.deadline - now)
        rank = rank_of(cls)
        view = AdmissionView(
            capacity=capacity,
            busy=self.busy,
            slots=slots,
            ahead=sum(self.queue.depth(r) for r in range(rank + 1)),
            queued_in_class=self.queue.depth(rank),
            queue_limit=int(self.config.queue_size.of(cls)),
            service_rate=self.rate.rate,
            time_left=time_left,
        )
        verdict = self.policy.decide(view, now)
        cost = prompt_tokens(call)
        if verdict.action == "reject":
            raise self._rejection(verdict.code or "shed", verdict.retry_after, cls)
        if verdict.action == "queue":
            item = Waiting(id=next(self._ids), tenant=context.tenant, rank=rank, arrival=now,
                           weight=tenant.weight, cost=cost)  # fmt: skip
            await self._wait(item, slots, now + max(0.0, time_left), verdict.wait)
            self._counts["after_wait"] += 1
        else:
            self.busy += slots
            self.queue.charge(context.tenant, tenant.weight, cost, now)
            self._counts["at_once"] += 1
        meter(call, lambda n: self.queue.charge(context.tenant, tenant.weight, n, trio.current_time()))
        started = trio.current_time()
        try:
            yield
        finally:
            self.busy -= slots
            self.rate.observe(trio.current_time() - started)
            self._grant()

    def _rejection(self, code: str, retry_after: float, cls: str) -> Overloaded:
        messages = {
            "no_healthy_backend": "no healthy backend can take this request; retry later",
            "queue_full": f"the {cls} queue is full; retry later",
            "shed": f"the estimated wait ({retry_after:.3g} s) is past this request's deadline; retry later",
        }
        if code == "no_healthy_backend":
            retry_after = self.retry_after
        return Overloaded(messages.get(code, code), code=code, retry_after=retry_after)

    async def _wait(self, item: Waiting, slots: int, deadline: float, estimate: float | None) -> None:
        waiter = _Waiter(slots)
        self._waiters[item.id] = waiter
        self.queue.push(item, trio.current_time())
        try:
            self._grant()
            while not waiter.event.is_set():
                now = trio.current_time()
                if now >= deadline:
                    raise Overloaded(
                        f"no backend slot within {deadline - item.arrival:.3g} s (the queue timeout or deadline); retry later",
                        code="queue_timeout",
                        retry_after=max(1.0, estimate or 1.0),
                    )
                with trio.move_on_at(min(deadline, now + POLL)):
                    await waiter.event.wait()
                if not waiter.event.is_set():
                    self._grant()  # capacity may have appeared without a release
        except BaseException:
            if waiter.event.is_set():  # granted, then cancelled before it ran
                self.busy -= slots
                self._grant()
            else:
                self.queue.remove(item.id)
            raise
        finally:
            del self._waiters[item.id]

    def _grant(self) -> None:
        """Give free slots to the queue's choices, in its order."""
        capacity = self.capacity()
        while self.busy < capacity:
            item = self.queue.pop(trio.current_time())
            if item is None:
                return
            waiter = self._waiters[item.id]
            self.busy += waiter.slots
            waiter.event.set()

    def statistics(self) -> QueueStatistics:
        return QueueStatistics(
            capacity=self.capacity(),
            busy=self.busy,
            queued={cls: self.queue.depth(rank_of(cls)) for cls in CLASSES},
            admitted_at_once=self._counts["at_once"],
            admitted_after_wait=self._counts["after_wait"],
            service_rate=self.rate.rate,
        )

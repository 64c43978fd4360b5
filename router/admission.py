"""The pipeline's stages for issue 15: per-tenant rate limits, then admission
and the fair queue. They own the clocks, the waiting and the slot counts;
every decision is a sans-I/O policy's (policies.ratelimit, .admission,
.fairness)::

    request ─> RateLimits.admit ── acquire(tenant, key; prompt tokens) ── refused: 429 rate_limited
                  │  (a Limiter: in memory, or one      + Retry-After, x-ratelimit-*
                  │   round trip to a shared Redis)
                  │  allowed: x-ratelimit-* on the answer too
                  └─> Queue.admit ── class = body "priority" or X-Priority, capped by the tenant's max
                        group = the backends its model may go to (Router.group_of)
                        decide(the group's capacity, busy, queued, measured rate, deadline,
                               free slots kept for tenants under their share)
                          admit ─────────────────────────────────┐
                          queue ── wait for a slot (fair order) ─┤ timeout: 503 queue_timeout
                          reject ── 503 queue_full / shed / no_healthy_backend
                                                                  v
                        hold ``n`` slots until the last byte; streamed tokens charged
                        to the tenant's rate limit and its fair share as they arrive

Slots are counted per model group: a group's capacity is the sum of the
concurrency limits (learned from 429s) of its backends that take requests
now (up, not draining, not ejected): ``capacity(group)`` comes from the
router. Each group has its own fair queue, service rate and slot shares, so
a model whose backends are full never holds up another's. A request holds
``min(n, capacity)`` slots; a freed slot goes to the group queue's choice at
once (a tenant over its weighted share does not get the last ``reserve_slots``
free ones: policies.fairness.SlotShares). The queue's own task
(:meth:`Queue.run`, a supervised service) offers free slots again every
``POLL`` seconds, so capacity that appears (a backend coming up, an
ejection ending) is used without a release. A request with a deadline
(``X-Deadline-Ms``) waits at most until its deadline less a slot's measured
hold time, and is shed at arrival when the M/M/c wait estimate says it
would not get its answer in time. Groups that share backends
count their slots apart (exact for disjoint groups, the usual case).

Tokens are counted per event (``token_ids``, or one per event with text
when a backend sends no ids) and corrected from the final usage.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Protocol

import msgspec
import trio

from backends.base import Event, GenerateRequest
from backends.errors import BackendUnavailable, RateLimited
from frontend.call import Call
from frontend.context import (
    ENGINE_PRIORITY,
    HeldStage,
    Leave,
    PriorityClass,
    RequestContext,
    new_request_id,
)
from policies.admission import AdmissionPolicy, AdmissionView, ServiceRate
from policies.fairness import CLASSES, QueuePolicy, SlotShares, Waiting, rank_of
from policies.ratelimit import Limits, RateDecision, RateLimitPolicy
from router.config import AdmissionConfig, TenantConfig

__all__ = [
    "ENGINE_PRIORITY",
    "GroupKey",
    "GroupStatistics",
    "Limiter",
    "LocalLimiter",
    "Overloaded",
    "Queue",
    "QueueStatistics",
    "RateLimits",
    "TenantRateLimited",
    "Tenants",
    "rate_headers",
]

POLL = 0.25  # seconds between a waiting request's looks at the capacity
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

    def classify(self, context: RequestContext, call: Call | None = None) -> PriorityClass:
        """The request's class: the body's ``priority`` when it names one,
        else ``X-Priority``'s (the context's), capped by its tenant's
        maximum; and each choice's engine priority. An int body priority
        (vLLM's field) orders the engine's queue within and below the
        class, never above it: ``min(int, the class's)``."""
        cap = self.get(context.tenant).max_priority
        body = call.wire.priority if call is not None else 0
        asked: PriorityClass = context.priority if isinstance(body, int) else body
        chosen: PriorityClass = asked if rank_of(asked) >= rank_of(cap) else cap
        context.priority = chosen
        if call is not None:
            engine = ENGINE_PRIORITY[chosen]
            if isinstance(body, int) and body != 0:
                engine = min(body, engine)
            for i, sub in enumerate(call.subs):
                call.subs[i] = msgspec.structs.replace(sub, priority=engine)
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


class _Meter:
    """One stream's generated tokens, reported to ``on_tokens`` once an
    upstream read (a :class:`~frontend.call.StreamWatch`)."""

    __slots__ = ("counted", "on_tokens", "pending")

    def __init__(self, on_tokens: Callable[[int], None]) -> None:
        self.on_tokens = on_tokens
        self.counted = self.pending = 0

    def events(self, events: Sequence[Event]) -> None:
        for event in events:
            n = len(event.token_ids) or (1 if event.text else 0)
            if event.usage is not None:  # the backend's own count is the truth
                n = max(0, event.usage.completion_tokens - self.counted)
            self.counted += n
            self.pending += n
        if self.pending and not events[-1].more_ready:  # once a read's events: one charge
            self.on_tokens(self.pending)
            self.pending = 0

    def end(self) -> None:
        if self.pending:  # the consumer left inside a read's events
            self.on_tokens(self.pending)
            self.pending = 0


def meter(call: Call, on_tokens: Callable[[int], None]) -> None:
    call.watch(partial(_Meter, on_tokens))


class Limiter(Protocol):
    """The rate-limit stage's side of a limit policy: ``acquire`` may wait on
    a store shared with other routers (router/ratelimit_redis.py); charges
    and releases never block a stream (a shared one sends them in batches)."""

    async def acquire(self, subjects: Sequence[tuple[str, Limits]], tokens: int, holder: str) -> RateDecision: ...

    def charge(self, subjects: Sequence[str], tokens: int) -> None: ...

    def release(self, subjects: Sequence[str], holder: str) -> None: ...


class LocalLimiter:
    """An in-process limit policy (``memory``) on trio's clock."""

    def __init__(self, policy: RateLimitPolicy) -> None:
        self.policy = policy

    async def acquire(self, subjects: Sequence[tuple[str, Limits]], tokens: int, holder: str) -> RateDecision:
        return self.policy.acquire(subjects, tokens, trio.current_time())

    def charge(self, subjects: Sequence[str], tokens: int) -> None:
        self.policy.charge(subjects, tokens, trio.current_time())

    def release(self, subjects: Sequence[str], holder: str) -> None:
        self.policy.release(subjects, trio.current_time())


class RateLimits(HeldStage):
    """Stage: the tenant's and the key's limits (requests, tokens,
    concurrency); the figures of the tightest go out as ``x-ratelimit-*``
    headers on the answer, and on a 429."""

    def __init__(self, tenants: Tenants, limiter: Limiter) -> None:
        self.tenants, self.limiter = tenants, limiter
        self._holders = itertools.count()
        self._process = new_request_id()[:8]  # holder ids unique across routers sharing a store

    def _subjects(self, context: RequestContext) -> list[tuple[str, Limits]]:
        t = self.tenants.get(context.tenant)
        subjects = [(f"tenant:{context.tenant}", Limits(requests_per_minute=t.requests_per_minute,
                                                         tokens_per_minute=t.tokens_per_minute,
                                                         concurrent=t.concurrent))]  # fmt: skip
        key = self.tenants.keys.get(context.key_id or "")
        if key is not None:
            subjects.append((f"key:{context.key_id}", key))
        return [(name, limits) for name, limits in subjects if limits != Limits()]

    async def _admit(self, context: RequestContext, call: Call) -> Leave | None:
        subjects = self._subjects(context)
        if not subjects:
            return None
        names = [name for name, _ in subjects]
        holder = f"{self._process}:{next(self._holders)}"
        decision = await self.limiter.acquire(subjects, prompt_tokens(call), holder)
        if not decision.allowed:
            raise _refusal(decision)
        call.headers += rate_headers(decision)
        meter(call, lambda n: self.limiter.charge(names, n))
        return partial(self.limiter.release, names, holder)


def rate_headers(d: RateDecision) -> list[tuple[str, str]]:
    """``x-ratelimit-limit-*``, ``-remaining-*`` and ``-reset-*`` (OpenAI's
    names) for requests and tokens, of the tightest subject that limits each."""
    headers = []
    for kind, limit_v, remaining, reset in (("requests", d.limit_requests, d.remaining_requests, d.reset_requests),
                                            ("tokens", d.limit_tokens, d.remaining_tokens, d.reset_tokens)):  # fmt: skip
        if limit_v is not None:
            headers += [(f"x-ratelimit-limit-{kind}", f"{limit_v:g}"),
                        (f"x-ratelimit-remaining-{kind}", f"{remaining or 0:g}"),
                        (f"x-ratelimit-reset-{kind}", f"{reset or 0:.3f}s")]  # fmt: skip
    return headers


def _refusal(d: RateDecision) -> TenantRateLimited:
    subject, limit = d.limited or ("", "requests")
    what = subject.split(":", 1)[0] or "tenant"
    return TenantRateLimited(
        f"Rate limit reached for this {what} ({limit}); retry after {d.retry_after:.3g} s.",
        retry_after=d.retry_after,
        headers=rate_headers(d),
    )


class GroupStatistics(msgspec.Struct, frozen=True, kw_only=True):
    backends: tuple[str, ...]  # the group (empty: every backend)
    capacity: int
    busy: int
    queued: int


class QueueStatistics(msgspec.Struct, frozen=True, kw_only=True):
    capacity: int  # slots of the eligible backends now (every group's)
    busy: int  # slots held
    queued: dict[str, int]  # waiting, per class
    admitted_at_once: int
    admitted_after_wait: int
    service_rate: float | None  # measured completions per second per slot (the busiest group's)
    groups: tuple[GroupStatistics, ...] = ()


GroupKey = tuple[str, ...]  # the backends a request may be sent to (sorted); (): every backend


class _Waiter:
    __slots__ = ("event", "rank", "slots", "tenant")

    def __init__(self, slots: int, tenant: str, rank: int) -> None:
        self.event = trio.Event()
        self.slots = slots
        self.tenant, self.rank = tenant, rank


class _Group:
    """One model group's slots: held, waiting (its own fair queue), its
    tenants' shares and its measured service rate."""

    __slots__ = ("busy", "key", "queue", "rate", "shares", "waiters")

    def __init__(self, key: GroupKey, queue: QueuePolicy, shares: SlotShares) -> None:
        self.key, self.queue, self.shares = key, queue, shares
        self.busy = 0
        self.rate = ServiceRate()
        self.waiters: dict[int, _Waiter] = {}


class Queue(HeldStage):
    """Stage: admission, the bounded per-class queues and the slots, per
    model group (the backends a request's model may go to first).

    ``capacity(key)``: the slots of the group's eligible backends now
    (``capacity(None)``: every backend's); ``group(model)``: a model's
    group; ``queue()``: a fresh queue policy for each group;
    ``unavailable(key)``: when a group with no slots gets one back (the
    soonest end of an ejection), for the 503's Retry-After."""

    def __init__(
        self,
        tenants: Tenants,
        config: AdmissionConfig,
        policy: AdmissionPolicy,
        queue: Callable[[], QueuePolicy],
        capacity: Callable[[GroupKey | None], int],
        *,
        group: Callable[[str | None], GroupKey] = lambda model: (),
        retry_after: float = 1.0,
        unavailable: Callable[[GroupKey], float | None] | None = None,
    ) -> None:
        self.tenants, self.config, self.policy = tenants, config, policy
        self.make_queue, self.capacity, self.group_of = queue, capacity, group
        self.retry_after = retry_after  # suggested when no backend is eligible
        self.unavailable = unavailable
        self.groups: dict[GroupKey, _Group] = {}
        self._ids = itertools.count()
        self._counts = {"at_once": 0, "after_wait": 0}

    @property
    def busy(self) -> int:
        return sum(g.busy for g in self.groups.values())

    def group(self, key: GroupKey) -> _Group:
        found = self.groups.get(key)
        if found is None:
            shares = SlotShares(window=self.config.share_window, reserve=self.config.reserve_slots)
            self.groups[key] = found = _Group(key, self.make_queue(), shares)
        return found

    async def _admit(self, context: RequestContext, call: Call) -> Leave:
        cls = self.tenants.classify(context, call)
        g = self.group(self.group_of(call.subs[0].model if call.subs else None))
        tenant = self.tenants.get(context.tenant)
        now = trio.current_time()
        capacity = self.capacity(g.key)
        slots = max(1, min(len(call.subs), capacity))
        timeout = self.config.queue_timeout.of(cls)
        time_left = timeout
        if context.deadline is not None:
            # The deadline is for the answer: the wait may take what the
            # answer's own time (the measured hold of a slot) leaves of it.
            time_left = min(timeout, context.deadline - now - (g.rate.mean or 0.0))
        rank = rank_of(cls)
        g.shares.asked(context.tenant, rank, tenant.weight, now)
        view = AdmissionView(
            capacity=capacity,
            busy=g.busy,
            slots=slots,
            ahead=self._ahead(g, context.tenant, rank, tenant.weight),
            queued_in_class=g.queue.depth(rank),
            queue_limit=int(self.config.queue_size.of(cls)),
            service_rate=g.rate.rate,
            time_left=time_left,
            reserved=g.shares.reserved(context.tenant, rank, capacity, now),
        )
        verdict = self.policy.decide(view, now)
        cost = prompt_tokens(call)
        if verdict.action == "reject":
            raise self._rejection(g, verdict.code or "shed", verdict.retry_after, cls)
        if verdict.action == "queue":
            item = Waiting(id=next(self._ids), tenant=context.tenant, rank=rank, arrival=now,
                           weight=tenant.weight, cost=cost)  # fmt: skip
            await self._wait(g, item, slots, now + max(0.0, time_left), verdict.wait)
            self._counts["after_wait"] += 1
        else:
            g.busy += slots
            g.shares.take(context.tenant, rank, slots)
            g.queue.charge(context.tenant, tenant.weight, cost, now)
            self._counts["at_once"] += 1
        meter(call, lambda n: g.queue.charge(context.tenant, tenant.weight, n, trio.current_time()))
        return partial(self._leave, g, context.tenant, rank, slots, trio.current_time())

    def _leave(self, g: _Group, tenant: str, rank: int, slots: int, started: float) -> None:
        """A call's slots back, however it ended."""
        g.busy -= slots
        g.shares.give(tenant, rank, slots)
        g.rate.observe(trio.current_time() - started)
        if g.waiters:  # the freed slots go to the queue (an empty one takes nothing)
            self._grant(g)

    def _ahead(self, g: _Group, tenant: str, rank: int, weight: float) -> int:
        """Waiting requests that would go before this one: the queue policy's
        estimate when it has one (FairQueue.ahead_of), else all at or above its class."""
        ahead_of: Callable[[str, int, float], int] | None = getattr(g.queue, "ahead_of", None)
        if ahead_of is not None:
            return ahead_of(tenant, rank, weight)
        return sum(g.queue.depth(r) for r in range(rank + 1))

    def _rejection(self, g: _Group, code: str, retry_after: float, cls: str) -> Overloaded:
        messages = {
            "no_healthy_backend": "no healthy backend can take this request; retry later",
            "queue_full": f"the {cls} queue is full; retry later",
            "shed": f"the estimated wait ({retry_after:.3g} s) is past this request's deadline; retry later",
        }
        if code == "no_healthy_backend":
            back = self.unavailable(g.key) if self.unavailable is not None else None
            retry_after = self.retry_after if back is None else back
        return Overloaded(messages.get(code, code), code=code, retry_after=retry_after)

    async def _wait(self, g: _Group, item: Waiting, slots: int, deadline: float, estimate: float | None) -> None:
        waiter = _Waiter(slots, item.tenant, item.rank)
        g.waiters[item.id] = waiter
        g.queue.push(item, trio.current_time())
        g.shares.wait(item.tenant, item.rank, +1)
        try:
            self._grant(g)
            with trio.move_on_at(deadline):
                await waiter.event.wait()
            if not waiter.event.is_set():
                raise Overloaded(
                    f"no backend slot within {deadline - item.arrival:.3g} s (the queue timeout or deadline); retry later",
                    code="queue_timeout",
                    retry_after=max(1.0, estimate or 1.0),
                )
        except BaseException:
            if waiter.event.is_set():  # granted, then cancelled before it ran
                g.busy -= slots
                g.shares.give(item.tenant, item.rank, slots)
                self._grant(g)
            else:
                g.queue.remove(item.id)
            raise
        finally:
            g.shares.wait(item.tenant, item.rank, -1)
            del g.waiters[item.id]

    name = "admission queue"

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Every ``POLL`` seconds, offer each group's free slots to its queue:
        capacity that appears without a release (a backend coming up, an
        ejection ending, a learned limit growing) is used within ``POLL``.
        One task for all the waiters, rather than each waking to look."""
        task_status.started()
        while True:
            await trio.sleep(POLL)
            for g in list(self.groups.values()):
                if g.waiters:
                    self._grant(g)

    def crashed(self, exc: BaseException) -> None:
        pass  # the supervisor logs it and restarts run(); the queues are intact

    def _grant(self, g: _Group) -> None:
        """Give free slots to the queue's choices, in its order, each to a
        tenant that may take one (not over its share of the last free ones)."""
        capacity = self.capacity(g.key)
        now = trio.current_time()
        while g.busy < capacity:
            free = capacity - g.busy

            def may_take(w: Waiting, free: int = free) -> bool:
                return free > g.shares.reserved(w.tenant, w.rank, capacity, now)

            item = g.queue.pop(now, may_take)
            if item is None:
                return
            waiter = g.waiters[item.id]
            g.busy += waiter.slots
            g.shares.take(waiter.tenant, waiter.rank, waiter.slots)
            waiter.event.set()

    def statistics(self) -> QueueStatistics:
        queued = dict.fromkeys(CLASSES, 0)
        groups = []
        for key, g in sorted(self.groups.items()):
            for cls in CLASSES:
                queued[cls] += g.queue.depth(rank_of(cls))
            groups.append(GroupStatistics(backends=key, capacity=self.capacity(key), busy=g.busy, queued=g.queue.depth()))
        busiest = max(self.groups.values(), key=lambda g: g.rate.samples, default=None)
        return QueueStatistics(
            capacity=self.capacity(None),
            busy=self.busy,
            queued=queued,
            admitted_at_once=self._counts["at_once"],
            admitted_after_wait=self._counts["after_wait"],
            service_rate=busiest.rate.rate if busiest is not None else None,
            groups=tuple(groups),
        )

"""Rate limits shared by several routers through a store that runs scripts
atomically (Redis): the same token buckets as :mod:`policies.ratelimit`,
decided inside the store. Sans-I/O: this module holds the scripts and turns
a request into a script call and the store's reply into a
:class:`~policies.ratelimit.RateDecision`; the router sends the call
(router/ratelimit_redis.py)::

    acquire_call(subjects, tokens, holder) ──> ScriptCall(ACQUIRE, keys, args) ──> store: one round trip
    acquire_result(subjects, reply)        <── [allowed, retry_after, limited, kind, levels...]
    settle_call(subjects, tokens, holders) ──> ScriptCall(SETTLE, ...)   generated tokens, ends (batched)

Why it cannot overshoot the way LiteLLM's shared limits do (limit x the
replica count): nothing is counted in a router and synced later. Every
admission is one script that refills, checks and takes from every bucket of
every subject at once, on the store's clock (``TIME``), so two routers
admitting at the same instant are serialised by the store, and the check
sees every admission before it. What is left is the overshoot any
charge-as-you-go limit has: generated tokens reach the store after they
stream (the router sends them every ``flush_interval``), so a subject may run
at most its in-flight requests' unsent tokens into debt, which the next
admissions wait out.

Keys per subject (``prefix`` + the subject name): ``:b`` a hash of the two
bucket levels and their stamp (``r``, ``t``, ``s``), expiring once full again;
``:c`` a sorted set of the holders of concurrency slots, each scored with its
lease's end, so a router that dies without releasing frees its slots when
the lease ends.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import msgspec

from policies.ratelimit import LimitName, Limits, RateDecision

__all__ = ["ACQUIRE", "SETTLE", "ScriptCall", "SharedBuckets", "SharedOptions", "SharedRateLimitPolicy"]

# Both buckets of a subject refill from one stamp, so every script that
# writes a hash refills both first. Numbers leave as strings (a Lua number
# becomes an integer in a Redis reply).
_REFILL = """
local function refill(key, rpm, tpm, now)
  local h = redis.call('HMGET', key, 'r', 't', 's')
  local dt = math.max(0, now - (tonumber(h[3]) or now))
  local r, t = nil, nil
  if rpm > 0 then r = math.min(rpm, (tonumber(h[1]) or rpm) + dt * rpm / 60) end
  if tpm > 0 then t = math.min(tpm, (tonumber(h[2]) or tpm) + dt * tpm / 60) end
  return r, t
end
local function store(key, r, t, rpm, tpm, now)
  local full = 0
  if r then redis.call('HSET', key, 'r', tostring(r)); full = math.max(full, (rpm - r) * 60 / rpm) end
  if t then redis.call('HSET', key, 't', tostring(t)); full = math.max(full, (tpm - t) * 60 / tpm) end
  redis.call('HSET', key, 's', tostring(now))
  redis.call('PEXPIRE', key, math.ceil(full * 1000) + 1000)
end
local tm = redis.call('TIME')
local now = tonumber(tm[1]) + tonumber(tm[2]) / 1000000
"""

# KEYS: per subject its :b then its :c. ARGV: tokens, holder, lease, then per
# subject rpm, tpm, concurrent (0: no such limit).
# Reply: allowed (1/0), retry_after, limited subject (1-based, 0 none),
# limited kind, then per subject its request and token levels ('' none).
ACQUIRE = _REFILL + """
local tokens, holder, lease = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local n = #KEYS / 2
local levels, worst, worst_i, worst_kind = {}, 0, 0, ''
for i = 1, n do
  local rpm, tpm, cap = tonumber(ARGV[3 * i + 1]), tonumber(ARGV[3 * i + 2]), tonumber(ARGV[3 * i + 3])
  local r, t = refill(KEYS[2 * i - 1], rpm, tpm, now)
  levels[i] = {r, t}
  local waits = {}
  if r then waits[#waits + 1] = {math.max(0, (1 - r) / (rpm / 60)), 'requests'} end
  if t then waits[#waits + 1] = {math.max(0, (math.min(math.max(tokens, 1), tpm) - t) / (tpm / 60)), 'tokens'} end
  if cap > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[2 * i], '-inf', now)
    if redis.call('ZCARD', KEYS[2 * i]) >= cap then waits[#waits + 1] = {1.0, 'concurrent'} end
  end
  for _, w in ipairs(waits) do
    if w[1] > worst then worst, worst_i, worst_kind = w[1], i, w[2] end
  end
end
local out = {}
if worst > 0 then
  out = {'0', tostring(worst), tostring(worst_i), worst_kind}
else
  out = {'1', '0', '0', ''}
  for i = 1, n do
    local rpm, tpm, cap = tonumber(ARGV[3 * i + 1]), tonumber(ARGV[3 * i + 2]), tonumber(ARGV[3 * i + 3])
    local r, t = levels[i][1], levels[i][2]
    if r then r = r - 1 end
    if t then t = t - tokens end
    levels[i] = {r, t}
    store(KEYS[2 * i - 1], r, t, rpm, tpm, now)
    if cap > 0 then
      redis.call('ZADD', KEYS[2 * i], now + lease, holder)
      redis.call('PEXPIRE', KEYS[2 * i], math.ceil(lease * 1000) + 1000)
    end
  end
end
for i = 1, n do
  out[#out + 1] = levels[i][1] and tostring(levels[i][1]) or ''
  out[#out + 1] = levels[i][2] and tostring(levels[i][2]) or ''
end
return out
"""

# KEYS: per subject its :b then its :c. ARGV: tokens, then per subject rpm,
# tpm, then the holders to release. Reply: 'ok'.
SETTLE = _REFILL + """
local tokens = tonumber(ARGV[1])
local n = #KEYS / 2
for i = 1, n do
  local rpm, tpm = tonumber(ARGV[2 * i]), tonumber(ARGV[2 * i + 1])
  if tokens > 0 and tpm > 0 then
    local r, t = refill(KEYS[2 * i - 1], rpm, tpm, now)
    store(KEYS[2 * i - 1], r, t - tokens, rpm, tpm, now)
  end
  for j = 2 * n + 2, #ARGV do redis.call('ZREM', KEYS[2 * i], ARGV[j]) end
end
return 'ok'
"""


class ScriptCall(msgspec.Struct, frozen=True):
    """Run ``script`` (its text; the store's id for it is :attr:`sha`) with ``keys`` and ``args``."""

    script: str
    keys: tuple[str, ...]
    args: tuple[str, ...]

    @property
    def sha(self) -> str:
        return hashlib.sha1(self.script.encode()).hexdigest()


class SharedOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    prefix: str = "headrace:rl:"  # every key starts with it (several deployments, one Redis)
    lease: float = 600.0  # seconds a concurrency slot is held at most (a router that died frees it then)
    flush_interval: float = 0.05  # seconds between two batches of generated tokens and ends
    timeout: float = 0.5  # seconds an admission waits on the store before fail_open decides
    fail_open: bool = True  # the store unreachable: admit (and count it) rather than refuse everything

    def __post_init__(self) -> None:
        if self.lease <= 0 or self.flush_interval <= 0 or self.timeout <= 0:
            raise ValueError("lease, flush_interval and timeout must be positive")


@runtime_checkable
class SharedRateLimitPolicy(Protocol):
    """A limit policy decided in a shared store: script calls out, decisions in."""

    options: SharedOptions

    def acquire_call(self, subjects: Sequence[tuple[str, Limits]], tokens: int, holder: str) -> ScriptCall: ...

    def acquire_result(self, subjects: Sequence[tuple[str, Limits]], reply: Sequence[object]) -> RateDecision: ...

    def settle_call(self, subjects: Sequence[tuple[str, Limits]], tokens: int, holders: Sequence[str]) -> ScriptCall: ...


class SharedBuckets:
    """Token buckets in Redis, shared by every router that names it:
    requests and tokens per minute, concurrent requests (one round trip per admission)."""

    Options = SharedOptions

    def __init__(self, options: SharedOptions | None = None) -> None:
        self.options = options or SharedOptions()

    def _keys(self, subjects: Sequence[tuple[str, Limits]]) -> tuple[str, ...]:
        p = self.options.prefix
        return tuple(key for name, _ in subjects for key in (f"{p}{name}:b", f"{p}{name}:c"))

    def acquire_call(self, subjects: Sequence[tuple[str, Limits]], tokens: int, holder: str) -> ScriptCall:
        args = [str(max(0, tokens)), holder, f"{self.options.lease:g}"]
        for _, limits in subjects:
            args += [_num(limits.requests_per_minute), _num(limits.tokens_per_minute), _num(limits.concurrent)]
        return ScriptCall(ACQUIRE, self._keys(subjects), tuple(args))

    def acquire_result(self, subjects: Sequence[tuple[str, Limits]], reply: Sequence[object]) -> RateDecision:
        fields = [x.decode() if isinstance(x, bytes) else str(x) for x in reply]
        if len(fields) != 4 + 2 * len(subjects):
            raise ValueError(f"the acquire script answered {len(fields)} fields for {len(subjects)} subjects")
        allowed, retry_after, limited, kind = fields[0] == "1", float(fields[1]), int(fields[2]), fields[3]
        levels = [(_level(fields[4 + 2 * i]), _level(fields[5 + 2 * i])) for i in range(len(subjects))]
        which: tuple[str, LimitName] | None = None
        if not allowed and 1 <= limited <= len(subjects) and kind in ("requests", "tokens", "concurrent"):
            which = (subjects[limited - 1][0], kind)  # type: ignore[assignment]
        req = _tightest([(lim.requests_per_minute, lv[0]) for (_, lim), lv in zip(subjects, levels, strict=True)])
        tok = _tightest([(lim.tokens_per_minute, lv[1]) for (_, lim), lv in zip(subjects, levels, strict=True)])
        return RateDecision(
            allowed=allowed,
            retry_after=retry_after,
            limited=which,
            limit_requests=req[0] if req else None,
            remaining_requests=max(0.0, math.floor(req[1])) if req else None,
            reset_requests=(req[0] - req[1]) * 60 / req[0] if req else None,
            limit_tokens=tok[0] if tok else None,
            remaining_tokens=max(0.0, math.floor(tok[1])) if tok else None,
            reset_tokens=(tok[0] - tok[1]) * 60 / tok[0] if tok else None,
        )

    def settle_call(self, subjects: Sequence[tuple[str, Limits]], tokens: int, holders: Sequence[str]) -> ScriptCall:
        args = [str(max(0, tokens))]
        for _, limits in subjects:
            args += [_num(limits.requests_per_minute), _num(limits.tokens_per_minute)]
        return ScriptCall(SETTLE, self._keys(subjects), (*args, *holders))


def _num(value: float | None) -> str:
    return "0" if value is None else f"{value:g}"


def _level(field: str) -> float | None:
    return float(field) if field else None


def _tightest(buckets: Sequence[tuple[float | None, float | None]]) -> tuple[float, float] | None:
    """(burst, level) of the bucket with the least of its burst left."""
    live = [(burst, level) for burst, level in buckets if burst and level is not None]
    return min(live, key=lambda b: b[1] / b[0], default=None)

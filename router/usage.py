"""Cost accounting: prompt tokens, generated tokens and GPU-seconds per
tenant and model, as metrics and in the job store (``GET /admin/usage``).

::

    pipeline stage (UsageLedger.admit) ── watches the call's streams, reads each choice's final usage
        └─ at the call's end: +1 request, prompt (once per call), generated, gpu_seconds
           ├─> headrace_usage_*_total{tenant, model}       (bounded labels, at once)
           └─> pending[(tenant, model, minute)] += ...     (in memory)
    UsageLedger.run (a supervised service): every ``interval`` s, the pending rows in one
        transaction: INSERT ... ON CONFLICT DO UPDATE SET n = n + excluded.n (several router
        processes add to the same rows); a batch the store refused is kept for the next
    GET /admin/usage?tenant=&since=&until=&model=: flush this process's rows, then read the store

GPU-seconds come from the backends: headrace's engine reports each request's
share of its steps (``usage.gpu_seconds``: backends/engine/accounting.py); a
backend that does not report it counts 0. Known gaps: a request the client
abandons reports no usage (the engine's own ``headrace_engine_gpu_seconds``
still has its time), and a migrated stream counts the GPU time of the backend
that finished it. A router that dies loses at most ``interval`` seconds of
rows; metrics are per process, the store is shared.

Rows are per ``bucket`` seconds (a minute) by the router's wall clock. The
SQLite table is created here (``CREATE TABLE IF NOT EXISTS``, beside the job
store's migrations); PostgreSQL's is migration 2 of router/store_pg.py.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, cast
from urllib.parse import parse_qs

import msgspec
import trio
from prometheus_client import Counter

from backends.base import Event, Usage
from backends.errors import BadRequest, HeadraceError, NotFound
from frontend import metric_names as N
from frontend.context import HeldStage, Leave, RequestContext
from frontend.server import HTTPRequest, Response, json_response
from router.store import JobStore, SQLiteStore

if TYPE_CHECKING:
    from frontend.call import Call
    from router.metrics import RouterMetrics
    from router.store_pg import Cursor

__all__ = ["UsageLedger", "UsageRow", "UsageStore", "open_usage_store"]

log = logging.getLogger(__name__)
MAX_ROWS = 10_000


class UsageRow(msgspec.Struct, frozen=True, kw_only=True):
    tenant: str
    model: str
    start: float  # the bucket's first second (epoch)
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    gpu_seconds: float = 0.0


class UsageStore(Protocol):
    async def add_usage(self, rows: Sequence[UsageRow]) -> None: ...
    async def usage(self, *, tenant: str | None, model: str | None, since: float, until: float, limit: int) -> list[UsageRow]: ...


_TABLE = """CREATE TABLE IF NOT EXISTS usage (
    tenant TEXT NOT NULL, model TEXT NOT NULL, start REAL NOT NULL,
    requests INTEGER NOT NULL DEFAULT 0, prompt_tokens INTEGER NOT NULL DEFAULT 0,
    generated_tokens INTEGER NOT NULL DEFAULT 0, gpu_seconds REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, start, model))"""
_UPSERT = ("INSERT INTO usage (tenant, model, start, requests, prompt_tokens, generated_tokens, gpu_seconds)"
           " VALUES (?,?,?,?,?,?,?) ON CONFLICT (tenant, start, model) DO UPDATE SET"
           " requests = usage.requests + excluded.requests, prompt_tokens = usage.prompt_tokens + excluded.prompt_tokens,"
           " generated_tokens = usage.generated_tokens + excluded.generated_tokens,"
           " gpu_seconds = usage.gpu_seconds + excluded.gpu_seconds")  # fmt: skip
_FIELDS = ("tenant", "model", "start", "requests", "prompt_tokens", "generated_tokens", "gpu_seconds")


def _query(tenant: str | None, model: str | None) -> str:
    where = " AND tenant = ?" if tenant is not None else ""
    where += " AND model = ?" if model is not None else ""
    return f"SELECT {', '.join(_FIELDS)} FROM usage WHERE start >= ? AND start < ?{where} ORDER BY start, tenant, model LIMIT ?"


def _params(tenant: str | None, model: str | None, since: float, until: float, limit: int) -> tuple[Any, ...]:
    return (since, until, *(x for x in (tenant, model) if x is not None), limit)


def _values(row: UsageRow) -> tuple[Any, ...]:
    return tuple(getattr(row, f) for f in _FIELDS)


def _row(values: tuple[Any, ...]) -> UsageRow:
    return UsageRow(**dict(zip(_FIELDS, values, strict=True)))


class SQLiteUsageStore:
    """The ``usage`` table in the job store's SQLite file, through its connection and lock."""

    def __init__(self, store: SQLiteStore) -> None:
        self.store = store
        with store._tx() as db:
            db.execute(_TABLE)

    async def add_usage(self, rows: Sequence[UsageRow]) -> None:
        await self.store._run(self._add, [_values(r) for r in rows])

    def _add(self, values: list[tuple[Any, ...]]) -> None:
        with self.store._tx() as db:
            db.executemany(_UPSERT, values)

    async def usage(self, *, tenant: str | None, model: str | None, since: float, until: float, limit: int) -> list[UsageRow]:
        return await self.store._run(self._usage, _query(tenant, model), _params(tenant, model, since, until, limit))

    def _usage(self, query: str, params: tuple[Any, ...]) -> list[UsageRow]:
        with self.store._lock:
            return [_row(r) for r in self.store._db.execute(query, params).fetchall()]


class PostgresUsageStore:
    """The ``usage`` table in the job store's PostgreSQL database (router/store_pg.py's migration 2)."""

    def __init__(self, store: Any) -> None:
        self.store = store  # a PostgresStore (psycopg is imported only where it is used)

    async def add_usage(self, rows: Sequence[UsageRow]) -> None:
        await self.store._run(self._add, [_values(r) for r in rows])

    def _add(self, cur: Cursor, values: list[tuple[Any, ...]]) -> None:
        cur.executemany(_UPSERT.replace("?", "%s"), values)

    async def usage(self, *, tenant: str | None, model: str | None, since: float, until: float, limit: int) -> list[UsageRow]:
        query = _query(tenant, model).replace("?", "%s")
        rows: list[UsageRow] = await self.store._run(self._usage, query, _params(tenant, model, since, until, limit))
        return rows

    def _usage(self, cur: Cursor, query: str, params: tuple[Any, ...]) -> list[UsageRow]:
        return [_row(r) for r in cur.execute(query.encode(), params).fetchall()]


def open_usage_store(store: JobStore | None) -> UsageStore | None:
    """The usage table beside the job store (None: no store, usage only in metrics)."""
    if store is None:
        return None
    if isinstance(store, SQLiteStore):
        return SQLiteUsageStore(store)
    return PostgresUsageStore(store)


class _Totals:
    __slots__ = ("generated", "gpu", "prompt", "requests")

    def __init__(self) -> None:
        self.requests, self.prompt, self.generated, self.gpu = 0, 0, 0, 0.0


class UsageLedger(HeldStage):
    """A pipeline stage that accounts each call's usage, and the service that
    writes it to the store in batches. Metrics labels go through the router's
    :class:`~router.metrics.LabelBounds` (``metrics.bounds``, set by its call timer)."""

    name = "usage"

    def __init__(self, metrics: RouterMetrics, *, interval: float = 5.0, bucket: float = 60.0,
                 clock: Callable[[], float] = time.time) -> None:  # fmt: skip
        self.metrics, self.interval, self.bucket, self.clock = metrics, interval, bucket, clock
        self.store: UsageStore | None = None
        self._pending: dict[tuple[str, str, float], _Totals] = {}
        r = metrics.registry
        self._counters = [cast(Counter, f.instrument(r)) for f in (N.USAGE_REQUESTS, N.USAGE_PROMPT, N.USAGE_GENERATED, N.USAGE_GPU)]
        self._children: dict[tuple[str, str], list[Counter]] = {}
        self._flush_errors = cast(Counter, N.USAGE_FLUSH_ERRORS.instrument(r))
        self._lock = trio.Lock()

    def attach(self, store: UsageStore | None) -> None:
        """Write to ``store`` (the job store's usage table) from now on."""
        self.store = store

    # ------------------------------------------------------------ the pipeline stage

    async def _admit(self, context: RequestContext, call: Call) -> Leave:
        seen = _Seen(call.model)
        call.watch(lambda: seen)
        return partial(self._seen, context.tenant, seen)

    def _seen(self, tenant: str, seen: _Seen) -> None:
        if seen.usages:
            self.record(tenant, seen.model, seen.total())

    def record(self, tenant: str, model: str, usage: Usage) -> None:
        """One finished call's usage (its choices' together)."""
        bounds = self.metrics.bounds
        labels = (bounds.tenant(tenant), bounds.model(model)) if bounds is not None else (N.OTHER, N.OTHER)
        children = self._children.get(labels)
        if children is None:
            children = self._children[labels] = [c.labels(*labels) for c in self._counters]
        for child, value in zip(children, (1, usage.prompt_tokens, usage.completion_tokens, usage.gpu_seconds), strict=True):
            child.inc(value)
        if self.store is None:
            return
        start = math.floor(self.clock() / self.bucket) * self.bucket
        totals = self._pending.get((tenant, model, start))
        if totals is None:
            totals = self._pending[(tenant, model, start)] = _Totals()
        totals.requests += 1
        totals.prompt += usage.prompt_tokens
        totals.generated += usage.completion_tokens
        totals.gpu += usage.gpu_seconds

    # ------------------------------------------------------------ the service

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                await trio.sleep(self.interval)
                await self.flush()
        finally:
            with trio.CancelScope(shield=True, deadline=trio.current_time() + 5):  # shutdown: the last rows too
                await self.flush()

    def crashed(self, exc: BaseException) -> None:
        log.warning("usage ledger: %s", exc)

    async def flush(self) -> None:
        """The pending rows to the store in one transaction (kept on failure)."""
        async with self._lock:
            if self.store is None or not self._pending:
                return
            pending, self._pending = self._pending, {}
            rows = [UsageRow(tenant=t, model=m, start=s, requests=v.requests, prompt_tokens=v.prompt,
                             generated_tokens=v.generated, gpu_seconds=v.gpu) for (t, m, s), v in pending.items()]  # fmt: skip
            try:
                await self.store.add_usage(rows)
            except HeadraceError as exc:
                log.warning("usage: %d rows kept for the next flush: %s", len(rows), exc)
                self._flush_errors.inc()
                for key, v in pending.items():  # back, merged with what came meanwhile
                    mine = self._pending.setdefault(key, _Totals())
                    mine.requests += v.requests
                    mine.prompt += v.prompt
                    mine.generated += v.generated
                    mine.gpu += v.gpu

    # ------------------------------------------------------------ GET /admin/usage

    async def admin(self, request: HTTPRequest) -> Response:
        """``?tenant=&model=&since=&until=`` (epoch seconds or ISO 8601; since:
        24 h ago, until: now): the rows per bucket and the totals per tenant and model."""
        if self.store is None:
            raise NotFound("usage is kept in the job store: turn jobs on ([jobs] enabled, data_dir or store)")
        query = parse_qs(request.query.decode("latin-1"))
        now = self.clock()
        since = _instant(query, "since", now - 24 * 3600)
        until = _instant(query, "until", now + self.bucket)
        if since > until:
            raise BadRequest("since must not be after until", param="since")
        tenant = query.get("tenant", [None])[-1] or None
        model = query.get("model", [None])[-1] or None
        await self.flush()
        rows = await self.store.usage(tenant=tenant, model=model, since=since, until=until, limit=MAX_ROWS + 1)
        totals: dict[tuple[str, str], dict[str, Any]] = {}
        for row in rows[:MAX_ROWS]:
            t = totals.setdefault((row.tenant, row.model), {"tenant": row.tenant, "model": row.model, "requests": 0,
                                                            "prompt_tokens": 0, "generated_tokens": 0, "gpu_seconds": 0.0})  # fmt: skip
            t["requests"] += row.requests
            t["prompt_tokens"] += row.prompt_tokens
            t["generated_tokens"] += row.generated_tokens
            t["gpu_seconds"] += row.gpu_seconds
        return json_response({
            "object": "usage", "tenant": tenant, "model": model, "since": since, "until": until,
            "bucket_seconds": self.bucket, "data": [msgspec.to_builtins(r) for r in rows[:MAX_ROWS]],
            "totals": sorted(totals.values(), key=lambda t: (t["tenant"], t["model"])), "has_more": len(rows) > MAX_ROWS,
        })  # fmt: skip


def _instant(query: dict[str, list[str]], name: str, default: float) -> float:
    raw = query.get(name, [None])[-1]
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        try:
            parsed = datetime.fromisoformat(raw)
        except ValueError:
            raise BadRequest(f"{name} must be epoch seconds or an ISO 8601 time, not {raw[:40]!r}", param=name) from None
        if parsed.tzinfo is None:
            raise BadRequest(f"{name}: an ISO 8601 time needs its offset (Z or +hh:mm)", param=name) from None
        return parsed.timestamp()
    if not math.isfinite(value):
        raise BadRequest(f"{name} must be a finite number of seconds", param=name)
    return value


class _Seen:
    """What one call's choices reported: the answering model and each final
    usage (one :class:`~frontend.call.StreamWatch` for all its streams)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.usages: list[Usage] = []

    def events(self, events: Sequence[Event]) -> None:
        for event in events:
            if event.model is not None:
                self.model = event.model
            if event.usage is not None and event.finish_reason is not None:
                self.usages.append(event.usage)

    def end(self) -> None:
        pass

    def total(self) -> Usage:
        # As the response counts it: the prompt once (the n choices share it), the rest summed.
        return Usage(prompt_tokens=max(u.prompt_tokens for u in self.usages),
                     completion_tokens=sum(u.completion_tokens for u in self.usages),
                     gpu_seconds=sum(u.gpu_seconds for u in self.usages))  # fmt: skip

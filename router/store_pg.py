"""The :class:`~router.store.JobStore` on PostgreSQL, for router replicas
on several hosts sharing one queue (``[jobs] store = "postgres"``, ``url``).

The same transition table, leases, idempotency keys and errors as the
SQLite store; what differs is how writers are kept apart::

    claim    BEGIN; pg_advisory_xact_lock(CLAIM)       claims go one at a time, so the per-tenant
             count running per tenant                  count they read is exact (row locks alone
             now := clock_timestamp()                  let two claims each see a tenant's slot free)
             SELECT queued ... FOR UPDATE SKIP LOCKED  (a row a DELETE holds is left for next time)
             UPDATE -> running, owner, heartbeat; COMMIT
    apply,   BEGIN; SELECT the row FOR UPDATE          a DELETE and the runner finishing serialise
    cancel   transition(); UPDATE; COMMIT              on the row lock: the second sees the first
    reserve  BEGIN; pg_advisory_xact_lock(hash(tenant, key)); read; insert or take over; COMMIT

Time is the database's (``clock_timestamp()``), read inside the
transaction after its locks and, in a claim, after the count (whose
snapshot already holds any job that finished meanwhile): routers on hosts
whose clocks disagree still agree on leases, ``not_before`` and key expiry,
and a tenant's next job never starts before its last one finished.
``clock()`` (what the runner adds a retry delay to) is local time plus the
offset measured at the last read. Tests pass ``clock`` to use a fake one.
Timestamps are epoch seconds (``double precision``) as in SQLite, so a row
maps to the same :class:`~router.store.Job`.

I/O: psycopg 3's blocking API in ``trio.to_thread.run_sync`` (its async API
is asyncio-only), over a few connections (``pool_size``) behind a
``CapacityLimiter``: a claim waiting for another router's claim holds one
connection, not the store. Each call is one explicit transaction. An idle
connection the server closed (a restart) is replaced before anything is
sent; any other psycopg error drops the connection and becomes
:class:`~router.store.StoreUnavailable` (503). ``statement_timeout``,
``lock_timeout``, ``idle_in_transaction_session_timeout``, TCP keepalives
and ``tcp_user_timeout`` bound a slow or vanished server (and a router
frozen mid-transaction cannot hold the claim lock for long).

Schema: ``headrace_schema(version)``, migrated at open in one transaction
under an advisory lock (DDL is transactional in PostgreSQL), so routers
that start together migrate once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec
import psycopg
import trio
from psycopg.pq import TransactionStatus

from router.store import (
    _COLUMNS,
    _RANK,
    INSERT_JOB,
    SELECT_JOBS,
    TERMINAL,
    IdemBusy,
    IdemMismatch,
    IdemReplay,
    IdemReserved,
    IdemResult,
    Job,
    JobEvent,
    JobStatus,
    LeaseLost,
    StoreUnavailable,
    job_row,
    row_job,
    transition,
)

__all__ = ["MIGRATIONS", "PostgresStore"]

T = TypeVar("T")
log = logging.getLogger(__name__)
Cursor = psycopg.Cursor[tuple[Any, ...]]

# pg_advisory_xact_lock keys: claims, and migrations (any fixed 64-bit numbers; these spell "hrclaim" / "hrmigr").
CLAIM_LOCK = 0x6872636C61696D
MIGRATE_LOCK = 0x68726D69677200

# Each entry takes the schema from version i to i + 1 (``headrace_schema.version`` says where a database is).
MIGRATIONS: Sequence[str] = (
    """
    CREATE TABLE jobs (
        seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        id text NOT NULL UNIQUE,
        tenant text NOT NULL,
        kind text NOT NULL,
        body bytea NOT NULL,
        status text NOT NULL,
        priority text NOT NULL,
        metadata bytea NOT NULL,
        result bytea,
        error bytea,
        attempts integer NOT NULL DEFAULT 0,
        errors integer NOT NULL DEFAULT 0,
        created_at double precision NOT NULL,
        started_at double precision,
        finished_at double precision,
        not_before double precision NOT NULL DEFAULT 0,
        owner text,
        heartbeat double precision,
        batch_id text,
        line integer
    );
    CREATE INDEX jobs_tenant ON jobs (tenant, seq);
    CREATE INDEX jobs_status ON jobs (status, seq);
    CREATE UNIQUE INDEX jobs_batch_line ON jobs (batch_id, line);
    CREATE TABLE idempotency (
        tenant text NOT NULL,
        key text NOT NULL,
        digest text NOT NULL,
        created_at double precision NOT NULL,
        status integer,
        response bytea,
        job_id text,
        PRIMARY KEY (tenant, key)
    );
    CREATE TABLE files (
        seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        id text NOT NULL UNIQUE,
        tenant text NOT NULL,
        purpose text NOT NULL,
        filename text NOT NULL,
        bytes bigint NOT NULL DEFAULT 0,
        lines bigint NOT NULL DEFAULT 0,
        status text NOT NULL,
        created_at double precision NOT NULL,
        batch_id text
    );
    CREATE INDEX files_tenant ON files (tenant, seq);
    CREATE TABLE batches (
        seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        id text NOT NULL UNIQUE,
        tenant text NOT NULL,
        endpoint text NOT NULL,
        input_file_id text NOT NULL,
        completion_window text NOT NULL,
        status text NOT NULL,
        metadata bytea NOT NULL,
        output_file_id text NOT NULL,
        error_file_id text NOT NULL,
        total integer NOT NULL DEFAULT 0,
        errors bytea,
        created_at double precision NOT NULL,
        expires_at double precision NOT NULL,
        in_progress_at double precision,
        finalizing_at double precision,
        completed_at double precision,
        failed_at double precision,
        cancelling_at double precision,
        cancelled_at double precision,
        expired_at double precision
    );
    CREATE INDEX batches_tenant ON batches (tenant, seq);
    CREATE INDEX batches_status ON batches (status);
    """,
    # 2: cost accounting (router/usage.py): per tenant, model and minute, added to by every router.
    """
    CREATE TABLE usage (
        tenant text NOT NULL,
        model text NOT NULL,
        start double precision NOT NULL,
        requests bigint NOT NULL DEFAULT 0,
        prompt_tokens bigint NOT NULL DEFAULT 0,
        generated_tokens bigint NOT NULL DEFAULT 0,
        gpu_seconds double precision NOT NULL DEFAULT 0,
        PRIMARY KEY (tenant, start, model)
    );
    CREATE INDEX usage_start ON usage (start);
    """,
    # 3: expired idempotency keys are deleted (requeue_stale), found by age.
    """
    CREATE INDEX idempotency_created ON idempotency (created_at);
    """,
)

_WRITABLE = frozenset(_COLUMNS) - {"id", "tenant", "kind", "body"}
INSERT_JOB_PG = INSERT_JOB.replace("?", "%s")  # the SQLite store's statement, psycopg's placeholders


class PostgresStore:
    """:class:`~router.store.JobStore` in a PostgreSQL database at ``url``
    (``postgresql://user@host:port/db``; libpq's parameters and environment apply)."""

    def __init__(
        self,
        url: str,
        *,
        clock: Callable[[], float] | None = None,
        idempotency_ttl: float = 24 * 3600,
        lease: float = 60.0,
        pool_size: int = 4,
        timeout: float = 10.0,
    ) -> None:
        """Connects and migrates: blocking, done once at startup. A server
        that cannot be reached then is tried again by each call (each a 503
        :class:`StoreUnavailable` until it answers, then migrated), so the
        router serves its other traffic while the database is away."""
        self.url = url
        self._fixed_clock = clock
        self._offset = 0.0  # the database's clock minus ours, as last measured
        self.clock: Callable[[], float] = clock if clock is not None else (lambda: time.time() + self._offset)
        self.ttl = idempotency_ttl
        self.lease = lease
        self.timeout = timeout
        self._limiter = trio.CapacityLimiter(pool_size)
        self._idle: list[psycopg.Connection[tuple[Any, ...]]] = []
        self._idle_lock = threading.Lock()
        self._closed = False
        self._migrated = False
        self._migrate_lock = threading.Lock()
        try:
            self._ensure_schema()
        except psycopg.OperationalError as exc:  # the server is not up (yet): the router starts anyway
            log.warning("job store (postgres): not reachable at startup, jobs answer 503 until it is: %s", exc)
        except psycopg.Error as exc:  # reachable but refusing (permissions, a broken schema): say so at once
            raise StoreUnavailable(f"the job store cannot be migrated: {type(exc).__name__}: {exc}") from exc

    # ------------------------------------------------------------ plumbing

    def _connect(self) -> psycopg.Connection[tuple[Any, ...]]:
        if self._closed:
            raise psycopg.OperationalError("the job store is closed")
        ms = str(int(self.timeout * 1000))
        conn = psycopg.connect(
            self.url, autocommit=True, application_name="headrace", connect_timeout=max(1, round(self.timeout)),
            keepalives=1, keepalives_idle=10, keepalives_interval=5, keepalives_count=3, tcp_user_timeout=ms,
        )  # fmt: skip
        conn.execute(
            "SELECT set_config('statement_timeout', %s, false), set_config('lock_timeout', %s, false),"
            " set_config('idle_in_transaction_session_timeout', %s, false)",
            (ms, ms, ms),
        )
        return conn

    def _take(self) -> tuple[psycopg.Connection[tuple[Any, ...]], bool]:
        """A connection, and whether it was idle in the pool (it may have been closed by the server since)."""
        with self._idle_lock:
            if self._closed:
                raise psycopg.OperationalError("the job store is closed")
            if self._idle:
                return self._idle.pop(), True
        return self._connect(), False

    def _give(self, conn: psycopg.Connection[tuple[Any, ...]]) -> None:
        healthy = not conn.broken and not conn.closed and conn.info.transaction_status == TransactionStatus.IDLE
        with self._idle_lock:
            if healthy and not self._closed:
                self._idle.append(conn)
                return
        conn.close()

    def _ensure_schema(self) -> None:
        with self._migrate_lock:
            if not self._migrated:
                self._transact(self._migrate, ())
                self._migrated = True

    def _call(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        """``fn(cursor, *args)`` in one transaction (in a worker thread)."""
        if not self._migrated:
            self._ensure_schema()
        return self._transact(fn, args)

    def _transact(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        while True:
            conn, reused = self._take()
            try:
                try:
                    conn.execute("BEGIN")
                except psycopg.OperationalError:
                    if reused:  # closed while idle (a server restart): nothing was done; another connection
                        continue
                    raise
                try:
                    result = fn(conn.cursor(), *args)
                except BaseException:
                    if not conn.broken:
                        conn.execute("ROLLBACK")
                    raise
                conn.execute("COMMIT")
                return result
            finally:
                self._give(conn)

    def _guard(self, call: Callable[..., T], *args: Any) -> T:
        try:
            return call(*args)
        except psycopg.Error as exc:
            log.error("job store (postgres): %s", exc)
            raise StoreUnavailable(f"the job store is unavailable: {type(exc).__name__}", retry_after=1.0) from exc

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await trio.to_thread.run_sync(self._guard, self._call, fn, args, limiter=self._limiter)

    def _now(self, cur: Cursor) -> float:
        """The database's clock (or the test's), read now: inside the caller's locks."""
        if self._fixed_clock is not None:
            return self._fixed_clock()
        before = time.time()
        row = cur.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
        assert row is not None
        now = float(row[0])
        self._offset = now - (before + time.time()) / 2
        return now

    def _migrate(self, cur: Cursor) -> None:
        cur.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATE_LOCK,))
        cur.execute("CREATE TABLE IF NOT EXISTS headrace_schema (version integer NOT NULL)")
        row = cur.execute("SELECT version FROM headrace_schema").fetchone()
        if row is None:
            cur.execute("INSERT INTO headrace_schema (version) VALUES (0)")
        version = 0 if row is None else int(row[0])
        if version > len(MIGRATIONS):
            log.warning("job store: schema version %d is newer than this router's %d (a newer router migrated it)",
                        version, len(MIGRATIONS))  # fmt: skip
        for i, script in enumerate(MIGRATIONS[version:], start=version):
            cur.execute(script.encode())  # several statements: no parameters
            cur.execute("UPDATE headrace_schema SET version = %s", (i + 1,))

    def schema_version(self) -> int:
        def read(cur: Cursor) -> int:
            row = cur.execute("SELECT version FROM headrace_schema").fetchone()
            return int(row[0]) if row is not None else 0

        return int(self._guard(self._call, read, ()))

    def close(self) -> None:
        with self._idle_lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    # ------------------------------------------------------------ jobs

    async def create(self, job: Job) -> Job:
        """Insert ``job``; returns once it is committed (durable)."""
        return await self._run(self._create, job)

    def _create(self, cur: Cursor, job: Job) -> Job:
        job = msgspec.structs.replace(job, created_at=self._now(cur))
        cur.execute(INSERT_JOB_PG, job_row(job))
        return job

    async def get(self, tenant: str, job_id: str) -> Job | None:
        """The job, if it is ``tenant``'s (another tenant's is None: a 404)."""
        return await self._run(self._get, tenant, job_id)

    def _get(self, cur: Cursor, tenant: str, job_id: str) -> Job | None:
        row = cur.execute(SELECT_JOBS + " WHERE id = %s AND tenant = %s", (job_id, tenant)).fetchone()
        return row_job(row) if row is not None else None

    async def list_jobs(self, tenant: str, *, after: str | None, limit: int) -> tuple[list[Job], bool]:
        """``tenant``'s jobs newest first, those older than job ``after``;
        and whether more follow. An ``after`` that is not theirs: KeyError."""
        return await self._run(self._list_jobs, tenant, after, limit)

    def _list_jobs(self, cur: Cursor, tenant: str, after: str | None, limit: int) -> tuple[list[Job], bool]:
        bound = 2**62
        if after is not None:
            row = cur.execute("SELECT seq FROM jobs WHERE id = %s AND tenant = %s", (after, tenant)).fetchone()
            if row is None:
                raise KeyError(after)
            bound = row[0]
        rows = cur.execute(
            SELECT_JOBS + " WHERE tenant = %s AND seq < %s AND batch_id IS NULL ORDER BY seq DESC LIMIT %s", (tenant, bound, limit + 1)
        ).fetchall()
        return [row_job(r) for r in rows[:limit]], len(rows) > limit

    async def claim(self, *, slots: int, per_tenant: int, owner: str = "") -> list[Job]:
        """Start up to ``slots`` queued jobs that are due, highest priority
        then oldest first, none for a tenant already running ``per_tenant``
        (counted in the database: the cap holds across routers), leased to ``owner``."""
        return await self._run(self._claim, slots, per_tenant, owner)

    def _claim(self, cur: Cursor, slots: int, per_tenant: int, owner: str) -> list[Job]:
        cur.execute("SELECT pg_advisory_xact_lock(%s)", (CLAIM_LOCK,))
        running: dict[str, int] = dict(cur.execute("SELECT tenant, count(*) FROM jobs WHERE status = 'running' GROUP BY tenant").fetchall())
        now = self._now(cur)  # after the count's snapshot: later than any finish it saw
        rows = cur.execute(
            SELECT_JOBS + f" WHERE status = 'queued' AND not_before <= %s ORDER BY {_RANK}, seq LIMIT %s FOR UPDATE SKIP LOCKED",
            (now, slots * 64),
        ).fetchall()
        claimed: list[Job] = []
        for row in rows:
            job = row_job(row)
            if len(claimed) >= slots or running.get(job.tenant, 0) >= per_tenant:
                continue
            running[job.tenant] = running.get(job.tenant, 0) + 1
            fields = {"started_at": now, "attempts": job.attempts + 1, "owner": owner, "heartbeat": now}
            claimed.append(self._write(cur, job, JobEvent.START, fields, now))
        return claimed

    async def apply(self, job_id: str, event: JobEvent, *, owner: str | None = None, **fields: Any) -> Job:
        """Apply ``event`` to the job (and set ``fields``) in one
        transaction; :class:`InvalidTransition` if its status forbids it,
        :class:`LeaseLost` if ``owner`` is given and no longer holds it,
        KeyError if there is no such job."""
        return await self._run(self._apply, job_id, event, owner, fields)

    def _apply(self, cur: Cursor, job_id: str, event: JobEvent, owner: str | None, fields: dict[str, Any]) -> Job:
        row = cur.execute(SELECT_JOBS + " WHERE id = %s FOR UPDATE", (job_id,)).fetchone()
        if row is None:
            raise KeyError(job_id)
        job = row_job(row)
        if owner is not None and job.owner != owner:
            raise LeaseLost(job.status, event)
        return self._write(cur, job, event, fields, None)

    def _write(self, cur: Cursor, job: Job, event: JobEvent, fields: dict[str, Any], now: float | None) -> Job:
        status = transition(job.status, event)
        unknown = set(fields) - _WRITABLE
        if unknown:
            raise ValueError(f"not job fields: {sorted(unknown)}")
        if status in TERMINAL:
            fields = {"finished_at": self._now(cur) if now is None else now, **fields}
        fields["status"] = status.value
        sets = ", ".join(f"{name} = %s" for name in fields)
        cur.execute(f"UPDATE jobs SET {sets} WHERE id = %s", (*fields.values(), job.id))
        fields["status"] = status
        return msgspec.structs.replace(job, **fields)

    async def cancel(self, tenant: str, job_id: str) -> tuple[JobStatus, Job] | None:
        """Cancel ``tenant``'s job: its status before and the job after (None:
        no such job of theirs; :class:`InvalidTransition`: it had finished)."""
        return await self._run(self._cancel, tenant, job_id)

    def _cancel(self, cur: Cursor, tenant: str, job_id: str) -> tuple[JobStatus, Job] | None:
        row = cur.execute(SELECT_JOBS + " WHERE id = %s AND tenant = %s FOR UPDATE", (job_id, tenant)).fetchone()
        if row is None:
            return None
        job = row_job(row)
        return job.status, self._write(cur, job, JobEvent.CANCEL, {}, None)

    async def heartbeat(self, owner: str, job_ids: Sequence[str]) -> set[str]:
        """Renew ``owner``'s lease on ``job_ids``; those among them that are
        no longer its running jobs (cancelled elsewhere, or requeued after a
        lapse): their tasks should stop. Only the listed jobs are renewed, so
        a claim whose answer was lost (the connection broke at COMMIT) lapses
        and is requeued instead of being kept alive by a runner that never
        heard of it."""
        return await self._run(self._heartbeat, owner, list(job_ids))

    def _heartbeat(self, cur: Cursor, owner: str, job_ids: list[str]) -> set[str]:
        now = self._now(cur)
        rows = cur.execute(
            "UPDATE jobs SET heartbeat = %s WHERE owner = %s AND status = 'running' AND id = ANY(%s) RETURNING id",
            (now, owner, job_ids),
        ).fetchall()
        return set(job_ids) - {r[0] for r in rows}

    async def requeue_stale(self, lease: float) -> int:
        """Every job ``running`` whose runner's heartbeat is ``lease``
        seconds old (that runner died) back to ``queued``. Also deletes up
        to 1000 idempotency keys past their TTL (they answer as new keys
        anyway), so a long-lived database does not keep every key ever used."""
        return await self._run(self._requeue_stale, lease)

    def _requeue_stale(self, cur: Cursor, lease: float) -> int:
        now = self._now(cur)
        cur.execute(
            "DELETE FROM idempotency WHERE ctid IN (SELECT ctid FROM idempotency WHERE created_at <= %s LIMIT 1000)",
            (now - self.ttl,),
        )
        stale = now - lease
        rows = cur.execute(
            SELECT_JOBS + " WHERE status = 'running' AND (heartbeat IS NULL OR heartbeat <= %s) FOR UPDATE SKIP LOCKED", (stale,)
        ).fetchall()
        for row in rows:
            self._write(cur, row_job(row), JobEvent.REQUEUE, {"started_at": None, "owner": None, "heartbeat": None}, None)
        return len(rows)

    # ------------------------------------------------------------ idempotency

    async def reserve(self, tenant: str, key: str, digest: str) -> IdemResult:
        return await self._run(self._reserve, tenant, key, digest)

    def _reserve(self, cur: Cursor, tenant: str, key: str, digest: str) -> IdemResult:
        # Two routers reserving one new key: no row to lock yet, so a lock on the key's hash.
        cur.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"idem:{len(tenant)}:{tenant}:{key}",))
        row = cur.execute(
            "SELECT digest, created_at, status, response FROM idempotency WHERE tenant = %s AND key = %s", (tenant, key)
        ).fetchone()
        now = self._now(cur)
        if row is not None:
            old_digest, created, status, response = row
            expired = now - created >= self.ttl or (status is None and now - created >= self.lease)
            if not expired:
                if old_digest != digest:
                    return IdemMismatch()
                return IdemBusy() if status is None else IdemReplay(status, bytes(response))
        cur.execute(
            "INSERT INTO idempotency (tenant, key, digest, created_at) VALUES (%s,%s,%s,%s) ON CONFLICT (tenant, key)"
            " DO UPDATE SET digest = EXCLUDED.digest, created_at = EXCLUDED.created_at, status = NULL, response = NULL, job_id = NULL",
            (tenant, key, digest, now),
        )
        return IdemReserved()

    async def complete_key(self, tenant: str, key: str, status: int, body: bytes, job_id: str | None) -> None:
        await self._run(self._complete_key, tenant, key, status, body, job_id)

    def _complete_key(self, cur: Cursor, tenant: str, key: str, status: int, body: bytes, job_id: str | None) -> None:
        cur.execute(
            "UPDATE idempotency SET status = %s, response = %s, job_id = %s WHERE tenant = %s AND key = %s",
            (status, body, job_id, tenant, key),
        )

    async def release_key(self, tenant: str, key: str) -> None:
        """Forget a reservation whose request failed (a retry may do the work)."""
        await self._run(self._release_key, tenant, key)

    def _release_key(self, cur: Cursor, tenant: str, key: str) -> None:
        cur.execute("DELETE FROM idempotency WHERE tenant = %s AND key = %s AND status IS NULL", (tenant, key))

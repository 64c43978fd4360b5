"""Durable job state: the job lifecycle as a transition table, the
:class:`JobStore` interface, and its embedded SQLite implementation.

::

                 start            complete
    queued ──────────────> running ─────────> completed
      │  ^                  │  │   fail
      │  └──── requeue ─────┘  └────────────> failed
      │   (crash recovery,     │
      │    retryable error)    │ cancel
      └──────── cancel ────────┴────────────> cancelled

Every status change goes through :func:`transition` inside the same
``BEGIN IMMEDIATE`` transaction that writes it, so two writers racing (a
``DELETE`` and the runner finishing the same job) serialise, and the second
sees the first's status and gets :class:`InvalidTransition` instead of
overwriting it.

SQLite runs in WAL mode with ``synchronous=FULL``: a job is on disk once its
commit returns, and the router acknowledges it (202) only after that.
Blocking calls run in ``trio.to_thread.run_sync`` behind a
``CapacityLimiter(1)`` over one connection (``check_same_thread=False``):
one statement at a time, never on the trio thread; ``busy_timeout`` covers a
second process (another router opening the same file after a crash).

Idempotency keys (``Idempotency-Key`` on a POST) are reserved first, in
their own transaction, and completed with the stored response afterwards::

    reserve(tenant, key, digest) ── new ──> do the work ── complete(response)
                                  ├ stored response (same digest) -> replay it
                                  ├ pending (same digest) ──────────> 409
                                  └ other digest ───────────────────> 422

A pending reservation older than ``lease`` seconds (its request died with
the process) is taken over by the next request with that key.

Several router processes (``[server] workers``) share one file, so a running
job is leased: ``claim`` names the runner (``owner``) and stamps
``heartbeat``, the runner renews it (``heartbeat()``, which also reports the
jobs it holds that another process cancelled), and ``requeue_stale`` puts
back only jobs whose runner stopped renewing. A runner that lost its lease
cannot write an outcome (:class:`LeaseLost`). The per-tenant cap is counted
in the file, so it holds across processes.

Errors: ``sqlite3`` exceptions do not leave this module; they become
:class:`StoreUnavailable` (503), so a full disk or a locked file is a clear
server error, never an untranslated 500.
"""

from __future__ import annotations

import enum
import logging
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import msgspec
import trio

from backends.errors import UpstreamError

__all__ = [
    "INSERT_JOB",
    "SELECT_JOBS",
    "TRANSITIONS",
    "IdemBusy",
    "IdemMismatch",
    "IdemReplay",
    "IdemReserved",
    "IdemResult",
    "InvalidTransition",
    "Job",
    "JobEvent",
    "JobStatus",
    "JobStore",
    "LeaseLost",
    "SQLiteStore",
    "StoreUnavailable",
    "job_row",
    "new_job_id",
    "row_job",
    "transition",
]

T = TypeVar("T")
log = logging.getLogger(__name__)


class JobStatus(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class JobEvent(enum.Enum):
    START = "start"
    COMPLETE = "complete"
    FAIL = "fail"
    CANCEL = "cancel"
    REQUEUE = "requeue"


S, E = JobStatus, JobEvent
TRANSITIONS: dict[tuple[JobStatus, JobEvent], JobStatus] = {
    (S.QUEUED, E.START): S.RUNNING,
    (S.QUEUED, E.CANCEL): S.CANCELLED,
    (S.RUNNING, E.COMPLETE): S.COMPLETED,
    (S.RUNNING, E.FAIL): S.FAILED,
    (S.RUNNING, E.CANCEL): S.CANCELLED,
    (S.RUNNING, E.REQUEUE): S.QUEUED,
}
TERMINAL = frozenset({S.COMPLETED, S.FAILED, S.CANCELLED})


class StoreUnavailable(UpstreamError):
    """503: the job store could not be read or written (disk full, file locked too long)."""

    status = 503
    code = "store_unavailable"


class InvalidTransition(Exception):
    """``event`` is not allowed in ``status`` (the table has no such pair)."""

    def __init__(self, status: JobStatus, event: JobEvent) -> None:
        super().__init__(f"a {status.value} job cannot {event.value}")
        self.status, self.event = status, event


class LeaseLost(InvalidTransition):
    """The runner's lease on the job lapsed (another runner requeued it)."""

    def __str__(self) -> str:
        return f"the lease on this {self.status.value} job was lost; cannot {self.event.value}"


def transition(status: JobStatus, event: JobEvent) -> JobStatus:
    try:
        return TRANSITIONS[(status, event)]
    except KeyError:
        raise InvalidTransition(status, event) from None


def new_job_id() -> str:
    return "job_" + secrets.token_hex(12)


class Job(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    tenant: str
    kind: str  # frontend.wire.Kind: completion | chat | native
    body: bytes  # the request body the job runs (JSON)
    status: JobStatus = JobStatus.QUEUED
    priority: str = "batch"
    metadata: dict[str, Any] = {}
    result: bytes | None = None  # JSON, when completed
    error: bytes | None = None  # JSON OpenAI error body, when failed
    attempts: int = 0  # runs started (a run cut short by a crash counts)
    errors: int = 0  # runs that ended in an error (what max_attempts limits)
    created_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    not_before: float = 0.0  # a retried job waits until then
    owner: str | None = None  # the runner that claimed it (while running)
    heartbeat: float | None = None  # when that runner last said it was alive
    batch_id: str | None = None  # an item of this batch (router/batch_store.py) ...
    line: int | None = None  # ... from this line of its input file (from 1)


class IdemReserved(msgspec.Struct, frozen=True):
    """The key is new (or its lease ran out): this request does the work."""


class IdemReplay(msgspec.Struct, frozen=True):
    """The key's first request finished: replay its response."""

    status: int
    body: bytes


class IdemBusy(msgspec.Struct, frozen=True):
    """The first request with this key is still in flight (409)."""


class IdemMismatch(msgspec.Struct, frozen=True):
    """The key was used with another body (422)."""


IdemResult = IdemReserved | IdemReplay | IdemBusy | IdemMismatch


class JobStore(Protocol):
    """What the jobs API and runner need from durable storage."""

    clock: Callable[[], float]  # wall time: created/started/finished, not_before, key expiry

    async def create(self, job: Job) -> Job: ...
    async def get(self, tenant: str, job_id: str) -> Job | None: ...
    async def list_jobs(self, tenant: str, *, after: str | None, limit: int) -> tuple[list[Job], bool]: ...
    async def claim(self, *, slots: int, per_tenant: int, owner: str = "") -> list[Job]: ...
    async def heartbeat(self, owner: str, job_ids: Sequence[str]) -> set[str]: ...
    async def requeue_stale(self, lease: float) -> int: ...
    async def apply(self, job_id: str, event: JobEvent, *, owner: str | None = None, **fields: Any) -> Job: ...
    async def cancel(self, tenant: str, job_id: str) -> tuple[JobStatus, Job] | None: ...
    async def reserve(self, tenant: str, key: str, digest: str) -> IdemResult: ...
    async def complete_key(self, tenant: str, key: str, status: int, body: bytes, job_id: str | None) -> None: ...
    async def release_key(self, tenant: str, key: str) -> None: ...
    def close(self) -> None: ...


# Each entry takes the schema from version i to i + 1; ``PRAGMA user_version`` says where a file is.
MIGRATIONS: Sequence[str] = (
    """
    CREATE TABLE jobs (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        tenant TEXT NOT NULL,
        kind TEXT NOT NULL,
        body BLOB NOT NULL,
        status TEXT NOT NULL,
        priority TEXT NOT NULL,
        metadata BLOB NOT NULL,
        result BLOB,
        error BLOB,
        attempts INTEGER NOT NULL DEFAULT 0,
        created_at REAL NOT NULL,
        started_at REAL,
        finished_at REAL,
        not_before REAL NOT NULL DEFAULT 0
    );
    CREATE INDEX jobs_tenant ON jobs (tenant, seq);
    CREATE INDEX jobs_status ON jobs (status, seq);
    CREATE TABLE idempotency (
        tenant TEXT NOT NULL,
        key TEXT NOT NULL,
        digest TEXT NOT NULL,
        created_at REAL NOT NULL,
        status INTEGER,
        response BLOB,
        job_id TEXT,
        PRIMARY KEY (tenant, key)
    );
    """,
    # 2: runner leases. Several router processes (``[server] workers``) share one
    # file: a running job names its runner, which renews ``heartbeat``; only a
    # job whose heartbeat went stale (its runner died) is requeued.
    """
    ALTER TABLE jobs ADD COLUMN owner TEXT;
    ALTER TABLE jobs ADD COLUMN heartbeat REAL;
    """,
    # 3: runs that ended in an error, apart from ``attempts`` (runs started), so a
    # run cut short by a crash does not use up the job's retries.
    """
    ALTER TABLE jobs ADD COLUMN errors INTEGER NOT NULL DEFAULT 0;
    """,
    # 4: files and batches (router/batch_store.py). A batch's items are jobs
    # (``batch_id``, ``line``: the input file's line, from 1), run by the same
    # runner; ``(batch_id, line)`` is unique, so a validation cut short by a
    # crash is redone without doubling an item. Plain SQL for the PostgreSQL port.
    """
    ALTER TABLE jobs ADD COLUMN batch_id TEXT;
    ALTER TABLE jobs ADD COLUMN line INTEGER;
    CREATE UNIQUE INDEX jobs_batch_line ON jobs (batch_id, line);
    CREATE TABLE files (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        tenant TEXT NOT NULL,
        purpose TEXT NOT NULL,
        filename TEXT NOT NULL,
        bytes INTEGER NOT NULL DEFAULT 0,
        lines INTEGER NOT NULL DEFAULT 0,
        status TEXT NOT NULL,
        created_at REAL NOT NULL,
        batch_id TEXT
    );
    CREATE INDEX files_tenant ON files (tenant, seq);
    CREATE TABLE batches (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        tenant TEXT NOT NULL,
        endpoint TEXT NOT NULL,
        input_file_id TEXT NOT NULL,
        completion_window TEXT NOT NULL,
        status TEXT NOT NULL,
        metadata BLOB NOT NULL,
        output_file_id TEXT NOT NULL,
        error_file_id TEXT NOT NULL,
        total INTEGER NOT NULL DEFAULT 0,
        errors BLOB,
        created_at REAL NOT NULL,
        expires_at REAL NOT NULL,
        in_progress_at REAL,
        finalizing_at REAL,
        completed_at REAL,
        failed_at REAL,
        cancelling_at REAL,
        cancelled_at REAL,
        expired_at REAL
    );
    CREATE INDEX batches_tenant ON batches (tenant, seq);
    CREATE INDEX batches_status ON batches (status);
    """,
)

_COLUMNS = ("id", "tenant", "kind", "body", "status", "priority", "metadata", "result", "error", "attempts",
            "created_at", "started_at", "finished_at", "not_before", "owner", "heartbeat", "errors", "batch_id", "line")  # fmt: skip
SELECT_JOBS = "SELECT " + ", ".join(_COLUMNS) + " FROM jobs"
_RANK = "CASE priority WHEN 'interactive' THEN 0 WHEN 'default' THEN 1 ELSE 2 END"


INSERT_JOB = ("INSERT INTO jobs (id, tenant, kind, body, status, priority, metadata, created_at, result, error,"
              " batch_id, line, finished_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)")  # fmt: skip


def job_row(job: Job) -> tuple[Any, ...]:
    """The values of :data:`INSERT_JOB` for ``job``."""
    return (job.id, job.tenant, job.kind, job.body, job.status.value, job.priority, msgspec.json.encode(job.metadata),
            job.created_at, job.result, job.error, job.batch_id, job.line, job.finished_at)  # fmt: skip


def row_job(row: tuple[Any, ...]) -> Job:
    fields = dict(zip(_COLUMNS, row, strict=True))
    fields["status"] = JobStatus(fields["status"])
    fields["metadata"] = msgspec.json.decode(fields["metadata"])
    return Job(**fields)


class SQLiteStore:
    """:class:`JobStore` in one SQLite file. ``clock`` is wall time (seconds)."""

    def __init__(
        self,
        path: str | Path,
        *,
        clock: Callable[[], float] = time.time,
        idempotency_ttl: float = 24 * 3600,
        lease: float = 60.0,
        busy_timeout_ms: int = 5000,
    ) -> None:
        """Opens (creating) the file and migrates it: blocking, done once at startup."""
        self.path = str(path)
        self.clock = clock
        self.ttl = idempotency_ttl
        self.lease = lease
        self._lock = threading.Lock()
        self._limiter = trio.CapacityLimiter(1)
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        self._db.execute("PRAGMA journal_mode = WAL")
        self._db.execute("PRAGMA synchronous = FULL")
        self._migrate()

    # ------------------------------------------------------------ plumbing

    def _migrate(self) -> None:
        with self._tx() as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            for i, script in enumerate(MIGRATIONS[version:], start=version):
                for statement in filter(str.strip, script.split(";")):
                    db.execute(statement)
                db.execute(f"PRAGMA user_version = {i + 1}")

    def _tx(self) -> _Transaction:
        return _Transaction(self._db, self._lock)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        except sqlite3.Error as exc:
            log.error("job store %s: %s", self.path, exc)
            raise StoreUnavailable(f"the job store is unavailable: {type(exc).__name__}", retry_after=1.0) from exc

    def schema_version(self) -> int:
        with self._lock:
            return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------ jobs

    async def create(self, job: Job) -> Job:
        """Insert ``job``; returns once it is committed (durable)."""
        return await self._run(self._create, job)

    def _create(self, job: Job) -> Job:
        job = msgspec.structs.replace(job, created_at=self.clock())
        with self._tx() as db:
            db.execute(INSERT_JOB, job_row(job))
        return job

    async def get(self, tenant: str, job_id: str) -> Job | None:
        """The job, if it is ``tenant``'s (another tenant's is None: a 404)."""
        return await self._run(self._get, tenant, job_id)

    def _get(self, tenant: str, job_id: str) -> Job | None:
        with self._lock:
            row = self._db.execute(SELECT_JOBS + " WHERE id = ? AND tenant = ?", (job_id, tenant)).fetchone()
        return row_job(row) if row is not None else None

    async def list_jobs(self, tenant: str, *, after: str | None, limit: int) -> tuple[list[Job], bool]:
        """``tenant``'s jobs newest first, those older than job ``after``;
        and whether more follow. An ``after`` that is not theirs: KeyError."""
        return await self._run(self._list_jobs, tenant, after, limit)

    def _list_jobs(self, tenant: str, after: str | None, limit: int) -> tuple[list[Job], bool]:
        with self._lock:
            bound = 2**62
            if after is not None:
                row = self._db.execute("SELECT seq FROM jobs WHERE id = ? AND tenant = ?", (after, tenant)).fetchone()
                if row is None:
                    raise KeyError(after)
                bound = row[0]
            rows = self._db.execute(
                SELECT_JOBS + " WHERE tenant = ? AND seq < ? AND batch_id IS NULL ORDER BY seq DESC LIMIT ?",
                (tenant, bound, limit + 1),
            ).fetchall()
        return [row_job(r) for r in rows[:limit]], len(rows) > limit

    async def claim(self, *, slots: int, per_tenant: int, owner: str = "") -> list[Job]:
        """Start up to ``slots`` queued jobs that are due, highest priority
        then oldest first, none for a tenant already running ``per_tenant``
        (counted in the file: the cap holds across router processes),
        leased to runner ``owner``."""
        return await self._run(self._claim, slots, per_tenant, owner)

    def _claim(self, slots: int, per_tenant: int, owner: str) -> list[Job]:
        claimed: list[Job] = []
        with self._tx() as db:
            # The clock is read inside the write lock: a claim that waited for
            # another process's commit (a job finishing) starts after it.
            now = self.clock()
            running = dict(db.execute("SELECT tenant, count(*) FROM jobs WHERE status = 'running' GROUP BY tenant").fetchall())
            rows = db.execute(
                SELECT_JOBS + f" WHERE status = 'queued' AND not_before <= ? ORDER BY {_RANK}, seq LIMIT ?", (now, slots * 64)
            ).fetchall()
            for row in rows:
                job = row_job(row)
                if len(claimed) >= slots or running.get(job.tenant, 0) >= per_tenant:
                    continue
                running[job.tenant] = running.get(job.tenant, 0) + 1
                claimed.append(self._write(db, job, JobEvent.START, {"started_at": now, "attempts": job.attempts + 1, "owner": owner, "heartbeat": now}))
        return claimed

    async def apply(self, job_id: str, event: JobEvent, *, owner: str | None = None, **fields: Any) -> Job:
        """Apply ``event`` to the job (and set ``fields``) in one
        transaction; :class:`InvalidTransition` if its status forbids it,
        :class:`LeaseLost` if ``owner`` is given and no longer holds it,
        KeyError if there is no such job."""
        return await self._run(self._apply, job_id, event, owner, fields)

    def _apply(self, job_id: str, event: JobEvent, owner: str | None, fields: dict[str, Any]) -> Job:
        with self._tx() as db:
            row = db.execute(SELECT_JOBS + " WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                raise KeyError(job_id)
            job = row_job(row)
            if owner is not None and job.owner != owner:
                raise LeaseLost(job.status, event)
            return self._write(db, job, event, fields)

    def _write(self, db: sqlite3.Connection, job: Job, event: JobEvent, fields: dict[str, Any]) -> Job:
        status = transition(job.status, event)
        if status in TERMINAL:
            fields = {"finished_at": self.clock(), **fields}
        fields["status"] = status.value
        sets = ", ".join(f"{name} = ?" for name in fields)
        db.execute(f"UPDATE jobs SET {sets} WHERE id = ?", (*fields.values(), job.id))
        fields["status"] = status
        return msgspec.structs.replace(job, **fields)

    async def cancel(self, tenant: str, job_id: str) -> tuple[JobStatus, Job] | None:
        """Cancel ``tenant``'s job: its status before and the job after (None:
        no such job of theirs; :class:`InvalidTransition`: it had finished).
        One transaction, so the status before is the one the cancel replaced."""
        return await self._run(self._cancel, tenant, job_id)

    def _cancel(self, tenant: str, job_id: str) -> tuple[JobStatus, Job] | None:
        with self._tx() as db:
            row = db.execute(SELECT_JOBS + " WHERE id = ? AND tenant = ?", (job_id, tenant)).fetchone()
            if row is None:
                return None
            job = row_job(row)
            return job.status, self._write(db, job, JobEvent.CANCEL, {})

    async def heartbeat(self, owner: str, job_ids: Sequence[str]) -> set[str]:
        """Renew ``owner``'s lease on its running jobs; the ids among
        ``job_ids`` that are no longer its running jobs (cancelled by another
        process, or requeued after a lapse): their tasks should stop."""
        return await self._run(self._heartbeat, owner, list(job_ids))

    def _heartbeat(self, owner: str, job_ids: list[str]) -> set[str]:
        now = self.clock()
        with self._tx() as db:
            db.execute("UPDATE jobs SET heartbeat = ? WHERE owner = ? AND status = 'running'", (now, owner))
            mine = {r[0] for r in db.execute("SELECT id FROM jobs WHERE owner = ? AND status = 'running'", (owner,))}
        return set(job_ids) - mine

    async def requeue_stale(self, lease: float) -> int:
        """Every job ``running`` whose runner's heartbeat is ``lease``
        seconds old (that runner died) back to ``queued``."""
        return await self._run(self._requeue_stale, lease)

    def _requeue_stale(self, lease: float) -> int:
        stale = self.clock() - lease
        with self._tx() as db:
            rows = db.execute(SELECT_JOBS + " WHERE status = 'running' AND (heartbeat IS NULL OR heartbeat <= ?)", (stale,)).fetchall()
            for row in rows:
                self._write(db, row_job(row), JobEvent.REQUEUE, {"started_at": None, "owner": None, "heartbeat": None})
        return len(rows)

    # ------------------------------------------------------------ idempotency

    async def reserve(self, tenant: str, key: str, digest: str) -> IdemResult:
        return await self._run(self._reserve, tenant, key, digest)

    def _reserve(self, tenant: str, key: str, digest: str) -> IdemResult:
        now = self.clock()
        with self._tx() as db:
            row = db.execute(
                "SELECT digest, created_at, status, response FROM idempotency WHERE tenant = ? AND key = ?", (tenant, key)
            ).fetchone()
            if row is not None:
                old_digest, created, status, response = row
                expired = now - created >= self.ttl or (status is None and now - created >= self.lease)
                if not expired:
                    if old_digest != digest:
                        return IdemMismatch()
                    return IdemBusy() if status is None else IdemReplay(status, response)
            db.execute(
                "INSERT OR REPLACE INTO idempotency (tenant, key, digest, created_at) VALUES (?,?,?,?)",
                (tenant, key, digest, now),
            )
        return IdemReserved()

    async def complete_key(self, tenant: str, key: str, status: int, body: bytes, job_id: str | None) -> None:
        await self._run(self._complete_key, tenant, key, status, body, job_id)

    def _complete_key(self, tenant: str, key: str, status: int, body: bytes, job_id: str | None) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE idempotency SET status = ?, response = ?, job_id = ? WHERE tenant = ? AND key = ?",
                (status, body, job_id, tenant, key),
            )

    async def release_key(self, tenant: str, key: str) -> None:
        """Forget a reservation whose request failed (a retry may do the work)."""
        await self._run(self._release_key, tenant, key)

    def _release_key(self, tenant: str, key: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM idempotency WHERE tenant = ? AND key = ? AND status IS NULL", (tenant, key))


class _Transaction:
    """``BEGIN IMMEDIATE`` (the write lock up front, so a read-then-write
    never deadlocks with another writer) ... ``COMMIT``, or ``ROLLBACK`` on
    an exception; under the store's thread lock."""

    def __init__(self, db: sqlite3.Connection, lock: threading.Lock) -> None:
        self.db, self.lock = db, lock

    def __enter__(self) -> sqlite3.Connection:
        self.lock.acquire()
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except BaseException:
            self.lock.release()
            raise
        return self.db

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        try:
            self.db.execute("COMMIT" if exc is None else "ROLLBACK")
        finally:
            self.lock.release()

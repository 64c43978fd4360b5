"""Durable files and batches: the batch lifecycle as a transition table, the
:class:`BatchStore` interface, and its SQLite implementation over the job
store's file and connection (:class:`~router.store.SQLiteStore`).

::

                validated            finalize              complete
    validating ───────────> in_progress ────────> finalizing ────────> completed
      │  │ fail                │  │ expire
      │  └──> failed           │  └──────────────────────────────────> expired
      │ cancel                 │ cancel
      └──────────> cancelling <┘ ── stop ──> cancelled

A batch's items are jobs (``jobs.batch_id``, ``jobs.line``) run by the
:class:`~router.jobs.JobRunner` with every other job: the same leases, the
same "one outcome per job" transition table, so an item cut short by a crash
runs again but is completed at most once. Items are added with
``INSERT OR IGNORE`` on the unique ``(batch_id, line)``: a validation cut
short by a crash is simply redone. The schema is migration 4 of
:data:`router.store.MIGRATIONS`; every statement here is plain SQL (``?``
placeholders) so a PostgreSQL store can take it over.
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec

from router.store import INSERT_JOB, SELECT_JOBS, Job, JobStatus, SQLiteStore, job_row, row_job

__all__ = [
    "BATCH_TRANSITIONS",
    "Batch",
    "BatchEvent",
    "BatchStatus",
    "BatchStore",
    "FileRecord",
    "InvalidBatchTransition",
    "SQLiteBatchStore",
    "batch_transition",
    "new_batch_id",
    "new_file_id",
]


class BatchStatus(enum.Enum):
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


class BatchEvent(enum.Enum):
    VALIDATED = "validated"
    FAIL = "fail"
    FINALIZE = "finalize"
    COMPLETE = "complete"
    CANCEL = "cancel"
    STOP = "stop"  # a cancelling batch's items are all stopped and its files written
    EXPIRE = "expire"


B, V = BatchStatus, BatchEvent
BATCH_TRANSITIONS: dict[tuple[BatchStatus, BatchEvent], BatchStatus] = {
    (B.VALIDATING, V.VALIDATED): B.IN_PROGRESS,
    (B.VALIDATING, V.FAIL): B.FAILED,
    (B.VALIDATING, V.CANCEL): B.CANCELLING,
    (B.VALIDATING, V.EXPIRE): B.EXPIRED,
    (B.IN_PROGRESS, V.FINALIZE): B.FINALIZING,
    (B.IN_PROGRESS, V.CANCEL): B.CANCELLING,
    (B.IN_PROGRESS, V.EXPIRE): B.EXPIRED,
    (B.FINALIZING, V.COMPLETE): B.COMPLETED,
    (B.CANCELLING, V.STOP): B.CANCELLED,
}
BATCH_TERMINAL = frozenset({B.COMPLETED, B.FAILED, B.CANCELLED, B.EXPIRED})
# The timestamp each status sets when a batch enters it.
STAMP = {B.IN_PROGRESS: "in_progress_at", B.FINALIZING: "finalizing_at", B.COMPLETED: "completed_at",
         B.FAILED: "failed_at", B.CANCELLING: "cancelling_at", B.CANCELLED: "cancelled_at", B.EXPIRED: "expired_at"}  # fmt: skip


class InvalidBatchTransition(Exception):
    def __init__(self, status: BatchStatus, event: BatchEvent) -> None:
        super().__init__(f"a {status.value} batch cannot {event.value}")
        self.status, self.event = status, event


def batch_transition(status: BatchStatus, event: BatchEvent) -> BatchStatus:
    try:
        return BATCH_TRANSITIONS[(status, event)]
    except KeyError:
        raise InvalidBatchTransition(status, event) from None


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


class FileRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A file's row; its bytes live at ``<data dir>/files/<id>.jsonl`` once ``status`` is processed."""

    id: str
    tenant: str
    purpose: str  # batch (uploaded) | batch_output | batch_error (written by a batch)
    filename: str
    bytes: int = 0
    lines: int = 0
    status: str = "processed"  # processed: on disk; pending: a batch's output not yet written
    created_at: float = 0.0
    batch_id: str | None = None


class Batch(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    output_file_id: str
    error_file_id: str
    status: BatchStatus = BatchStatus.VALIDATING
    metadata: dict[str, Any] = {}
    total: int = 0
    errors: bytes | None = None  # JSON list of {code, message, line}: why validation failed
    created_at: float = 0.0
    expires_at: float = 0.0
    in_progress_at: float | None = None
    finalizing_at: float | None = None
    completed_at: float | None = None
    failed_at: float | None = None
    cancelling_at: float | None = None
    cancelled_at: float | None = None
    expired_at: float | None = None


class BatchStore(Protocol):
    """What the files and batches APIs and the batch runner need beyond :class:`~router.store.JobStore`."""

    clock: Callable[[], float]  # wall time, the job store's

    async def create_file(self, record: FileRecord) -> FileRecord: ...
    async def get_file(self, tenant: str, file_id: str) -> FileRecord | None: ...
    async def set_file(self, file_id: str, *, bytes: int, lines: int, status: str) -> None: ...
    async def create_batch(self, batch: Batch) -> Batch: ...
    async def get_batch(self, tenant: str, batch_id: str) -> Batch | None: ...
    async def list_batches(self, tenant: str, *, after: str | None, limit: int) -> tuple[list[Batch], bool]: ...
    async def active_batches(self) -> list[Batch]: ...
    async def move_batch(self, batch_id: str, event: BatchEvent, **fields: Any) -> Batch: ...
    async def add_items(self, items: Sequence[Job]) -> None: ...
    async def item_counts(self, batch_id: str) -> dict[JobStatus, int]: ...
    async def items(self, batch_id: str, *, after_line: int, limit: int) -> list[Job]: ...
    async def cancel_items(self, batch_id: str) -> list[str]: ...


_FILE_COLUMNS = ("id", "tenant", "purpose", "filename", "bytes", "lines", "status", "created_at", "batch_id")
_SELECT_FILE = "SELECT " + ", ".join(_FILE_COLUMNS) + " FROM files"
_INSERT_FILE = f"INSERT INTO files ({', '.join(_FILE_COLUMNS)}) VALUES ({', '.join('?' * len(_FILE_COLUMNS))})"
_BATCH_COLUMNS = tuple(f for f in Batch.__struct_fields__)
_SELECT_BATCH = "SELECT " + ", ".join(_BATCH_COLUMNS) + " FROM batches"
_INSERT_BATCH = f"INSERT INTO batches ({', '.join(_BATCH_COLUMNS)}) VALUES ({', '.join('?' * len(_BATCH_COLUMNS))})"
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


def _row_file(row: tuple[Any, ...]) -> FileRecord:
    return FileRecord(**dict(zip(_FILE_COLUMNS, row, strict=True)))


def _row_batch(row: tuple[Any, ...]) -> Batch:
    fields = dict(zip(_BATCH_COLUMNS, row, strict=True))
    fields["status"] = BatchStatus(fields["status"])
    fields["metadata"] = msgspec.json.decode(fields["metadata"])
    return Batch(**fields)


def _batch_values(batch: Batch) -> tuple[Any, ...]:
    values = [getattr(batch, f) for f in _BATCH_COLUMNS]
    values[_BATCH_COLUMNS.index("status")] = batch.status.value
    values[_BATCH_COLUMNS.index("metadata")] = msgspec.json.encode(batch.metadata)
    return tuple(values)


class SQLiteBatchStore:
    """:class:`BatchStore` in the job store's SQLite file, through its
    connection, lock and thread limiter (one statement at a time)."""

    def __init__(self, store: SQLiteStore) -> None:
        self.store = store
        self.clock = store.clock

    # ------------------------------------------------------------ files

    async def create_file(self, record: FileRecord) -> FileRecord:
        return await self.store._run(self._create_file, record)

    def _create_file(self, record: FileRecord) -> FileRecord:
        record = msgspec.structs.replace(record, created_at=self.clock())
        with self.store._tx() as db:
            db.execute(_INSERT_FILE, tuple(getattr(record, f) for f in _FILE_COLUMNS))
        return record

    async def get_file(self, tenant: str, file_id: str) -> FileRecord | None:
        """The file, if it is ``tenant``'s (another tenant's is None: a 404)."""
        return await self.store._run(self._get_file, tenant, file_id)

    def _get_file(self, tenant: str, file_id: str) -> FileRecord | None:
        with self.store._lock:
            row = self.store._db.execute(_SELECT_FILE + " WHERE id = ? AND tenant = ?", (file_id, tenant)).fetchone()
        return _row_file(row) if row is not None else None

    async def set_file(self, file_id: str, *, bytes: int, lines: int, status: str) -> None:
        await self.store._run(self._set_file, file_id, bytes, lines, status)

    def _set_file(self, file_id: str, size: int, lines: int, status: str) -> None:
        with self.store._tx() as db:
            db.execute("UPDATE files SET bytes = ?, lines = ?, status = ? WHERE id = ?", (size, lines, status, file_id))

    # ------------------------------------------------------------ batches

    async def create_batch(self, batch: Batch) -> Batch:
        """Insert ``batch`` (created now) and its two output files (pending), in one transaction."""
        return await self.store._run(self._create_batch, batch)

    def _create_batch(self, batch: Batch) -> Batch:
        now = self.clock()
        batch = msgspec.structs.replace(batch, created_at=now, expires_at=now + batch.expires_at)
        with self.store._tx() as db:
            db.execute(_INSERT_BATCH, _batch_values(batch))
            for file_id, purpose in ((batch.output_file_id, "batch_output"), (batch.error_file_id, "batch_error")):
                name = f"{batch.id}_{purpose.removeprefix('batch_')}.jsonl"
                db.execute(_INSERT_FILE, (file_id, batch.tenant, purpose, name, 0, 0, "pending", now, batch.id))
        return batch

    async def get_batch(self, tenant: str, batch_id: str) -> Batch | None:
        return await self.store._run(self._get_batch, tenant, batch_id)

    def _get_batch(self, tenant: str, batch_id: str) -> Batch | None:
        with self.store._lock:
            row = self.store._db.execute(_SELECT_BATCH + " WHERE id = ? AND tenant = ?", (batch_id, tenant)).fetchone()
        return _row_batch(row) if row is not None else None

    async def list_batches(self, tenant: str, *, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        """``tenant``'s batches newest first, older than batch ``after``
        (KeyError if that is not theirs); and whether more follow."""
        return await self.store._run(self._list_batches, tenant, after, limit)

    def _list_batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        db = self.store._db
        with self.store._lock:
            bound = 2**62
            if after is not None:
                row = db.execute("SELECT seq FROM batches WHERE id = ? AND tenant = ?", (after, tenant)).fetchone()
                if row is None:
                    raise KeyError(after)
                bound = row[0]
            rows = db.execute(_SELECT_BATCH + " WHERE tenant = ? AND seq < ? ORDER BY seq DESC LIMIT ?",
                              (tenant, bound, limit + 1)).fetchall()  # fmt: skip
        return [_row_batch(r) for r in rows[:limit]], len(rows) > limit

    async def active_batches(self) -> list[Batch]:
        """Every tenant's batches that are not finished, oldest first."""
        return await self.store._run(self._active_batches)

    def _active_batches(self) -> list[Batch]:
        with self.store._lock:
            rows = self.store._db.execute(
                _SELECT_BATCH + f" WHERE status IN ({', '.join('?' * len(ACTIVE))}) ORDER BY seq", ACTIVE
            ).fetchall()
        return [_row_batch(r) for r in rows]

    async def move_batch(self, batch_id: str, event: BatchEvent, **fields: Any) -> Batch:
        """Apply ``event`` (and set ``fields``) in one transaction, stamping
        the new status's time; :class:`InvalidBatchTransition` if the status
        forbids it; KeyError if there is no such batch."""
        return await self.store._run(self._move_batch, batch_id, event, fields)

    def _move_batch(self, batch_id: str, event: BatchEvent, fields: dict[str, Any]) -> Batch:
        with self.store._tx() as db:
            row = db.execute(_SELECT_BATCH + " WHERE id = ?", (batch_id,)).fetchone()
            if row is None:
                raise KeyError(batch_id)
            batch = _row_batch(row)
            status = batch_transition(batch.status, event)
            fields = {STAMP[status]: self.clock(), **fields, "status": status.value}
            sets = ", ".join(f"{name} = ?" for name in fields)
            db.execute(f"UPDATE batches SET {sets} WHERE id = ?", (*fields.values(), batch_id))
        fields["status"] = status
        return msgspec.structs.replace(batch, **fields)

    # ------------------------------------------------------------ items

    async def add_items(self, items: Sequence[Job]) -> None:
        """Insert items (jobs with ``batch_id`` and ``line``) in one
        transaction; an item whose line is already there is left as it is."""
        await self.store._run(self._add_items, list(items))

    def _add_items(self, items: list[Job]) -> None:
        now = self.clock()
        insert = INSERT_JOB.replace("INSERT INTO", "INSERT OR IGNORE INTO", 1)
        with self.store._tx() as db:
            db.executemany(insert, [job_row(msgspec.structs.replace(j, created_at=now)) for j in items])

    async def item_counts(self, batch_id: str) -> dict[JobStatus, int]:
        return await self.store._run(self._item_counts, batch_id)

    def _item_counts(self, batch_id: str) -> dict[JobStatus, int]:
        with self.store._lock:
            rows = self.store._db.execute(
                "SELECT status, count(*) FROM jobs WHERE batch_id = ? GROUP BY status", (batch_id,)
            ).fetchall()
        return {JobStatus(status): n for status, n in rows}

    async def items(self, batch_id: str, *, after_line: int, limit: int) -> list[Job]:
        """A page of the batch's items, in line order, after line ``after_line``."""
        return await self.store._run(self._items, batch_id, after_line, limit)

    def _items(self, batch_id: str, after_line: int, limit: int) -> list[Job]:
        with self.store._lock:
            rows = self.store._db.execute(
                SELECT_JOBS + " WHERE batch_id = ? AND line > ? ORDER BY line LIMIT ?", (batch_id, after_line, limit)
            ).fetchall()
        return [row_job(r) for r in rows]

    async def cancel_items(self, batch_id: str) -> list[str]:
        """Cancel the batch's queued and running items in one transaction; the
        ids of those that were running (their runners should stop them)."""
        return await self.store._run(self._cancel_items, batch_id)

    def _cancel_items(self, batch_id: str) -> list[str]:
        with self.store._tx() as db:
            running = [r[0] for r in db.execute("SELECT id FROM jobs WHERE batch_id = ? AND status = 'running'", (batch_id,))]
            db.execute(
                "UPDATE jobs SET status = 'cancelled', finished_at = ? WHERE batch_id = ? AND status IN ('queued', 'running')",
                (self.clock(), batch_id),
            )
        return running

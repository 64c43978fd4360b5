"""The :class:`~router.batch_store.BatchStore` on PostgreSQL, over the job
store's database and connections (:class:`~router.store_pg.PostgresStore`).

The SQLite batch store's statements with psycopg's placeholders; where the
SQLite file's single writer made a read-then-write safe, a row lock does
here: a batch moves under ``SELECT ... FOR UPDATE`` (a cancel and the
batch runner's finalize serialise on it), and a batch's items are cancelled
in one ``UPDATE`` over the rows it locked, which reports the ones that were
running (their runners, in any router, stop them). Items go in with
``ON CONFLICT (batch_id, line) DO NOTHING``, so a validation cut short by a
crash is redone without doubling an item. Times are the database's clock,
as in the job store. The tables are in :data:`router.store_pg.MIGRATIONS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from router.batch_store import (
    _FILE_COLUMNS,
    _INSERT_BATCH,
    _INSERT_FILE,
    _SELECT_BATCH,
    _SELECT_FILE,
    ACTIVE,
    STAMP,
    Batch,
    BatchEvent,
    FileRecord,
    _batch_values,
    _row_batch,
    _row_file,
    batch_transition,
)
from router.store import SELECT_JOBS, Job, JobStatus, job_row, row_job
from router.store_pg import INSERT_JOB_PG, Cursor, PostgresStore

__all__ = ["PostgresBatchStore"]

INSERT_FILE = _INSERT_FILE.replace("?", "%s")
INSERT_BATCH = _INSERT_BATCH.replace("?", "%s")
INSERT_ITEM = INSERT_JOB_PG + " ON CONFLICT (batch_id, line) DO NOTHING"


class PostgresBatchStore:
    """:class:`~router.batch_store.BatchStore` in the job store's PostgreSQL database."""

    def __init__(self, store: PostgresStore) -> None:
        self.store = store
        self.clock = store.clock

    # ------------------------------------------------------------ files

    async def create_file(self, record: FileRecord) -> FileRecord:
        return await self.store._run(self._create_file, record)

    def _create_file(self, cur: Cursor, record: FileRecord) -> FileRecord:
        record = msgspec.structs.replace(record, created_at=self.store._now(cur))
        cur.execute(INSERT_FILE, tuple(getattr(record, f) for f in _FILE_COLUMNS))
        return record

    async def get_file(self, tenant: str, file_id: str) -> FileRecord | None:
        """The file, if it is ``tenant``'s (another tenant's is None: a 404)."""
        return await self.store._run(self._get_file, tenant, file_id)

    def _get_file(self, cur: Cursor, tenant: str, file_id: str) -> FileRecord | None:
        row = cur.execute(_SELECT_FILE + " WHERE id = %s AND tenant = %s", (file_id, tenant)).fetchone()
        return _row_file(row) if row is not None else None

    async def set_file(self, file_id: str, *, bytes: int, lines: int, status: str) -> None:
        await self.store._run(self._set_file, file_id, bytes, lines, status)

    def _set_file(self, cur: Cursor, file_id: str, size: int, lines: int, status: str) -> None:
        cur.execute("UPDATE files SET bytes = %s, lines = %s, status = %s WHERE id = %s", (size, lines, status, file_id))

    # ------------------------------------------------------------ batches

    async def create_batch(self, batch: Batch) -> Batch:
        """Insert ``batch`` (created now; ``expires_at`` given as the window
        in seconds) and its two output files (pending), in one transaction."""
        return await self.store._run(self._create_batch, batch)

    def _create_batch(self, cur: Cursor, batch: Batch) -> Batch:
        now = self.store._now(cur)
        batch = msgspec.structs.replace(batch, created_at=now, expires_at=now + batch.expires_at)
        cur.execute(INSERT_BATCH, _batch_values(batch))
        for file_id, purpose in ((batch.output_file_id, "batch_output"), (batch.error_file_id, "batch_error")):
            name = f"{batch.id}_{purpose.removeprefix('batch_')}.jsonl"
            cur.execute(INSERT_FILE, (file_id, batch.tenant, purpose, name, 0, 0, "pending", now, batch.id))
        return batch

    async def get_batch(self, tenant: str, batch_id: str) -> Batch | None:
        return await self.store._run(self._get_batch, tenant, batch_id)

    def _get_batch(self, cur: Cursor, tenant: str, batch_id: str) -> Batch | None:
        row = cur.execute(_SELECT_BATCH + " WHERE id = %s AND tenant = %s", (batch_id, tenant)).fetchone()
        return _row_batch(row) if row is not None else None

    async def list_batches(self, tenant: str, *, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        """``tenant``'s batches newest first, older than batch ``after``
        (KeyError if that is not theirs); and whether more follow."""
        return await self.store._run(self._list_batches, tenant, after, limit)

    def _list_batches(self, cur: Cursor, tenant: str, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        bound = 2**62
        if after is not None:
            row = cur.execute("SELECT seq FROM batches WHERE id = %s AND tenant = %s", (after, tenant)).fetchone()
            if row is None:
                raise KeyError(after)
            bound = row[0]
        rows = cur.execute(_SELECT_BATCH + " WHERE tenant = %s AND seq < %s ORDER BY seq DESC LIMIT %s",
                           (tenant, bound, limit + 1)).fetchall()  # fmt: skip
        return [_row_batch(r) for r in rows[:limit]], len(rows) > limit

    async def active_batches(self) -> list[Batch]:
        """Every tenant's batches that are not finished, oldest first."""
        return await self.store._run(self._active_batches)

    def _active_batches(self, cur: Cursor) -> list[Batch]:
        rows = cur.execute(_SELECT_BATCH + " WHERE status = ANY(%s) ORDER BY seq", (list(ACTIVE),)).fetchall()
        return [_row_batch(r) for r in rows]

    async def move_batch(self, batch_id: str, event: BatchEvent, **fields: Any) -> Batch:
        """Apply ``event`` (and set ``fields``) in one transaction, stamping
        the new status's time; :class:`~router.batch_store.InvalidBatchTransition`
        if the status forbids it; KeyError if there is no such batch."""
        return await self.store._run(self._move_batch, batch_id, event, fields)

    def _move_batch(self, cur: Cursor, batch_id: str, event: BatchEvent, fields: dict[str, Any]) -> Batch:
        row = cur.execute(_SELECT_BATCH + " WHERE id = %s FOR UPDATE", (batch_id,)).fetchone()
        if row is None:
            raise KeyError(batch_id)
        batch = _row_batch(row)
        status = batch_transition(batch.status, event)
        unknown = set(fields) - set(Batch.__struct_fields__) - {"status"}
        if unknown:
            raise ValueError(f"not batch fields: {sorted(unknown)}")
        fields = {STAMP[status]: self.store._now(cur), **fields, "status": status.value}
        sets = ", ".join(f"{name} = %s" for name in fields)
        cur.execute(f"UPDATE batches SET {sets} WHERE id = %s", (*fields.values(), batch_id))
        fields["status"] = status
        return msgspec.structs.replace(batch, **fields)

    # ------------------------------------------------------------ items

    async def add_items(self, items: Sequence[Job]) -> None:
        """Insert items (jobs with ``batch_id`` and ``line``) in one
        transaction; an item whose line is already there is left as it is."""
        await self.store._run(self._add_items, list(items))

    def _add_items(self, cur: Cursor, items: list[Job]) -> None:
        now = self.store._now(cur)
        cur.executemany(INSERT_ITEM, [job_row(msgspec.structs.replace(j, created_at=now)) for j in items])

    async def item_counts(self, batch_id: str) -> dict[JobStatus, int]:
        return await self.store._run(self._item_counts, batch_id)

    def _item_counts(self, cur: Cursor, batch_id: str) -> dict[JobStatus, int]:
        rows = cur.execute("SELECT status, count(*) FROM jobs WHERE batch_id = %s GROUP BY status", (batch_id,)).fetchall()
        return {JobStatus(status): int(n) for status, n in rows}

    async def items(self, batch_id: str, *, after_line: int, limit: int) -> list[Job]:
        """A page of the batch's items, in line order, after line ``after_line``."""
        return await self.store._run(self._items, batch_id, after_line, limit)

    def _items(self, cur: Cursor, batch_id: str, after_line: int, limit: int) -> list[Job]:
        rows = cur.execute(SELECT_JOBS + " WHERE batch_id = %s AND line > %s ORDER BY line LIMIT %s",
                           (batch_id, after_line, limit)).fetchall()  # fmt: skip
        return [row_job(r) for r in rows]

    async def cancel_items(self, batch_id: str) -> list[str]:
        """Cancel the batch's queued and running items in one transaction; the
        ids of those that were running (their runners should stop them)."""
        return await self.store._run(self._cancel_items, batch_id)

    def _cancel_items(self, cur: Cursor, batch_id: str) -> list[str]:
        now = self.store._now(cur)
        rows = cur.execute(
            "WITH target AS (SELECT id, status FROM jobs WHERE batch_id = %s AND status IN ('queued', 'running') FOR UPDATE)"
            " UPDATE jobs SET status = 'cancelled', finished_at = %s FROM target WHERE jobs.id = target.id"
            " RETURNING target.id, target.status",
            (batch_id, now),
        ).fetchall()
        return sorted(job_id for job_id, status in rows if status == "running")

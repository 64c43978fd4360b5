"""Batch inference in the OpenAI Batch API shape: ``/v1/batches`` and the
runner that moves each batch through its lifecycle (router/batch_store.py).

::

    POST /v1/batches {input_file_id, endpoint, completion_window: "24h"}
        file of this tenant's, purpose batch, lines <= max_batch_lines
        ─> batches row (validating; output and error files pending) ─> 200
    BatchRunner (a supervised service), every poll_interval or when woken:
      validating   read the input file line by line (never whole); each line
                   becomes an item, a job of the batch: queued, or failed at once
                   with its line number (bad JSON, no custom_id, wrong url or
                   method, a body prepare_call refuses) ─> in_progress
                   (every line bad: failed, with the first errors)
      in_progress  the JobRunner runs the queued items with every other job, at
                   the batch class, through admission, under the per-tenant cap;
                   none left queued or running ─> finalizing; past expires_at:
                   the rest cancelled, files written ─> expired
      finalizing   output (completed items) and error (failed ones) files
                   written in line order from the store, page by page ─> completed
      cancelling   items cancelled (running ones stopped), files written ─> cancelled
    GET /v1/files/{output_file_id}/content while it runs: the lines done so far

Every step is a transition in the store and may be redone after a crash:
items are unique per line, files are written to a temporary name and
renamed. An item completes at most once (the job table's transition and
lease), so each line appears once in the output.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import msgspec
import trio

from backends.base import Backend
from backends.errors import BadRequest, ClientError, HeadraceError, NotFound
from frontend.call import prepare_call
from frontend.context import RequestContext
from frontend.server import Emit, Handler, HTTPRequest, Response, json_response
from frontend.wire import Kind
from router.batch_store import (
    BATCH_TERMINAL,
    Batch,
    BatchEvent,
    BatchStatus,
    BatchStore,
    FileRecord,
    InvalidBatchTransition,
    new_batch_id,
    new_file_id,
)
from router.config import JobsConfig
from router.jobs import page, page_query
from router.store import Job, JobStatus, new_job_id

__all__ = ["BATCH_ENDPOINTS", "BatchRunner", "BatchesAPI", "batch_view", "item_line", "parse_item"]

log = logging.getLogger(__name__)

BATCH_ENDPOINTS: dict[str, Kind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/generate": "native",
}
WINDOWS = {"24h": 24 * 3600.0}
PAGE = 256  # items per store read or write
READ = 256 * 1024
MAX_ERRORS = 20  # line errors kept on a batch that failed validation


class LineError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class BatchNotCancellable(ClientError):
    status = 409
    code = "batch_not_cancellable"


def parse_item(raw: bytes, endpoint: str) -> tuple[str, bytes]:
    """One input line: its ``custom_id`` and the request body to run (without ``stream``)."""
    try:
        obj = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise LineError("invalid_json", f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise LineError("invalid_request", "a line must be a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= 512:
        raise LineError("missing_custom_id", "custom_id must be a string of 1 to 512 characters")
    if obj.get("method", "POST") != "POST":
        raise LineError("invalid_method", "method must be POST")
    if obj.get("url") != endpoint:
        raise LineError("mismatched_endpoint", f"url must be the batch's endpoint {endpoint}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_body", "body must be a JSON object")
    body.pop("stream", None)  # an item's answer is collected, never streamed
    body.pop("stream_options", None)
    return custom_id, msgspec.json.encode(body)


async def iter_lines(path: Path, max_line: int) -> AsyncIterator[tuple[int, bytes | None]]:
    """``(number from 1, line)`` of the file, read in blocks; a line over
    ``max_line`` bytes is ``None`` (never held whole); blank lines skipped."""
    number, held, skipping = 0, b"", False
    async with await trio.open_file(path, "rb") as f:
        while True:
            block = await f.read(READ)
            pieces = (held + block).split(b"\n") if block else [held]
            held = pieces.pop() if block else b""
            for piece in pieces:
                number += 1
                if skipping:
                    skipping = False
                    yield number, None
                elif piece.strip():
                    yield number, piece
            if len(held) > max_line:
                held, skipping = b"", True
            if not block:
                if skipping:
                    yield number + 1, None
                return


def item_line(job: Job, purpose: str, reason: str | None = None) -> bytes | None:
    """The item's line in the batch's ``batch_output`` or ``batch_error``
    file (OpenAI's batch output shape), or None if it goes in neither yet."""
    custom_id = job.metadata.get("custom_id")
    line: dict[str, Any] = {"id": "batch_req_" + job.id.removeprefix("job_"), "custom_id": custom_id}
    if job.status is JobStatus.COMPLETED and purpose == "batch_output":
        body = msgspec.Raw(job.result or b"null")
        line |= {"response": {"status_code": 200, "request_id": job.id, "body": body}, "error": None}
    elif job.status is JobStatus.FAILED and purpose == "batch_error":
        error = msgspec.json.decode(job.error or b"{}")
        status = error.pop("status_code", None)
        if status is None:  # refused at validation: no request was made
            line |= {"response": None, "error": error}
        else:
            line |= {"response": {"status_code": status, "request_id": job.id, "body": {"error": error}}, "error": None}
    elif job.status is JobStatus.CANCELLED and purpose == "batch_error" and reason is not None:
        message = f"the batch was {reason} before this request ran"
        line |= {"response": None, "error": {"code": f"batch_{reason}", "message": message, "line": job.line}}
    else:
        return None
    return msgspec.json.encode(line) + b"\n"


def batch_view(batch: Batch, counts: dict[JobStatus, int]) -> dict[str, Any]:
    done = {s: counts.get(s, 0) for s in (JobStatus.COMPLETED, JobStatus.FAILED)}
    errors = None if batch.errors is None else {"object": "list", "data": msgspec.json.decode(batch.errors)}
    stamp = {name: None if getattr(batch, name) is None else int(getattr(batch, name))
             for name in ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "cancelling_at",
                          "cancelled_at", "expired_at")}  # fmt: skip
    return {
        "id": batch.id, "object": "batch", "endpoint": batch.endpoint, "errors": errors,
        "input_file_id": batch.input_file_id, "completion_window": batch.completion_window,
        "status": batch.status.value, "output_file_id": batch.output_file_id, "error_file_id": batch.error_file_id,
        "created_at": int(batch.created_at), "expires_at": int(batch.expires_at), **stamp,
        "request_counts": {"total": batch.total, "completed": done[JobStatus.COMPLETED], "failed": done[JobStatus.FAILED]},
        "metadata": batch.metadata,
    }  # fmt: skip


class BatchesAPI:
    """``/v1/batches``, tenant by tenant: another tenant's batch is a 404."""

    def __init__(self, store: BatchStore, runner: BatchRunner, config: JobsConfig) -> None:
        self.store, self.runner, self.config = store, runner, config

    def routes(self) -> dict[tuple[str, str], Handler]:
        return {
            ("POST", "/v1/batches"): self.create,
            ("GET", "/v1/batches"): self.list_batches,
            ("GET", "/v1/batches/{id}"): self.get,
            ("POST", "/v1/batches/{id}/cancel"): self.cancel,
        }

    async def create(self, request: HTTPRequest) -> Response:
        try:
            raw = msgspec.json.decode(request.body)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise BadRequest("request body must be a JSON object")
        endpoint, window, file_id = raw.get("endpoint"), raw.get("completion_window"), raw.get("input_file_id")
        metadata = raw.get("metadata")
        metadata = {} if metadata is None else metadata
        if not isinstance(endpoint, str) or endpoint not in BATCH_ENDPOINTS:
            raise BadRequest(f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}", param="endpoint")
        if not isinstance(window, str) or window not in WINDOWS:
            raise BadRequest(f"completion_window must be one of {', '.join(WINDOWS)}", param="completion_window")
        if not isinstance(metadata, dict) or len(metadata) > 16 or not all(isinstance(v, str) for v in metadata.values()):
            raise BadRequest("metadata must be an object of at most 16 string values", param="metadata")
        if not isinstance(file_id, str):
            raise BadRequest("input_file_id is required", param="input_file_id")
        record = await self.store.get_file(request.context.tenant, file_id)
        if record is None:
            raise NotFound(f"no file {file_id!r}", param="input_file_id")
        if record.purpose != "batch":
            raise BadRequest(f"file {file_id} has purpose {record.purpose}, not batch", param="input_file_id")
        if record.lines > self.config.max_batch_lines:
            raise BadRequest(f"the file has {record.lines} lines; a batch takes at most {self.config.max_batch_lines}",
                             param="input_file_id")  # fmt: skip
        batch = Batch(id=new_batch_id(), tenant=request.context.tenant, endpoint=endpoint, input_file_id=file_id,
                      completion_window=window, output_file_id=new_file_id(), error_file_id=new_file_id(),
                      metadata=metadata, expires_at=WINDOWS[window])  # fmt: skip
        batch = await self.store.create_batch(batch)  # committed: only now acknowledged
        self.runner.wake()
        return json_response(batch_view(batch, {}))

    async def _batch(self, request: HTTPRequest) -> Batch:
        batch = await self.store.get_batch(request.context.tenant, request.params["id"])
        if batch is None:
            raise NotFound(f"no batch {request.params['id']!r}", param="id")
        return batch

    async def get(self, request: HTTPRequest) -> Response:
        batch = await self._batch(request)
        return json_response(batch_view(batch, await self.store.item_counts(batch.id)))

    async def cancel(self, request: HTTPRequest) -> Response:
        """Cancel a validating or running batch (again: the same answer); its
        completed items stay in its output file."""
        batch = await self._batch(request)
        try:
            batch = await self.store.move_batch(batch.id, BatchEvent.CANCEL)
        except InvalidBatchTransition as exc:
            if exc.status not in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
                raise BatchNotCancellable(f"batch {batch.id} is {exc.status.value}", param="id") from None
            batch = await self._batch(request)
        else:
            await self.runner.stop_items(batch)
        return json_response(batch_view(batch, await self.store.item_counts(batch.id)))

    async def list_batches(self, request: HTTPRequest) -> Response:
        after, limit = page_query(request)
        try:
            batches, more = await self.store.list_batches(request.context.tenant, after=after, limit=limit)
        except KeyError:
            raise BadRequest(f"after: no batch {after!r}", param="after") from None
        return page([batch_view(b, await self.store.item_counts(b.id)) for b in batches], more)


class BatchRunnerStatistics(msgspec.Struct, frozen=True, kw_only=True):
    validated: int
    lines_rejected: int
    finished: int


class BatchRunner:
    """A :class:`~router.services.Service`: moves every active batch (all
    tenants, all processes sharing the file) one step at a time."""

    name = "batches"

    def __init__(self, store: BatchStore, backend: Backend, files_dir: Path, config: JobsConfig, *,
                 max_line_bytes: int, jobs: Any = None) -> None:  # fmt: skip
        """``jobs``: the :class:`~router.jobs.JobRunner` (woken for new items; told to stop cancelled ones)."""
        self.store, self.backend, self.dir, self.config = store, backend, files_dir, config
        self.max_line, self.jobs = max_line_bytes, jobs
        self._wake = trio.Event()
        self._counts = dict.fromkeys(("validated", "lines_rejected", "finished"), 0)

    def wake(self) -> None:
        self._wake.set()

    def crashed(self, exc: BaseException) -> None:
        pass

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            self._wake = trio.Event()
            for batch in await self.store.active_batches():
                try:
                    await self._advance(batch)
                except InvalidBatchTransition as exc:  # another process (or a cancel) moved it first
                    log.debug("batch %s: %s", batch.id, exc)
            with trio.move_on_after(self.config.poll_interval):
                await self._wake.wait()

    async def _advance(self, batch: Batch) -> None:
        if batch.status is BatchStatus.VALIDATING:
            try:
                await self._validate(batch)
            except FileNotFoundError:  # its input was removed from the data directory
                gone = [{"code": "input_file_missing", "message": "the input file is gone from the data directory", "line": None}]
                await self._finish(batch, BatchEvent.FAIL, None, errors=msgspec.json.encode(gone))
        elif batch.status is BatchStatus.IN_PROGRESS:
            if self.store.clock() >= batch.expires_at:
                await self.stop_items(batch)
                await self._finish(batch, BatchEvent.EXPIRE, "expired")
                return
            counts = await self.store.item_counts(batch.id)
            if not counts.get(JobStatus.QUEUED) and not counts.get(JobStatus.RUNNING):
                batch = await self.store.move_batch(batch.id, BatchEvent.FINALIZE)
                await self._finish(batch, BatchEvent.COMPLETE, None)
        elif batch.status is BatchStatus.FINALIZING:
            await self._finish(batch, BatchEvent.COMPLETE, None)
        elif batch.status is BatchStatus.CANCELLING:
            await self.stop_items(batch)
            await self._finish(batch, BatchEvent.STOP, "cancelled")

    async def stop_items(self, batch: Batch) -> None:
        """Cancel the batch's queued and running items; running ones here stop now, elsewhere at their next heartbeat."""
        for job_id in await self.store.cancel_items(batch.id):
            if self.jobs is not None:
                self.jobs.cancel(job_id)
        self.wake()

    # ------------------------------------------------------------ validation

    async def _validate(self, batch: Batch) -> None:
        kind = BATCH_ENDPOINTS[batch.endpoint]
        items: list[Job] = []
        seen: set[str] = set()
        total = rejected = 0
        errors: list[dict[str, Any]] = []
        async for number, raw in iter_lines(self.dir / f"{batch.input_file_id}.jsonl", self.max_line):
            total += 1
            item = self._item(batch, kind, number, raw, seen)
            if item.status is JobStatus.FAILED:
                rejected += 1
                if len(errors) < MAX_ERRORS:
                    errors.append(msgspec.json.decode(item.error or b"{}"))
            items.append(item)
            if len(items) >= PAGE:
                await self.store.add_items(items)
                items = []
        await self.store.add_items(items)
        self._counts["lines_rejected"] += rejected
        if total == rejected:
            if not errors:
                errors.append({"code": "empty_file", "message": "the input file holds no request", "line": None})
            await self._finish(batch, BatchEvent.FAIL, None, total=total, errors=msgspec.json.encode(errors))
            return
        await self.store.move_batch(batch.id, BatchEvent.VALIDATED, total=total)
        self._counts["validated"] += 1
        if self.jobs is not None:
            self.jobs.wake()

    def _item(self, batch: Batch, kind: Kind, number: int, raw: bytes | None, seen: set[str]) -> Job:
        job = Job(id=new_job_id(), tenant=batch.tenant, kind=kind, body=b"{}", batch_id=batch.id, line=number)
        custom_id: str | None = None
        try:
            if raw is None:
                raise LineError("line_too_long", f"the line is over {self.max_line} bytes")
            custom_id, body = parse_item(raw, batch.endpoint)
            if custom_id in seen:
                raise LineError("duplicate_custom_id", f"custom_id {custom_id!r} is used by an earlier line")
            seen.add(custom_id)
            context = RequestContext(request_id=job.id, tenant=batch.tenant, priority="batch")
            prepare_call(kind, body, self.backend, context)  # the 400s (and unknown models) now, per line
        except (LineError, HeadraceError) as exc:
            code = exc.code if isinstance(exc, LineError) else (exc.code or "invalid_request")
            error = {"code": code, "message": f"line {number}: {exc.message}", "line": number}
            return msgspec.structs.replace(job, status=JobStatus.FAILED, metadata={"custom_id": custom_id},
                                           error=msgspec.json.encode(error), finished_at=self.store.clock())  # fmt: skip
        return msgspec.structs.replace(job, body=body, metadata={"custom_id": custom_id})

    # ------------------------------------------------------------ output files

    async def _finish(self, batch: Batch, event: BatchEvent, reason: str | None, **fields: Any) -> None:
        """Write the output and error files, then take ``event`` (a terminal status)."""
        sizes = {}
        for file_id, purpose in ((batch.output_file_id, "batch_output"), (batch.error_file_id, "batch_error")):
            sizes[file_id] = await self._write(batch, file_id, purpose, reason)
        batch = await self.store.move_batch(batch.id, event, **fields)
        assert batch.status in BATCH_TERMINAL
        for file_id, (size, lines) in sizes.items():
            await self.store.set_file(file_id, bytes=size, lines=lines, status="processed")
        self._counts["finished"] += 1

    async def _write(self, batch: Batch, file_id: str, purpose: str, reason: str | None) -> tuple[int, int]:
        part = self.dir / f".{file_id}.{secrets.token_hex(4)}.writing"
        size = lines = 0
        try:
            async with await trio.open_file(part, "wb") as out:
                async for block in self.blocks(batch.id, purpose, reason):
                    await out.write(block)
                    size, lines = size + len(block), lines + block.count(b"\n")
                await out.flush()
                await trio.to_thread.run_sync(os.fsync, out.wrapped.fileno())
            await trio.Path(part).rename(self.dir / f"{file_id}.jsonl")
        finally:
            with trio.CancelScope(shield=True):
                await trio.Path(part).unlink(missing_ok=True)
        return size, lines

    async def lines(self, batch_id: str, purpose: str, reason: str | None) -> AsyncIterator[bytes]:
        """The file's lines, in input line order, a page of items at a time."""
        after = 0
        while page := await self.store.items(batch_id, after_line=after, limit=PAGE):
            for job in page:
                line = item_line(job, purpose, reason)
                if line is not None:
                    yield line
            after = cast(int, page[-1].line)

    async def blocks(self, batch_id: str, purpose: str, reason: str | None) -> AsyncIterator[bytes]:
        """:meth:`lines` joined into blocks of about ``READ`` bytes."""
        held: list[bytes] = []
        size = 0
        async for line in self.lines(batch_id, purpose, reason):
            held.append(line)
            size += len(line)
            if size >= READ:
                yield b"".join(held)
                held, size = [], 0
        if held:
            yield b"".join(held)

    async def partial(self, record: FileRecord, emit: Emit) -> None:
        """A pending output or error file's content: the lines done so far."""
        assert record.batch_id is not None
        async for block in self.blocks(record.batch_id, record.purpose, None):
            await emit(block)

    def statistics(self) -> BatchRunnerStatistics:
        return BatchRunnerStatistics(**self._counts)

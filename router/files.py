"""Files in the OpenAI Files API shape, kept in the data directory, and the
data directory itself.

::

    POST /v1/files (multipart/form-data: purpose=batch, file=<JSONL>)
        body chunk by chunk (StreamingBody) ─> python-multipart parser
        ─> <data dir>/files/.<id>.part (bytes, lines and the body's SHA-256 counted
           as they pass; past max_file_bytes: 413) ─> fsync ─> rename <id>.jsonl
        ─> files row committed ─> 200 {id, object: file, bytes, purpose, ...}
    GET /v1/files/{id}             the file object (another tenant's: 404)
    GET /v1/files/{id}/content     its bytes, streamed from disk in 64 KiB reads;
                                   a batch's output or error file while the batch
                                   runs: the lines done so far (router/batches.py)

The upload is never held in memory: at most one network chunk and one
parser callback's slice at a time. ``Idempotency-Key`` on an upload is
checked once the body is in (its digest is only known then): a replay
deletes the new copy and answers the first upload's response.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import trio
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from backends.errors import BadRequest, NotFound, PayloadTooLarge
from frontend.server import Emit, Handler, HTTPRequest, Response, StreamingBody, json_response
from router.batch_store import BatchStore, FileRecord, new_file_id
from router.config import JobsConfig
from router.idempotency import Idempotency

__all__ = ["FilesAPI", "file_view"]

READ_CHUNK = 64 * 1024
WRITE_CHUNK = 256 * 1024
MAX_FIELD = 1024  # bytes of a form field that is not the file (purpose)
PURPOSES = ("batch",)


def file_view(record: FileRecord) -> dict[str, Any]:
    return {"id": record.id, "object": "file", "bytes": record.bytes, "created_at": int(record.created_at),
            "filename": record.filename, "purpose": record.purpose,
            "status": "processed" if record.status == "processed" else "uploaded"}  # fmt: skip


class _Upload:
    """python-multipart's callbacks, collected per written chunk: the form
    fields (small) and the file part's data slices, in order."""

    def __init__(self, boundary: bytes) -> None:
        self.parser = MultipartParser(boundary, {
            "on_part_begin": self._begin, "on_header_field": self._field, "on_header_value": self._value,
            "on_header_end": self._header_end, "on_headers_finished": self._headers_done,
            "on_part_data": self._data, "on_end": self._end,
        })  # fmt: skip
        self.fields: dict[str, bytes] = {}
        self.filename: str | None = None
        self.pending: list[bytes] = []  # file data since the last take()
        self.ended = False
        self._name = self._header = self._hvalue = b""
        self._headers: dict[bytes, bytes] = {}
        self._part: str | None = None
        self._is_file = False

    def write(self, chunk: bytes) -> list[bytes]:
        try:
            self.parser.write(chunk)
        except MultipartParseError as exc:
            raise BadRequest(f"the multipart body does not parse: {exc}") from None
        taken, self.pending = self.pending, []
        return taken

    def _begin(self) -> None:
        self._headers, self._part, self._is_file = {}, None, False

    def _field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def _value(self, data: bytes, start: int, end: int) -> None:
        self._hvalue += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._header.lower()] = self._hvalue
        self._header = self._hvalue = b""

    def _headers_done(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        self._part = options.get(b"name", b"").decode("latin-1")
        self._is_file = self._part == "file"
        if self._is_file:
            if self.filename is not None:
                raise BadRequest("one file per upload", param="file")
            self.filename = options.get(b"filename", b"upload.jsonl").decode("utf-8", "replace")[:255] or "upload.jsonl"

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._is_file:
            self.pending.append(data[start:end])
        elif self._part is not None:
            value = self.fields.get(self._part, b"") + data[start:end]
            if len(value) > MAX_FIELD:
                raise BadRequest(f"form field {self._part!r} over {MAX_FIELD} bytes", param=self._part)
            self.fields[self._part] = value

    def _end(self) -> None:
        self.ended = True


class FilesAPI:
    """``/v1/files``: uploads of batch input, and the content of every file
    (the content of a batch's output while it runs comes from ``partial``)."""

    def __init__(
        self,
        store: BatchStore,
        files_dir: Path,
        config: JobsConfig,
        idempotency: Idempotency,
        partial: Callable[[FileRecord, Emit], Awaitable[None]],
    ) -> None:
        self.store, self.dir, self.config, self.idempotency, self.partial = store, files_dir, config, idempotency, partial

    def routes(self) -> dict[tuple[str, str], Handler]:
        return {
            ("POST", "/v1/files"): StreamingBody(self.upload),
            ("GET", "/v1/files/{id}"): self.get,
            ("GET", "/v1/files/{id}/content"): self.content,
        }

    def path(self, file_id: str) -> Path:
        return self.dir / f"{file_id}.jsonl"

    async def upload(self, request: HTTPRequest) -> Response:
        kind, options = parse_options_header(request.headers.get("content-type", ""))
        if kind != b"multipart/form-data" or not options.get(b"boundary"):
            raise BadRequest("POST /v1/files takes multipart/form-data with the fields purpose and file")
        file_id = new_file_id()
        part = self.dir / f".{file_id}.part"
        try:
            size, lines, digest, form = await self._receive(request, options[b"boundary"], part)
            purpose = form.fields.get("purpose", b"").decode("utf-8", "replace")
            if purpose not in PURPOSES:
                raise BadRequest(f"purpose must be one of {', '.join(PURPOSES)}, not {purpose!r}", param="purpose")
            if form.filename is None:
                raise BadRequest("no file part in the upload", param="file")
            if size == 0:
                raise BadRequest("the file is empty", param="file")
            record = FileRecord(id=file_id, tenant=request.context.tenant, purpose=purpose, filename=form.filename,
                                bytes=size, lines=lines)  # fmt: skip

            async def store() -> Response:
                await trio.Path(part).rename(self.path(file_id))
                return json_response(file_view(await self.store.create_file(record)))

            return await self.idempotency.run(request, digest, store)
        finally:
            with trio.CancelScope(shield=True):
                await trio.Path(part).unlink(missing_ok=True)

    async def _receive(self, request: HTTPRequest, boundary: bytes, part: Path) -> tuple[int, int, str, _Upload]:
        assert request.reader is not None  # a StreamingBody route
        form, digest = _Upload(boundary), hashlib.sha256(request.path.encode() + b"\0")
        size = lines = 0
        last = b"\n"
        held: list[bytes] = []  # up to WRITE_CHUNK bytes, written in one thread hop
        async with await trio.open_file(part, "wb") as out:
            while not form.ended:
                chunk = await request.reader.read()
                if not chunk:
                    break
                for data in form.write(chunk):
                    digest.update(data)
                    size += len(data)
                    if size > self.config.max_file_bytes:
                        raise PayloadTooLarge(f"the file is over {self.config.max_file_bytes} bytes", param="file")
                    lines += data.count(b"\n")
                    last = data[-1:] or last
                    held.append(data)
                if sum(map(len, held)) >= WRITE_CHUNK:
                    await out.write(b"".join(held))
                    held = []
            if not form.ended:
                raise BadRequest("the multipart body ended before its closing boundary")
            await out.write(b"".join(held))
            await out.flush()
            await trio.to_thread.run_sync(os.fsync, out.wrapped.fileno())
        while await request.reader.read():  # an epilogue after the closing boundary
            pass
        # The digest is of what was sent, not of its framing (a client picks a new boundary each time).
        digest.update(b"\0" + repr(sorted(form.fields.items())).encode() + b"\0" + (form.filename or "").encode())
        return size, lines + (last != b"\n"), digest.hexdigest(), form

    async def _file(self, request: HTTPRequest) -> FileRecord:
        record = await self.store.get_file(request.context.tenant, request.params["id"])
        if record is None:
            raise NotFound(f"no file {request.params['id']!r}", param="id")
        return record

    async def get(self, request: HTTPRequest) -> Response:
        return json_response(file_view(await self._file(request)))

    async def content(self, request: HTTPRequest) -> Response:
        record = await self._file(request)
        if record.status != "processed":  # a running batch's output: what is done so far
            return Response(200, content_type="application/jsonl", stream=lambda emit: self.partial(record, emit))
        path = self.path(record.id)

        async def produce(emit: Emit) -> None:
            async with await trio.open_file(path, "rb") as f:
                while chunk := await f.read(READ_CHUNK):
                    await emit(chunk)

        try:
            await trio.Path(path).stat()
        except FileNotFoundError:
            raise NotFound(f"the content of file {record.id!r} is gone from the data directory", param="id") from None
        return Response(200, content_type="application/jsonl", stream=produce)


def encode_line(obj: Any) -> bytes:
    return msgspec.json.encode(obj) + b"\n"

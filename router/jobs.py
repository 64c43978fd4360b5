"""Asynchronous jobs: the ``/v1/jobs`` API and the runner that works them off.

::

    POST /v1/jobs ── Idempotency-Key? reserve ── decode + validate (prepare_call: 400 now, not later)
        └─> store.create (committed) ── runner.wake() ── 202 {id, status: queued}
    JobRunner (a supervised service)
        start: requeue jobs left running by a crash
        loop:  claim due queued jobs (global cap, per-tenant cap, priority then age)
               └─ one task per job, in the runner's nursery, under its own cancel scope:
                  RequestContext(tenant, class = the job's priority, "batch" by default)
                  prepare_call ─> gate.admit (the router's pipeline: rate limits, queue)
                  ─> Call.collect() against the dispatcher ─> store: complete | fail | requeue
    DELETE /v1/jobs/{id} ── store: cancel (queued or running) ── runner.cancel(id): its scope
                            (in another process: that runner's next heartbeat finds it cancelled)
    JobRunner._keep_leases: every lease/3 s renew this runner's leases, stop jobs cancelled
                            elsewhere, requeue jobs whose runner went silent for a lease

The job's outcome is written only through the store's transition table
(:mod:`router.store`), so a ``DELETE`` racing the runner's finish leaves
whichever came first. An upstream error or a refusal from admission (429,
503) puts the job back in the queue after its ``Retry-After`` (or
``retry_delay``), up to ``max_attempts`` runs that end in an error (a run
cut short by a crash does not count); a client error (a 400 from
the backend) fails it at once. A runner that is cancelled (shutdown, a
crash) leaves its jobs ``running`` on disk with a lease that lapses: after
``lease`` seconds the next runner (this process restarted, or another
worker) requeues them, so an acknowledged job is never lost (it may run
twice if it was cut short).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import Any, cast
from urllib.parse import parse_qs

import msgspec
import trio

from backends.base import Backend
from backends.errors import BadRequest, ClientError, HeadraceError, NotFound, RateLimited
from frontend.call import prepare_call
from frontend.context import OPEN_GATE, Gate, PriorityClass, RequestContext
from frontend.server import Handler, HTTPRequest, Response, json_response
from frontend.wire import Kind, error_body
from router.admission import ENGINE_PRIORITY
from router.config import JobsConfig
from router.idempotency import Idempotency, IdempotencyConflict, IdempotencyMismatch
from router.store import (
    InvalidTransition,
    Job,
    JobEvent,
    JobStatus,
    JobStore,
    new_job_id,
)

__all__ = ["IdempotencyConflict", "IdempotencyMismatch", "JobRunner", "JobRunnerStatistics", "JobsAPI"]

log = logging.getLogger(__name__)

ENDPOINTS: dict[str, Kind] = {
    "/v1/completions": "completion",
    "/v1/chat/completions": "chat",
    "/v1/generate": "native",
}
KIND_ENDPOINT = {kind: endpoint for endpoint, kind in ENDPOINTS.items()}
PRIORITIES = ("interactive", "default", "batch")
MAX_LIMIT = 100


class JobRequest(msgspec.Struct, frozen=True):
    kind: Kind
    body: bytes  # the completions/chat/generate body, without the job's own fields
    metadata: dict[str, Any]
    priority: str


def parse_job(body: bytes) -> JobRequest:
    """The request body of ``POST /v1/jobs``: a completions, chat or generate
    body plus ``metadata``, ``priority`` and ``endpoint`` (else the shape says:
    ``messages`` is chat, ``prompt`` a completion)."""
    try:
        raw = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise BadRequest("request body must be a JSON object")
    metadata = raw.pop("metadata", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict):
        raise BadRequest("metadata must be an object", param="metadata")
    priority = raw.pop("priority", None)
    priority = "batch" if priority is None else priority
    if not isinstance(priority, str) or priority not in PRIORITIES:
        raise BadRequest("priority must be interactive, default or batch", param="priority")
    endpoint = raw.pop("endpoint", None)
    if endpoint is None:
        kind: Kind = "chat" if "messages" in raw else "completion"
    elif isinstance(endpoint, str) and endpoint in ENDPOINTS:
        kind = ENDPOINTS[endpoint]
    else:
        raise BadRequest(f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint")
    raw.pop("stream", None)  # a job's answer is collected, never streamed
    return JobRequest(kind, msgspec.json.encode(raw), metadata, priority)


def job_view(job: Job) -> dict[str, Any]:
    """A job as the API shows it: the result once completed, the error once failed."""
    out: dict[str, Any] = {
        "id": job.id,
        "object": "job",
        "status": job.status.value,
        "endpoint": KIND_ENDPOINT.get(cast(Kind, job.kind), job.kind),
        "priority": job.priority,
        "metadata": job.metadata,
        "attempts": job.attempts,
        "errors": job.errors,
        "created_at": job.created_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
    }
    if job.result is not None:
        out["result"] = msgspec.json.decode(job.result)
    if job.error is not None:
        out["error"] = msgspec.json.decode(job.error)
    return out


class JobsAPI:
    """The ``/v1/jobs`` routes, tenant by tenant: another tenant's job is a 404."""

    def __init__(self, store: JobStore, runner: JobRunner, backend: Backend, idempotency: Idempotency) -> None:
        self.store, self.runner, self.backend, self.idempotency = store, runner, backend, idempotency

    def routes(self) -> dict[tuple[str, str], Handler]:
        return {
            ("POST", "/v1/jobs"): self.idempotency.wrap(self.submit),
            ("GET", "/v1/jobs"): self.list_jobs,
            ("GET", "/v1/jobs/{id}"): self.get,
            ("DELETE", "/v1/jobs/{id}"): self.cancel,
        }

    async def submit(self, request: HTTPRequest) -> Response:
        status, body = await self._create(request)
        return Response(status, body)

    async def _create(self, request: HTTPRequest) -> tuple[int, bytes]:
        parsed = parse_job(request.body)
        context = RequestContext(request_id=request.context.request_id, tenant=request.context.tenant)
        prepare_call(parsed.kind, parsed.body, self.backend, context)  # 400 / 404 model now, before it is stored
        job = Job(id=new_job_id(), tenant=context.tenant, kind=parsed.kind, body=parsed.body,
                  metadata=parsed.metadata, priority=parsed.priority)  # fmt: skip
        job = await self.store.create(job)  # committed: only now acknowledged
        self.runner.wake()
        return 202, msgspec.json.encode({"id": job.id, "object": "job", "status": job.status.value})

    async def get(self, request: HTTPRequest) -> Response:
        return json_response(job_view(await self._job(request)))

    async def _job(self, request: HTTPRequest) -> Job:
        job = await self.store.get(request.context.tenant, request.params["id"])
        if job is None:
            raise NotFound(f"no job {request.params['id']!r}", param="id")
        return job

    async def cancel(self, request: HTTPRequest) -> Response:
        """Cancel a queued or running job (again: the same answer); a
        finished one is a 409 that names its status."""
        job_id = request.params["id"]
        try:
            found = await self.store.cancel(request.context.tenant, job_id)
        except InvalidTransition as exc:
            if exc.status is JobStatus.CANCELLED:
                return json_response(job_view(await self._job(request)))
            raise JobFinished(f"job {job_id} is already {exc.status.value}", param="id") from None
        if found is None:
            raise NotFound(f"no job {job_id!r}", param="id")
        before, cancelled = found
        if before is JobStatus.RUNNING:
            self.runner.cancel(job_id)
        return json_response(job_view(cancelled))

    async def list_jobs(self, request: HTTPRequest) -> Response:
        after, limit = page_query(request)
        try:
            jobs, more = await self.store.list_jobs(request.context.tenant, after=after, limit=limit)
        except KeyError:
            raise BadRequest(f"after: no job {after!r}", param="after") from None
        return page([job_view(j) for j in jobs], more)


def page_query(request: HTTPRequest) -> tuple[str | None, int]:
    """A list endpoint's cursor and page size (``?after=ID&limit=N``, 1 to MAX_LIMIT, 20 by default)."""
    query = parse_qs(request.query.decode("latin-1"))
    raw_limit = query.get("limit", ["20"])[-1]
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_LIMIT:
        raise BadRequest(f"limit must be an integer from 1 to {MAX_LIMIT}", param="limit")
    return query.get("after", [None])[-1], int(raw_limit)


def page(data: list[dict[str, Any]], more: bool) -> Response:
    """One page of a list endpoint, in OpenAI's list shape."""
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return json_response({"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more})


class JobFinished(ClientError):
    """409: the job already finished and can no longer be cancelled."""

    status = 409
    code = "job_finished"


class JobRunnerStatistics(msgspec.Struct, frozen=True, kw_only=True):
    running: int
    running_by_tenant: dict[str, int]
    started: int
    completed: int
    failed: int
    requeued: int  # put back after a retryable error
    recovered: int  # found running at start (a crash) and requeued
    cancelled: int  # running jobs cancelled in their task


class JobRunner:
    """A :class:`~router.services.Service`: runs queued jobs against
    ``backend`` (the dispatcher) through ``gate`` (the pipeline)."""

    name = "jobs"

    def __init__(
        self,
        store: JobStore,
        backend: Backend,
        config: JobsConfig,
        *,
        gate: Gate = OPEN_GATE,
        ready: Callable[[], bool] = lambda: True,
    ) -> None:
        """``ready()``: whether jobs can run now (the dispatcher has a backend
        up); none is claimed before, so a cold start burns no retries."""
        self.store, self.backend, self.config, self.gate, self.ready = store, backend, config, gate, ready
        self._wake = trio.Event()
        self.owner = ""
        self._scopes: dict[str, trio.CancelScope] = {}
        self._tenants: dict[str, int] = {}
        self._counts = dict.fromkeys(("started", "completed", "failed", "requeued", "recovered", "cancelled"), 0)

    def wake(self) -> None:
        """A job was queued (or a slot freed): look at the queue now."""
        self._wake.set()

    def cancel(self, job_id: str) -> None:
        """Cancel a running job in its task (the store already says cancelled)."""
        # Not ours (another process runs it), or claimed but not yet
        # registered: the next heartbeat finds it cancelled and stops it.
        scope = self._scopes.get(job_id)
        if scope is not None:
            scope.cancel()

    def crashed(self, exc: BaseException) -> None:
        self._scopes.clear()
        self._tenants.clear()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.owner = secrets.token_hex(8)  # this run's lease name: a restart is a new runner
        self._counts["recovered"] += await self.store.requeue_stale(self.config.lease)
        task_status.started()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._keep_leases)
            while True:
                self._wake = trio.Event()
                free = self.config.concurrency - len(self._scopes)
                if free > 0 and self.ready():
                    claimed = await self.store.claim(slots=free, per_tenant=self.config.per_tenant, owner=self.owner)
                    for job in claimed:
                        scope = trio.CancelScope()
                        self._scopes[job.id] = scope
                        self._tenants[job.tenant] = self._tenants.get(job.tenant, 0) + 1
                        nursery.start_soon(self._work, job, scope)
                with trio.move_on_after(self.config.poll_interval):
                    await self._wake.wait()

    async def _keep_leases(self) -> None:
        """Renew the leases on this runner's jobs; stop those another
        process cancelled; requeue jobs whose runner stopped renewing (died)."""
        while True:
            await trio.sleep(self.config.lease / 3)
            for job_id in await self.store.heartbeat(self.owner, list(self._scopes)):
                if job_id in self._scopes:
                    self._scopes[job_id].cancel()
            recovered = await self.store.requeue_stale(self.config.lease)
            if recovered:
                self._counts["recovered"] += recovered
                self.wake()

    async def _work(self, job: Job, scope: trio.CancelScope) -> None:
        self._counts["started"] += 1
        try:
            with scope:
                await self._run_one(job)
            if scope.cancelled_caught:
                self._counts["cancelled"] += 1
        finally:
            del self._scopes[job.id]
            self._tenants[job.tenant] -= 1
            if not self._tenants[job.tenant]:
                del self._tenants[job.tenant]
            self.wake()

    async def _run_one(self, job: Job) -> None:
        context = RequestContext(request_id=job.id, tenant=job.tenant, priority=cast(PriorityClass, job.priority),
                                 arrival=trio.current_time())  # fmt: skip
        try:
            call = prepare_call(cast(Kind, job.kind), job.body, self.backend, context)
            # The engine's priority for the class even where admission (which sets it too) is off.
            # A batch's items stay together on one backend while its load is bounded
            # (their shared prefixes are cached there), whatever the routing policy.
            call.subs = [msgspec.structs.replace(s, priority=ENGINE_PRIORITY[job.priority], affinity=job.batch_id)
                         for s in call.subs]  # fmt: skip
            async with self.gate.admit(context, call):
                result = await call.collect()
        except HeadraceError as exc:
            await self._failed(job, exc)
            return
        await self._finish(job, JobEvent.COMPLETE, result=msgspec.json.encode(result))
        self._counts["completed"] += 1

    async def _failed(self, job: Job, exc: HeadraceError) -> None:
        retryable = not isinstance(exc, ClientError) or isinstance(exc, RateLimited)
        errors = job.errors + 1
        if retryable and errors < self.config.max_attempts:
            delay = exc.retry_after if exc.retry_after is not None else self.config.retry_delay
            not_before = self.store.clock() + delay
            await self._finish(job, JobEvent.REQUEUE, started_at=None, not_before=not_before, errors=errors)
            self._counts["requeued"] += 1
            return
        fields = error_body(exc.message, exc.type, exc.param, exc.code)["error"]
        if job.batch_id is not None:  # the status goes in the batch's error file
            fields["status_code"] = exc.status
        error = msgspec.json.encode(fields)
        await self._finish(job, JobEvent.FAIL, error=error, errors=errors)
        self._counts["failed"] += 1

    async def _finish(self, job: Job, event: JobEvent, **fields: Any) -> None:
        with trio.CancelScope(shield=True):  # the outcome is written even if a cancel lands now
            try:
                await self.store.apply(job.id, event, owner=self.owner, **fields)
            except InvalidTransition as exc:  # cancelled meanwhile: the cancel stands
                log.debug("job %s: %s", job.id, exc)

    def statistics(self) -> JobRunnerStatistics:
        return JobRunnerStatistics(running=len(self._scopes), running_by_tenant=dict(self._tenants), **self._counts)

"""The job store, on a real SQLite file and on a real PostgreSQL server
(each behaviour test runs on both, through the ``open_store`` fixture of
tests/router/conftest.py; the
PostgreSQL run skips, saying why, where no server can start): the status
transition table (property-tested), migrations, durability settings,
claiming by priority and per-tenant cap, crash requeue, idempotency expiry
and lease takeover."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from backends.errors import ClientError
from frontend.call import prepare_call
from frontend.context import RequestContext
from router.jobs import parse_job
from router.store import (
    MIGRATIONS,
    TERMINAL,
    TRANSITIONS,
    IdemBusy,
    IdemMismatch,
    IdemReplay,
    IdemReserved,
    InvalidTransition,
    Job,
    JobEvent,
    JobStatus,
    LeaseLost,
    SQLiteStore,
    StoreUnavailable,
    new_job_id,
    transition,
)
from tests.router.fakes import FakeBackend


class WallClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


OpenStore = Callable[..., Any]  # the open_store fixture (tests/router/conftest.py): (**options) -> a JobStore


def job(tenant: str = "t", priority: str = "batch") -> Job:
    return Job(id=new_job_id(), tenant=tenant, kind="chat", body=b"{}", priority=priority)


@given(st.sampled_from(JobStatus), st.sampled_from(JobEvent))
def test_every_status_event_pair_is_in_the_table_or_raises(status: JobStatus, event: JobEvent) -> None:
    if (status, event) in TRANSITIONS:
        assert transition(status, event) is TRANSITIONS[(status, event)]
    else:
        with pytest.raises(InvalidTransition) as raised:
            transition(status, event)
        assert (raised.value.status, raised.value.event) == (status, event)


@given(st.lists(st.sampled_from(JobEvent), max_size=12))
def test_a_job_that_finished_never_changes_again_and_only_running_jobs_finish(events: list[JobEvent]) -> None:
    status = JobStatus.QUEUED
    for event in events:
        try:
            after = transition(status, event)
        except InvalidTransition:
            assert status in TERMINAL or (status, event) not in TRANSITIONS
            continue
        assert status not in TERMINAL
        if after in (JobStatus.COMPLETED, JobStatus.FAILED):
            assert status is JobStatus.RUNNING
        status = after


async def test_a_new_file_is_migrated_once_in_wal_mode_with_full_sync(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    store = SQLiteStore(path)
    assert store.schema_version() == len(MIGRATIONS)
    created = await store.create(job())
    store.close()
    again = SQLiteStore(path)  # reopening runs no migration twice, keeps the rows
    assert again.schema_version() == len(MIGRATIONS)
    assert await again.get("t", created.id) == created
    assert again._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert again._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    again.close()
    with sqlite3.connect(path) as raw:
        assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


async def test_claim_takes_higher_priority_first_then_oldest_and_respects_the_per_tenant_cap(open_store: OpenStore) -> None:
    clock = WallClock()
    store = open_store(clock=clock)
    a1, a2, a3 = [await store.create(job("a")) for _ in range(3)]
    b1 = await store.create(job("b"))
    urgent = await store.create(job("c", priority="interactive"))
    claimed = await store.claim(slots=10, per_tenant=2)
    assert [j.id for j in claimed] == [urgent.id, a1.id, a2.id, b1.id]
    assert all(j.status is JobStatus.RUNNING and j.attempts == 1 and j.started_at == 1000.0 for j in claimed)
    assert await store.claim(slots=10, per_tenant=2) == []  # a3 waits for a's slots
    await store.apply(a1.id, JobEvent.COMPLETE, result=b"{}")
    assert [j.id for j in await store.claim(slots=10, per_tenant=2)] == [a3.id]
    store.close()


async def test_a_requeued_job_waits_for_not_before(open_store: OpenStore) -> None:
    clock = WallClock()
    store = open_store(clock=clock)
    first = await store.create(job())
    await store.claim(slots=2, per_tenant=2)
    await store.apply(first.id, JobEvent.REQUEUE, not_before=1005.0)
    assert await store.claim(slots=2, per_tenant=2) == []
    clock.now = 1005.0
    assert [j.id for j in await store.claim(slots=2, per_tenant=2)] == [first.id]
    store.close()


async def test_only_jobs_whose_runner_stopped_renewing_its_lease_are_requeued(open_store: OpenStore) -> None:
    """Two runners (router processes) on one file: a's heartbeats keep its
    job; b went silent, so after the lease its job is back in the queue, and
    b, if it wakes up, finds it is no longer its own and cannot finish it."""
    clock = WallClock()
    store = open_store(clock=clock)
    alive, dead = await store.create(job("x")), await store.create(job("y"))
    await store.claim(slots=1, per_tenant=1, owner="a")
    await store.claim(slots=1, per_tenant=1, owner="b")
    clock.now += 20
    assert await store.heartbeat("a", [alive.id]) == set()
    assert await store.requeue_stale(30) == 0
    clock.now += 15  # a renewed 15 s ago, b 35 s ago
    assert await store.requeue_stale(30) == 1
    assert (await store.get("x", alive.id)).status is JobStatus.RUNNING  # type: ignore[union-attr]
    assert (await store.get("y", dead.id)).status is JobStatus.QUEUED  # type: ignore[union-attr]
    assert await store.heartbeat("b", [dead.id]) == {dead.id}  # b must stop it
    with pytest.raises(LeaseLost):
        await store.apply(dead.id, JobEvent.COMPLETE, owner="b", result=b"{}")
    # Cancelled by another process: a's next heartbeat says so.
    await store.cancel("x", alive.id)
    assert await store.heartbeat("a", [alive.id]) == {alive.id}
    store.close()


async def test_a_file_at_schema_version_1_is_migrated_keeping_its_jobs(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    with sqlite3.connect(path) as raw:
        raw.executescript(MIGRATIONS[0] + "; PRAGMA user_version = 1;")
        raw.execute("INSERT INTO jobs (id, tenant, kind, body, status, priority, metadata, created_at)"
                    " VALUES ('job_old', 't', 'chat', '{}', 'running', 'batch', '{}', 1)")  # fmt: skip
    raw.close()
    store = SQLiteStore(path)
    assert store.schema_version() == len(MIGRATIONS) == 4
    old = await store.get("t", "job_old")
    assert old is not None and old.status is JobStatus.RUNNING and old.heartbeat is None
    assert await store.requeue_stale(30) == 1  # a v1 runner left no lease: requeued at once
    store.close()


async def test_apply_refuses_a_transition_the_table_forbids_and_leaves_the_row(open_store: OpenStore) -> None:
    store = open_store()
    created = await store.create(job())
    with pytest.raises(InvalidTransition):
        await store.apply(created.id, JobEvent.COMPLETE)  # queued jobs do not complete
    cancelled = await store.apply(created.id, JobEvent.CANCEL)
    assert cancelled.status is JobStatus.CANCELLED and cancelled.finished_at is not None
    with pytest.raises(InvalidTransition):
        await store.apply(created.id, JobEvent.START)
    assert await store.get("t", created.id) == cancelled
    assert await store.get("other", created.id) is None
    with pytest.raises(KeyError):
        await store.apply("job_missing", JobEvent.CANCEL)
    store.close()


async def test_an_idempotency_key_is_busy_then_replayed_expires_after_the_ttl_and_a_dead_reservation_is_taken_over(
    open_store: OpenStore,
) -> None:
    clock = WallClock()
    store = open_store(clock=clock, idempotency_ttl=100, lease=10)
    assert await store.reserve("t", "k", "d1") == IdemReserved()
    assert await store.reserve("t", "k", "d1") == IdemBusy()
    assert await store.reserve("t", "k", "d2") == IdemMismatch()
    assert await store.reserve("u", "k", "d2") == IdemReserved()  # per tenant
    await store.complete_key("t", "k", 202, b'{"id":"job_1"}', "job_1")
    clock.now += 50
    assert await store.reserve("t", "k", "d1") == IdemReplay(202, b'{"id":"job_1"}')
    clock.now += 50
    assert await store.reserve("t", "k", "d2") == IdemReserved()  # 100 s on: forgotten
    clock.now += 10
    assert await store.reserve("t", "k", "d2") == IdemReserved()  # its request died 10 s ago: taken over
    store.close()


async def test_a_store_that_cannot_be_used_is_a_503_store_unavailable_not_a_raw_driver_error(open_store: OpenStore) -> None:
    store = open_store()
    store.close()
    with pytest.raises(StoreUnavailable) as raised:
        await store.get("t", "job_x")
    assert raised.value.status == 503 and raised.value.code == "store_unavailable"


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
FIELDS = st.sampled_from(["messages", "prompt", "model", "max_tokens", "metadata", "priority", "endpoint", "n", "stream", "temperature"])


@given(st.dictionaries(FIELDS, JSON | st.sampled_from(["batch", "/v1/generate", "m", "hi"]), max_size=6) | JSON)
def test_any_job_body_is_accepted_or_refused_with_a_client_error_never_anything_else(body: object) -> None:
    """What POST /v1/jobs does before storing: parse, then prepare the call."""
    context = RequestContext(request_id="r", tenant="t")
    try:
        parsed = parse_job(msgspec.json.encode(body))
        prepare_call(parsed.kind, parsed.body, FakeBackend(), context)
    except ClientError as exc:
        assert 400 <= exc.status < 500 and exc.message

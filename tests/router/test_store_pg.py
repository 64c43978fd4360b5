"""The PostgreSQL stores against a real server (tests/pgserver.py; skipped,
saying why, where none can start): migrations once for routers that start
together, the database's clock, a connection the server closed is replaced,
an unreachable server is a 503, claims from several stores (as from router
replicas) running each job once within the per-tenant cap, one reservation
of a new idempotency key among racing ones, and the batch store doing on
PostgreSQL exactly what it does on SQLite."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import trio

# Without psycopg (or, for its pure-Python build, without libpq) the module skips as a whole.
psycopg = pytest.importorskip("psycopg", reason="psycopg cannot be imported: pip install -e '.[dev]' (and libpq5)")

from router.batch_store import (  # noqa: E402
    Batch,
    BatchEvent,
    FileRecord,
    InvalidBatchTransition,
    SQLiteBatchStore,
)
from router.batch_store_pg import PostgresBatchStore  # noqa: E402
from router.store import (  # noqa: E402
    IdemBusy,
    IdemReserved,
    InvalidTransition,
    Job,
    JobEvent,
    JobStatus,
    SQLiteStore,
    StoreUnavailable,
    new_job_id,
)
from router.store_pg import MIGRATIONS, PostgresStore  # noqa: E402
from tests.pgserver import PGServer, free_port  # noqa: E402
from tests.router.test_jobs_store import WallClock  # noqa: E402


def job(tenant: str = "t", **fields: Any) -> Job:
    return Job(id=new_job_id(), tenant=tenant, kind="chat", body=b'{"messages": []}', **fields)


async def test_routers_that_start_together_migrate_the_database_once(pg_url: str) -> None:
    stores: list[PostgresStore] = []

    async def open_one() -> None:
        stores.append(await trio.to_thread.run_sync(PostgresStore, pg_url))

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(open_one)
    assert [s.schema_version() for s in stores] == [len(MIGRATIONS)] * 4
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SELECT count(*) FROM headrace_schema").fetchone() == (1,)
    created = await stores[0].create(job())
    assert await stores[3].get("t", created.id) == created  # one database
    for s in stores:
        s.close()
    again = PostgresStore(pg_url)  # reopening runs no migration twice, keeps the rows
    assert again.schema_version() == len(MIGRATIONS) and await again.get("t", created.id) == created
    again.close()


async def test_times_come_from_the_databases_clock(pg_url: str) -> None:
    store = PostgresStore(pg_url)
    with psycopg.connect(pg_url, autocommit=True) as conn:

        def db_now() -> float:
            row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
            assert row is not None
            return float(row[0])

        before = db_now()
        created = await store.create(job())
        [claimed] = await store.claim(slots=1, per_tenant=1, owner="a")
        done = await store.apply(created.id, JobEvent.COMPLETE, owner="a", result=b"{}")
        after = db_now()
    assert before <= created.created_at <= claimed.started_at <= done.finished_at <= after  # type: ignore[operator]
    store.close()


async def test_a_connection_the_server_closed_is_replaced(pg_url: str) -> None:
    store = PostgresStore(pg_url, pool_size=2)
    created = await store.create(job())
    with psycopg.connect(pg_url, autocommit=True) as conn:  # an administrator (or a failover) drops our sessions
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'headrace'")
    assert await store.get("t", created.id) == created
    store.close()


async def test_a_database_away_at_startup_is_a_503_per_call_until_it_is_there_then_migrated(pg_server: PGServer) -> None:
    """The router starts (and serves its other traffic) while the job store is
    away; each store call is a 503; once the database exists, the next call
    migrates it and works."""
    unreachable = PostgresStore(f"postgresql://headrace@127.0.0.1:{free_port()}/nowhere", timeout=2)
    with pytest.raises(StoreUnavailable) as raised:
        await unreachable.get("t", "job_x")
    assert raised.value.status == 503 and raised.value.code == "store_unavailable"
    unreachable.close()
    name = "later_" + new_job_id()[4:16]
    store = PostgresStore(pg_server.url(name), timeout=2)  # no such database yet
    with pytest.raises(StoreUnavailable):
        await store.create(job())
    with psycopg.connect(pg_server.url(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"'.encode())
    created = await store.create(job())
    assert await store.get("t", created.id) == created and store.schema_version() == len(MIGRATIONS)
    store.close()
    pg_server.drop_database(name)


async def test_claims_from_four_replicas_start_each_job_once_and_never_exceed_a_tenants_cap(pg_url: str) -> None:
    """Four stores (separate connection pools, as four router processes have)
    claim and finish 48 jobs of three tenants concurrently, per_tenant = 1."""
    stores = [PostgresStore(pg_url, pool_size=2) for _ in range(4)]
    ids = {(await stores[0].create(job(f"t{i % 3}"))).id for i in range(48)}
    started: list[str] = []
    running: dict[str, int] = {}
    most = 0

    async def replica(store: PostgresStore, owner: str) -> None:
        nonlocal most
        while len(started) < len(ids):
            claimed = await store.claim(slots=3, per_tenant=1, owner=owner)
            for j in claimed:
                started.append(j.id)
                running[j.tenant] = running.get(j.tenant, 0) + 1
                most = max(most, running[j.tenant])
            await trio.lowlevel.checkpoint()
            for j in claimed:
                running[j.tenant] -= 1  # before the commit that frees the slot: never a false overlap
                await store.apply(j.id, JobEvent.COMPLETE, owner=owner, result=b"{}")

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for i, store in enumerate(stores):
                nursery.start_soon(replica, store, f"r{i}")
    assert sorted(started) == sorted(ids) and most == 1
    done = [await stores[1].get(f"t{i % 3}", j) for i, j in enumerate(ids)]
    assert all(d is None or (d.status is JobStatus.COMPLETED and d.attempts == 1) for d in done)
    for store in stores:
        store.close()


async def test_a_cancel_racing_the_runners_finish_from_another_replica_leaves_whichever_came_first(pg_url: str) -> None:
    """20 times: the runner (one store) completes a job while a DELETE taken
    by another replica (another store) cancels it; exactly one wins, the
    other sees the winner's status, and the row says the winner's."""
    runner, other = PostgresStore(pg_url, pool_size=2), PostgresStore(pg_url, pool_size=2)
    for _ in range(20):
        created = await runner.create(job())
        await runner.claim(slots=1, per_tenant=1, owner="r")
        outcome: dict[str, object] = {}

        async def attempt(what: str, call: Any, out: dict[str, object] = outcome) -> None:
            try:
                out[what] = await call
            except InvalidTransition as exc:
                out[what] = exc.status

        async with trio.open_nursery() as nursery:
            nursery.start_soon(attempt, "complete", runner.apply(created.id, JobEvent.COMPLETE, owner="r", result=b"{}"))
            nursery.start_soon(attempt, "cancel", other.cancel("t", created.id))
        final = await other.get("t", created.id)
        assert final is not None
        if final.status is JobStatus.COMPLETED:
            assert outcome["cancel"] is JobStatus.COMPLETED and isinstance(outcome["complete"], Job)
        else:
            assert final.status is JobStatus.CANCELLED and outcome["complete"] is JobStatus.CANCELLED
            assert outcome["cancel"] == (JobStatus.RUNNING, final)
    runner.close()
    other.close()


async def test_idempotency_keys_past_their_ttl_are_deleted_on_the_runners_lease_tick(pg_url: str) -> None:
    clock = WallClock()
    store = PostgresStore(pg_url, clock=clock, idempotency_ttl=100)
    await store.reserve("t", "old", "d")
    clock.now += 60
    await store.reserve("t", "young", "d")
    clock.now += 50  # old: 110 s, young: 50 s
    await store.requeue_stale(30)
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SELECT key FROM idempotency").fetchall() == [("young",)]
    assert await store.reserve("t", "young", "d") == IdemBusy()  # still remembered
    store.close()


async def test_racing_reservations_of_a_new_idempotency_key_reserve_it_once(pg_url: str) -> None:
    stores = [PostgresStore(pg_url, pool_size=2) for _ in range(4)]
    results: list[object] = []

    async def reserve(store: PostgresStore) -> None:
        results.append(await store.reserve("t", "k", "d"))

    async with trio.open_nursery() as nursery:
        for store in stores * 2:
            nursery.start_soon(reserve, store)
    assert results.count(IdemReserved()) == 1 and results.count(IdemBusy()) == 7
    for store in stores:
        store.close()


# ---------------------------------------------------------------- batches: the same on both


async def batch_script(store: Any, clock: WallClock) -> list[Any]:
    """One batch's life through the store; every answer, for comparison."""
    out: list[Any] = []
    record = await store.create_file(FileRecord(id="file-in", tenant="t", purpose="batch", filename="in.jsonl"))
    await store.set_file("file-in", bytes=120, lines=3, status="processed")
    out += [record, await store.get_file("t", "file-in"), await store.get_file("u", "file-in")]
    batches = [await store.create_batch(Batch(id=f"batch_{i}", tenant="t", endpoint="/v1/chat/completions",
                                              input_file_id="file-in", completion_window="24h", expires_at=86400.0,
                                              output_file_id=f"file-o{i}", error_file_id=f"file-e{i}"))
               for i in range(3)]  # fmt: skip
    out += [batches, await store.get_file("t", "file-o0"), await store.get_batch("u", "batch_0")]
    page, more = await store.list_batches("t", after=None, limit=2)
    out += [[b.id for b in page], more, [b.id for b in (await store.list_batches("t", after="batch_1", limit=2))[0]]]
    with pytest.raises(KeyError):
        await store.list_batches("u", after="batch_1", limit=2)
    items = [Job(id=f"job_{n}", tenant="t", kind="chat", body=b"{}", batch_id="batch_0", line=n) for n in (1, 2, 3)]
    await store.add_items(items[:2])
    await store.add_items(items)  # a validation redone after a crash: lines 1 and 2 are not doubled
    clock.now += 5
    out.append(await store.move_batch("batch_0", BatchEvent.VALIDATED, total=3))
    with pytest.raises(InvalidBatchTransition):
        await store.move_batch("batch_0", BatchEvent.COMPLETE)
    with pytest.raises(KeyError):
        await store.move_batch("batch_missing", BatchEvent.CANCEL)
    out.append([b.id for b in await store.active_batches()])
    [claimed] = await store.store.claim(slots=1, per_tenant=1, owner="r")
    await store.store.apply(claimed.id, JobEvent.COMPLETE, owner="r", result=b'{"ok": 1}')
    await store.store.claim(slots=1, per_tenant=1, owner="r")  # line 2 running, line 3 queued
    out.append(sorted((s.value, n) for s, n in (await store.item_counts("batch_0")).items()))
    out.append([(j.line, j.status, j.result) for j in await store.items("batch_0", after_line=1, limit=5)])
    clock.now += 5
    out.append(await store.move_batch("batch_0", BatchEvent.CANCEL))
    out.append(await store.cancel_items("batch_0"))  # the running one, for its runner to stop
    out.append(sorted((s.value, n) for s, n in (await store.item_counts("batch_0")).items()))
    out.append(await store.move_batch("batch_0", BatchEvent.STOP))
    out.append((await store.store.list_jobs("t", after=None, limit=10))[0])  # items are not jobs of the list
    return out


async def test_the_batch_store_does_on_postgresql_what_it_does_on_sqlite(pg_url: str, tmp_path: Path) -> None:
    sqlite_clock, pg_clock = WallClock(), WallClock()
    on_sqlite = SQLiteBatchStore(SQLiteStore(tmp_path / "jobs.db", clock=sqlite_clock))
    on_pg = PostgresBatchStore(PostgresStore(pg_url, clock=pg_clock))
    expected, got = await batch_script(on_sqlite, sqlite_clock), await batch_script(on_pg, pg_clock)
    for i, (a, b) in enumerate(itertools.zip_longest(expected, got)):
        assert a == b, (i, a, b)
    assert got[-2].status.value == "cancelled" and got[-4] == ["job_2"]
    on_sqlite.store.close()
    on_pg.store.close()

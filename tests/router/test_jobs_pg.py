"""Jobs and batches on PostgreSQL through the real router: the HTTP API over
the PostgreSQL stores (a batch with good and bad lines, its output and
error files, idempotency, cancel, tenant isolation); and two router
processes (``headrace serve``) on one database, as replicas on two hosts
would be: jobs submitted to either are run by one or the other, each started
exactly once in total (the jobs' ``attempts`` in the database and the mock
backend's own count of requests), a tenant's ``per_tenant = 1`` holds
across both (its jobs' spans, on the database's clock, never overlap), and
a job submitted to one is read and cancelled through the other. A real
server (skipped, saying why, where none can start)."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

from backends.openai_http import OpenAIHTTPBackend
from router.app import NamedBackend, Router, key_digest
from router.config import decode_config
from tests.backends.conftest import serve_mock
from tests.router.test_batches import content, jsonl, line, start_batch, upload, wait_batch
from tests.router.test_faults import start_mock
from tests.router.test_integration import serve_router
from tests.router.test_jobs import FAST, chat, submit
from tests.router.test_jobs import wait_for as wait_job
from tests.router.test_jobs_kill import start_router

ALICE = {"authorization": "Bearer key-alice"}
BOB = {"authorization": "Bearer key-bob"}


async def test_jobs_and_batches_run_on_postgresql_through_the_router(nursery: trio.Nursery, pg_url: str, tmp_path: Path) -> None:
    served = await serve_mock(nursery, FAST)
    config = decode_config({
        "backends": [{"kind": "mock", "name": "m"}],
        "health": {"interval": 30},
        "auth": {"api_keys": [{"sha256": key_digest("key-alice"), "tenant": "alice"},
                              {"sha256": key_digest("key-bob"), "tenant": "bob"}]},
        "jobs": {"store": "postgres", "url": pg_url, "data_dir": str(tmp_path / "data"), "poll_interval": 0.05,
                 "per_tenant": 4, "lease": 1.0},
    })  # fmt: skip
    router = Router(config, [NamedBackend("m", OpenAIHTTPBackend(served.url, name="m"))])
    url = await serve_router(nursery, router)
    async with httpx.AsyncClient(base_url=url, timeout=10, headers=ALICE) as client:
        key = {"idempotency-key": "k-1"}
        job_id = await submit(client, chat(), headers=key)
        again = await client.post("/v1/jobs", json=chat(), headers=key)
        assert again.json()["id"] == job_id and again.headers["idempotent-replayed"] == "true"
        assert (await client.post("/v1/jobs", json=chat("other"), headers=key)).status_code == 422
        done = await wait_job(client, job_id, "completed")
        assert done["result"]["object"] == "chat.completion" and done["attempts"] == 1
        assert (await client.get(f"/v1/jobs/{job_id}", headers=BOB)).status_code == 404
        rows = [line("ok-0"), b"{not json", line("bad-body", messages="hi"), *(line(f"ok-{i}") for i in range(1, 6))]
        batch = await start_batch(client, jsonl(rows))
        finished = await wait_batch(client, batch["id"], "completed")
        assert finished["request_counts"] == {"total": 8, "completed": 6, "failed": 2}, finished
        assert [o["custom_id"] for o in await content(client, finished["output_file_id"])] == [f"ok-{i}" for i in range(6)]
        assert [e["error"]["line"] for e in await content(client, finished["error_file_id"])] == [2, 3]
        assert (await client.get(f"/v1/batches/{batch['id']}", headers=BOB)).status_code == 404
        listed = (await client.get("/v1/batches")).json()
        assert [b["id"] for b in listed["data"]] == [batch["id"]]
        assert [j["id"] for j in (await client.get("/v1/jobs")).json()["data"]] == [job_id]  # batch items are not listed
        assert (await upload(client, b"")).status_code == 400


@pytest.fixture
async def mock() -> AsyncIterator[str]:
    proc, url = await start_mock("--tpot-ms", "20")
    yield url
    proc.kill()
    await proc.wait()


async def wait_for(client: httpx.AsyncClient, job_id: str, status: str, headers: dict[str, str]) -> dict[str, object]:
    with trio.fail_after(30):
        while (job := (await client.get(f"/v1/jobs/{job_id}", headers=headers)).json())["status"] != status:
            assert job["status"] in ("queued", "running"), job
            await trio.sleep(0.05)
    return job  # type: ignore[no-any-return]


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_two_router_processes_on_one_database_start_each_job_once_and_share_the_tenant_cap(
    pg_url: str, mock: str, tmp_path: Path
) -> None:
    procs: list[trio.Process] = []
    urls: list[str] = []
    for i in range(2):
        config = tmp_path / f"router{i}.toml"
        config.write_text(f"""
[health]
interval = 30
[jobs]
store = "postgres"
url = "{pg_url}"
data_dir = "{tmp_path / f"data{i}"}"
per_tenant = 1
lease = 2.0
poll_interval = 0.05
[[auth.api_keys]]
sha256 = "{key_digest("key-alice")}"
tenant = "alice"
[[auth.api_keys]]
sha256 = "{key_digest("key-bob")}"
tenant = "bob"
[[backends]]
name = "m"
url = "{mock}"
""")
        proc, url = await start_router(config, patience=60)
        procs.append(proc)
        urls.append(url)
    body = {"prompt": "hi", "max_tokens": 5, "model": "m"}  # ~0.1 s a job
    try:
        async with httpx.AsyncClient(base_url=urls[0], timeout=10) as one, httpx.AsyncClient(base_url=urls[1], timeout=10) as two:
            where = [(one, ALICE), (two, ALICE), (one, BOB), (two, BOB)] * 4
            ids = []
            for client, headers in where:
                r = await client.post("/v1/jobs", json=body, headers=headers)
                assert r.status_code == 202, r.text
                ids.append(r.json()["id"])
            spans: dict[str, list[tuple[float, float]]] = {"alice": [], "bob": []}
            for job_id, (client, headers) in zip(ids, where, strict=True):
                other = two if client is one else one  # read through the router that did not take it
                job = await wait_for(other, job_id, "completed", headers)
                assert job["attempts"] == 1, job
                spans["alice" if headers is ALICE else "bob"].append((job["started_at"], job["finished_at"]))  # type: ignore[arg-type]
            # A job queued through one router, cancelled through the other.
            stuck = await one.post("/v1/jobs", json={**body, "max_tokens": 2000}, headers=ALICE)
            await wait_for(two, stuck.json()["id"], "running", ALICE)
            cancelled = await two.delete(f"/v1/jobs/{stuck.json()['id']}", headers=ALICE)
            assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
            assert (await one.get(f"/v1/jobs/{ids[0]}", headers=BOB)).status_code == 404  # tenant isolation holds
        async with httpx.AsyncClient(base_url=mock, timeout=10) as backend:
            with trio.fail_after(10):  # the cancelled job's runner lets go of its stream within a lease
                while (stats := (await backend.get("/stats")).json())["in_flight"]:
                    await trio.sleep(0.05)
        assert stats["completed"] == len(ids) and stats["started"] == len(ids) + 1, stats
        for tenant_spans in spans.values():
            ordered = sorted(tenant_spans)
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(ordered)), ordered
    finally:
        for proc in procs:
            proc.kill()
            await proc.wait()


PG_KILLS = 3
PG_LINES = 100


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_router_on_postgresql_sigkilled_mid_batch_finishes_it_with_every_item_exactly_once(
    pg_url: str, mock: str, tmp_path: Path
) -> None:
    """As the SQLite kill test (test_jobs_kill.py), on PostgreSQL: a batch of
    100 items, the router SIGKILLed 3 times while it validates and runs them;
    the batch completes, each custom_id is in the output file once, and every
    item row is completed once in the database."""
    import psycopg

    config = tmp_path / "router.toml"
    config.write_text(f"""
[health]
interval = 30
[jobs]
store = "postgres"
url = "{pg_url}"
data_dir = "{tmp_path / 'data'}"
per_tenant = 4
lease = 0.5
poll_interval = 0.05
[[backends]]
name = "m"
url = "{mock}"
""")
    rows = [{"custom_id": f"c-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "m", "prompt": f"p {i}", "max_tokens": 6}} for i in range(PG_LINES)]  # fmt: skip
    proc, url = await start_router(config, patience=60)
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        up = await upload(client, jsonl(rows))
        assert up.status_code == 200, up.text
        body = {"input_file_id": up.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
        created = await client.post("/v1/batches", json=body)
        assert created.status_code == 200, created.text
    batch_id = created.json()["id"]
    progress: list[int] = []  # items completed, after each restart
    try:
        for kill in range(PG_KILLS):
            await trio.sleep(0.15 + 0.1 * kill)  # mid-validation first, then mid-items
            proc.kill()  # SIGKILL: no shutdown code runs
            await proc.wait()
            proc, url = await start_router(config, patience=60)
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                progress.append((await client.get(f"/v1/batches/{batch_id}")).json()["request_counts"]["completed"])
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            done = await wait_batch(client, batch_id, "completed", within=60)
            output = await content(client, done["output_file_id"])
    finally:
        proc.kill()
        await proc.wait()
    assert done["request_counts"] == {"total": PG_LINES, "completed": PG_LINES, "failed": 0}
    assert progress[-1] < PG_LINES, progress  # the kills landed while it ran
    assert sorted(o["custom_id"] for o in output) == sorted(r["custom_id"] for r in rows)  # each once
    with psycopg.connect(pg_url) as conn:
        statuses = dict(conn.execute("SELECT status, count(*) FROM jobs WHERE batch_id = %s GROUP BY status", (batch_id,)).fetchall())
        lines = conn.execute("SELECT count(DISTINCT line), count(*) FROM jobs WHERE batch_id = %s", (batch_id,)).fetchone()
    assert statuses == {"completed": PG_LINES} and lines == (PG_LINES, PG_LINES)

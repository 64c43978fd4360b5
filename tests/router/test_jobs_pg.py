"""Two router processes (``headrace serve``) on one PostgreSQL database, as
replicas on two hosts would be: jobs submitted to either are run by one or
the other, each started exactly once in total (the jobs' ``attempts`` in
the database and the mock backend's own count of requests), a tenant's
``per_tenant = 1`` holds across both (its jobs' spans, on the database's
clock, never overlap), and a job submitted to one is read and cancelled
through the other. Real processes, a real server (skipped, saying why,
where none can start)."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

from router.app import key_digest
from tests.router.test_faults import start_mock

ALICE = {"authorization": "Bearer key-alice"}
BOB = {"authorization": "Bearer key-bob"}


async def start_router(config: Path) -> tuple[trio.Process, str]:
    command = [sys.executable, "-m", "router.cli", "serve", "--config", str(config), "--port", "0", "--workers", "1"]
    proc = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    buffer = b""
    with trio.fail_after(60):
        while b"headrace listening on " not in buffer or not buffer.endswith(b"\n"):
            chunk = await proc.stdout.receive_some()
            assert chunk, "the router exited before printing its URL"
            buffer += chunk
    line = next(x for x in buffer.decode().splitlines() if x.startswith("headrace listening on "))
    return proc, line.rsplit(" ", 1)[1]


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
        proc, url = await start_router(config)
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

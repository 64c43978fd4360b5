"""Real processes: a router killed with SIGKILL again and again while it
works off jobs; every acknowledged job completes, and the SQLite file passes
``PRAGMA integrity_check``."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

from tests.router.test_faults import start_mock

KILLS = 3


async def start_router(config: Path, *, patience: float = 30) -> tuple[trio.Process, str]:
    """``headrace serve --config`` in its own process, and its URL once it listens."""
    command = [sys.executable, "-m", "router.cli", "serve", "--config", str(config), "--port", "0", "--workers", "1"]
    proc = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    buffer = b""
    with trio.fail_after(patience):
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


@pytest.mark.slow
async def test_a_router_sigkilled_repeatedly_mid_jobs_loses_no_acknowledged_job(mock: str, tmp_path: Path) -> None:
    db = tmp_path / "jobs.db"
    config = tmp_path / "router.toml"
    config.write_text(f"""
[health]
interval = 30
[jobs]
path = "{db}"
per_tenant = 4
lease = 0.5
poll_interval = 0.05
[[backends]]
name = "m"
url = "{mock}"
""")
    body = {"prompt": "hi", "max_tokens": 10, "model": "m"}  # ~0.2 s a job
    acknowledged: list[str] = []
    cut_short: list[str] = []  # running just before their router was killed
    rerun: list[bool] = []  # for each: run again (requeued once its lease lapsed)?
    for _ in range(KILLS):
        proc, url = await start_router(config)
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            for _ in range(6):
                r = await client.post("/v1/jobs", json=body)
                assert r.status_code == 202, r.text
                acknowledged.append(r.json()["id"])
            await trio.sleep(0.3)  # some done, some running, some queued
            page = (await client.get("/v1/jobs", params={"limit": "100"})).json()["data"]
            cut_short += [j["id"] for j in page if j["status"] == "running"]
        proc.kill()  # SIGKILL: no shutdown code runs
        await proc.wait()
    proc, url = await start_router(config)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            with trio.fail_after(30):
                for job_id in acknowledged:
                    while (job := (await client.get(f"/v1/jobs/{job_id}")).json())["status"] != "completed":
                        assert job["status"] in ("queued", "running"), job.get("error")
                        await trio.sleep(0.05)
                    if job_id in cut_short:
                        rerun.append(job["attempts"] >= 2)
    finally:
        proc.kill()
        await proc.wait()
    with sqlite3.connect(db) as raw:
        assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        statuses = dict(raw.execute("SELECT status, count(*) FROM jobs GROUP BY status").fetchall())
    raw.close()
    assert statuses == {"completed": KILLS * 6}
    assert any(rerun), "no job was cut short by a kill"  # one may have finished between the look and the kill


BATCH_KILLS = int(os.environ.get("HEADRACE_KILL_SOAK", "20"))  # a soak: HEADRACE_KILL_SOAK=200 pytest -k mid_batch
BATCH_LINES = max(300, 15 * BATCH_KILLS)  # the kills land while items run


@pytest.mark.slow
async def test_a_router_sigkilled_20_times_mid_batch_finishes_it_with_every_item_exactly_once(mock: str, tmp_path: Path) -> None:
    """A batch of 300 items; the router is killed with SIGKILL 20 times (``HEADRACE_KILL_SOAK``) while
    it validates and runs them (each restart resumes: items cut short are
    requeued when their lease lapses). Then: the batch completes, each
    custom_id is in the output file exactly once, every item row is
    completed once, and the file passes ``PRAGMA integrity_check``."""
    config = tmp_path / "router.toml"
    config.write_text(f"""
[health]
interval = 30
[jobs]
data_dir = "{tmp_path / 'data'}"
per_tenant = 4
lease = 0.5
poll_interval = 0.05
[[backends]]
name = "m"
url = "{mock}"
""")
    rows = [{"custom_id": f"c-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "m", "prompt": f"p {i}", "max_tokens": 6}} for i in range(BATCH_LINES)]  # fmt: skip
    content = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    proc, url = await start_router(config)
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        up = await client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", content)})
        assert up.status_code == 200, up.text
        body = {"input_file_id": up.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
        created = await client.post("/v1/batches", json=body)
        assert created.status_code == 200, created.text
    batch_id = created.json()["id"]
    progress = []
    for kill in range(BATCH_KILLS):
        await trio.sleep(0.15 + 0.05 * (kill % 5))  # mid-validation first, then mid-items
        proc.kill()  # SIGKILL: no shutdown code runs
        await proc.wait()
        proc, url = await start_router(config)
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            progress.append((await client.get(f"/v1/batches/{batch_id}")).json()["request_counts"]["completed"])
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            with trio.fail_after(60 + BATCH_LINES / 10):
                while (batch := (await client.get(f"/v1/batches/{batch_id}")).json())["status"] != "completed":
                    assert batch["status"] in ("validating", "in_progress", "finalizing"), batch
                    await trio.sleep(0.05)
            out = (await client.get(f"/v1/files/{batch['output_file_id']}/content")).content.splitlines()
            errors = (await client.get(f"/v1/files/{batch['error_file_id']}/content")).content
    finally:
        proc.kill()
        await proc.wait()
    assert progress[-1] < BATCH_LINES, progress  # the kills landed while items were running
    assert batch["request_counts"] == {"total": BATCH_LINES, "completed": BATCH_LINES, "failed": 0}
    ids = [json.loads(x)["custom_id"] for x in out]
    assert ids == [f"c-{i}" for i in range(BATCH_LINES)] and errors == b""  # each once, in input order
    with sqlite3.connect(tmp_path / "data" / "headrace.db") as raw:
        assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        statuses = dict(raw.execute("SELECT status, count(*) FROM jobs WHERE batch_id = ? GROUP BY status", (batch_id,)).fetchall())
        rerun = raw.execute("SELECT count(*) FROM jobs WHERE batch_id = ? AND attempts >= 2", (batch_id,)).fetchone()[0]
    raw.close()
    assert statuses == {"completed": BATCH_LINES}
    assert rerun > 0, "no item was cut short by a kill"

"""Async jobs through the real router over loopback, to real mock servers,
durable in a real SQLite file: submit, poll, complete; cancel queued and
running; pagination; tenant isolation (404, never 403); Idempotency-Key
replay / 409 / 422; a runner killed mid-job and a new router finishing it."""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

import httpx
import trio

from backends.mock import Fault, MockConfig
from backends.openai_http import OpenAIHTTPBackend
from router.app import NamedBackend, Router, key_digest
from router.config import decode_config
from router.store import SQLiteStore
from tests.backends.conftest import Served, serve_mock
from tests.router.test_integration import serve_router

ALICE = {"authorization": "Bearer key-alice"}
BOB = {"authorization": "Bearer key-bob"}
FAST = MockConfig(name="m", models=("mock",))
SLOW = MockConfig(name="m", models=("mock",), ttft_s=30.0)


async def jobs_router(
    nursery: trio.Nursery, db: Path, mock: MockConfig = FAST, faults: list[Fault] | None = None, **jobs: Any
) -> tuple[Router, httpx.AsyncClient, Served]:
    """One mock server, and a router over it with ``[jobs] path = db`` and two tenants' keys."""
    served = await serve_mock(nursery, mock, faults or [])
    config = decode_config({
        "backends": [{"kind": "mock", "name": "m"}],
        "health": {"interval": 30},
        "auth": {"api_keys": [{"sha256": key_digest("key-alice"), "tenant": "alice"},
                              {"sha256": key_digest("key-bob"), "tenant": "bob"}]},
        "jobs": {"path": str(db), "poll_interval": 0.05, "retry_delay": 0.0, "lease": 0.3, **jobs},
    })  # fmt: skip
    router = Router(config, [NamedBackend("m", OpenAIHTTPBackend(served.url, name="m"))])
    url = await serve_router(nursery, router)
    return router, httpx.AsyncClient(base_url=url, timeout=10, headers=ALICE), served


def chat(text: str = "hi", **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 3, **fields}


async def submit(client: httpx.AsyncClient, body: dict[str, Any], **kw: Any) -> str:
    r = await client.post("/v1/jobs", json=body, **kw)
    assert r.status_code == 202, r.text
    assert r.json()["status"] == "queued"
    job_id: str = r.json()["id"]
    return job_id


async def wait_for(client: httpx.AsyncClient, job_id: str, *statuses: str, headers: dict[str, str] = ALICE) -> dict[str, Any]:
    with trio.fail_after(5):
        while True:
            job: dict[str, Any] = (await client.get(f"/v1/jobs/{job_id}", headers=headers)).json()
            if job["status"] in statuses:
                return job
            await trio.sleep(0.01)


async def test_a_job_is_acknowledged_queued_and_completes_with_the_answer_its_endpoint_gives(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    _, client, served = await jobs_router(nursery, tmp_path / "jobs.db")
    async with client:
        chat_id = await submit(client, chat(metadata={"run": "7"}))
        text_id = await submit(client, {"prompt": "hi", "max_tokens": 2})
        native_id = await submit(client, {"prompt": "hi", "max_tokens": 2, "endpoint": "/v1/generate"})
        done = await wait_for(client, chat_id, "completed")
        assert done["endpoint"] == "/v1/chat/completions" and done["metadata"] == {"run": "7"}
        assert done["result"]["object"] == "chat.completion" and done["result"]["usage"]["completion_tokens"] == 3
        assert done["started_at"] >= done["created_at"] and done["finished_at"] >= done["started_at"]
        assert (await wait_for(client, text_id, "completed"))["result"]["object"] == "text_completion"
        native = await wait_for(client, native_id, "completed")
        assert len(native["result"]["token_ids"]) == 2 and native["priority"] == "batch"
    assert served.backend.statistics().completed == 3


async def test_bad_input_gets_the_openai_error_shape_and_a_4xx_never_a_500(nursery: trio.Nursery, tmp_path: Path) -> None:
    _, client, served = await jobs_router(nursery, tmp_path / "jobs.db")
    cases: list[tuple[str, str, Any, int, str | None]] = [
        ("POST", "/v1/jobs", b"{not json", 400, None),
        ("POST", "/v1/jobs", b"[1]", 400, None),
        ("POST", "/v1/jobs", {**chat(), "priority": "urgent"}, 400, "priority"),
        ("POST", "/v1/jobs", {**chat(), "endpoint": "/v1/embeddings"}, 400, "endpoint"),
        ("POST", "/v1/jobs", {**chat(), "metadata": [1]}, 400, "metadata"),
        ("POST", "/v1/jobs", {"messages": "hi"}, 400, "messages"),
        ("POST", "/v1/jobs", {**chat(), "model": "nope"}, 404, "model"),
        ("GET", "/v1/jobs/job_missing", None, 404, "id"),
        ("DELETE", "/v1/jobs/job_missing", None, 404, "id"),
        ("GET", "/v1/jobs?limit=0", None, 400, "limit"),
        ("GET", "/v1/jobs?limit=x", None, 400, "limit"),
        ("GET", "/v1/jobs?after=job_missing", None, 400, "after"),
    ]
    async with client:
        for method, path, body, status, param in cases:
            content = body if isinstance(body, bytes) else None
            r = await client.request(method, path, content=content, json=None if content else body)
            assert r.status_code == status, (method, path, body, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["message"], r.text
            assert error["param"] == param, (path, body, error)
        assert (await client.get("/v1/jobs")).json()["data"] == []  # nothing bad was stored
    assert served.backend.statistics().started == 0


async def test_cancelling_a_queued_job_stops_it_running_and_cancelling_a_running_one_cancels_its_backend_request(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    router, client, served = await jobs_router(nursery, tmp_path / "jobs.db", SLOW, per_tenant=1)
    async with client:
        running = await submit(client, chat())
        queued = await submit(client, chat())
        await wait_for(client, running, "running")
        with trio.fail_after(5):
            while served.backend.statistics().in_flight == 0:
                await trio.sleep(0.01)
        assert (await client.get(f"/v1/jobs/{queued}")).json()["status"] == "queued"  # alice's cap is 1

        r = await client.delete(f"/v1/jobs/{queued}")
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        r = await client.delete(f"/v1/jobs/{running}")
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        with trio.fail_after(5):  # the runner's task let go of the backend stream
            while served.backend.statistics().in_flight or (router.jobs and router.jobs.statistics().running):
                await trio.sleep(0.01)
        await trio.sleep(0.1)  # the runner had time to (wrongly) start the queued one
        assert served.backend.statistics().started == 1
        assert (await client.delete(f"/v1/jobs/{running}")).json()["status"] == "cancelled"  # again: same answer
        for job_id in (running, queued):
            job = (await client.get(f"/v1/jobs/{job_id}")).json()
            assert job["status"] == "cancelled" and "result" not in job and job["finished_at"] is not None
    assert router.jobs is not None and router.jobs.statistics().cancelled == 1


async def test_a_finished_job_cannot_be_cancelled_409(nursery: trio.Nursery, tmp_path: Path) -> None:
    _, client, _ = await jobs_router(nursery, tmp_path / "jobs.db")
    async with client:
        job_id = await submit(client, chat())
        await wait_for(client, job_id, "completed")
        r = await client.delete(f"/v1/jobs/{job_id}")
        assert r.status_code == 409 and r.json()["error"]["code"] == "job_finished", r.text
        assert (await client.get(f"/v1/jobs/{job_id}")).json()["status"] == "completed"


async def test_the_list_is_the_tenants_jobs_newest_first_in_pages_by_cursor(nursery: trio.Nursery, tmp_path: Path) -> None:
    _, client, _ = await jobs_router(nursery, tmp_path / "jobs.db")
    async with client:
        ids = [await submit(client, chat(str(i))) for i in range(5)]
        await submit(client, chat(), headers=BOB)
        seen: list[str] = []
        after: str | None = None
        pages = []
        while True:
            params = {"limit": "2", **({"after": after} if after else {})}
            page = (await client.get("/v1/jobs", params=params)).json()
            seen += [j["id"] for j in page["data"]]
            pages.append((len(page["data"]), page["has_more"]))
            if not page["has_more"]:
                break
            after = page["last_id"]
            assert page["first_id"] == page["data"][0]["id"]
        assert seen == ids[::-1] and pages == [(2, True), (2, True), (1, False)]


async def test_another_tenants_job_is_a_404_never_a_403(nursery: trio.Nursery, tmp_path: Path) -> None:
    _, client, _ = await jobs_router(nursery, tmp_path / "jobs.db", SLOW)
    async with client:
        job_id = await submit(client, chat())
        for method in ("GET", "DELETE"):
            r = await client.request(method, f"/v1/jobs/{job_id}", headers=BOB)
            assert r.status_code == 404 and r.json()["error"]["param"] == "id", r.text
        assert (await client.get("/v1/jobs", headers=BOB)).json()["data"] == []
        r = await client.get("/v1/jobs", params={"after": job_id}, headers=BOB)
        assert r.status_code == 400  # alice's id is no cursor for bob
        assert (await client.get(f"/v1/jobs/{job_id}")).json()["status"] in ("queued", "running")  # bob's DELETE did nothing
        assert (await client.get("/v1/jobs", headers={"authorization": "Bearer wrong"})).status_code == 401


async def test_an_idempotency_key_replays_the_first_response_409_while_in_flight_422_for_another_body(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    router, client, _ = await jobs_router(nursery, tmp_path / "jobs.db")
    key = {"idempotency-key": "k-1"}
    async with client:
        first = await client.post("/v1/jobs", json=chat(), headers=key)
        again = await client.post("/v1/jobs", json=chat(), headers=key)
        assert first.status_code == again.status_code == 202 and again.json() == first.json()
        assert again.headers["idempotent-replayed"] == "true"
        other = await client.post("/v1/jobs", json=chat("other"), headers=key)
        assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused", other.text
        # Keys are per tenant: bob's k-1 is a job of his own.
        bobs = await client.post("/v1/jobs", json=chat("other"), headers={**key, **BOB})
        assert bobs.status_code == 202 and bobs.json()["id"] != first.json()["id"]
        # A first request still in flight (reserved, no response yet): 409.
        assert router.job_store is not None
        body = json.dumps(chat()).encode()
        await router.job_store.reserve("alice", "k-2", hashlib.sha256(b"/v1/jobs\0" + body).hexdigest())  # path and body
        busy = await client.post("/v1/jobs", content=body, headers={"idempotency-key": "k-2"})
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "idempotency_key_in_use", busy.text
        # A body that fails validation does not use the key up.
        bad = await client.post("/v1/jobs", json={"messages": 1}, headers={"idempotency-key": "k-3"})
        assert bad.status_code == 400
        assert (await client.post("/v1/jobs", json=chat(), headers={"idempotency-key": "k-3"})).status_code == 202
        long_key = await client.post("/v1/jobs", json=chat(), headers={"idempotency-key": "k" * 256})
        assert long_key.status_code == 400 and long_key.json()["error"]["param"] == "idempotency-key"
        await wait_for(client, first.json()["id"], "completed")
        assert len((await client.get("/v1/jobs")).json()["data"]) == 2  # k-1 once, k-3 once


async def test_upstream_errors_are_retried_up_to_max_attempts_then_the_job_fails_with_the_error(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    _, client, _ = await jobs_router(nursery, tmp_path / "jobs.db", faults=[Fault(kind="status", status=500)],
                                          max_attempts=2)  # fmt: skip
    async with client:
        job_id = await submit(client, chat())
        job = await wait_for(client, job_id, "failed")
    assert job["attempts"] == job["errors"] == 2 and job["error"]["type"] in ("server_error", "upstream_error"), job
    assert "result" not in job


async def test_a_job_acknowledged_before_the_runner_died_is_completed_by_the_next_router_on_the_same_file(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    db = tmp_path / "jobs.db"
    async with trio.open_nursery() as doomed:
        _, client, served = await jobs_router(doomed, db, SLOW)
        async with client:
            started = await submit(client, chat("started"))
            await wait_for(client, started, "running")
            waiting = [await submit(client, chat(f"w{i}")) for i in range(3)]  # per_tenant 2: one stays queued
        doomed.cancel_scope.cancel()  # the router dies mid-job: no chance to tidy up
    router, client, served = await jobs_router(nursery, db)
    async with client:
        for job_id in (started, *waiting):
            assert (await wait_for(client, job_id, "completed"))["result"]["choices"][0]["finish_reason"]
    assert router.jobs is not None and router.jobs.statistics().recovered >= 1
    assert served.backend.statistics().completed == 4


async def test_without_a_jobs_path_there_is_no_jobs_api(nursery: trio.Nursery) -> None:
    served = await serve_mock(nursery, FAST)
    router = Router(decode_config({"backends": [{"kind": "mock", "name": "m"}]}),
                    [NamedBackend("m", OpenAIHTTPBackend(served.url, name="m"))])  # fmt: skip
    url = await serve_router(nursery, router)
    async with httpx.AsyncClient(base_url=url) as client:
        assert (await client.post("/v1/jobs", json=chat())).status_code == 404
    assert router.jobs is None


async def test_two_routers_on_one_file_share_the_queue_and_run_each_job_once_though_jobs_outlast_the_lease(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """As ``[server] workers`` processes do: each job runs about 1.5 s,
    longer than the 1 s lease, so only the heartbeats (every 1/3 s) keep the
    other router from requeueing it; ``per_tenant = 1`` holds across both
    (no two of a tenant's jobs overlap). The lease leaves room for a loaded
    CI box, where a 0.3 s lease lost heartbeats and ran a job twice."""
    db = tmp_path / "jobs.db"
    steady = MockConfig(name="m", models=("mock",), tpot_s=0.05)
    first, client, served = await jobs_router(nursery, db, steady, per_tenant=1, lease=1.0)
    second, other, served_2 = await jobs_router(nursery, db, steady, per_tenant=1, lease=1.0)
    async with client, other:
        where = ((client, ALICE), (other, BOB)) * 3
        ids = [await submit(c, chat(max_tokens=30), headers=h) for c, h in where]
        spans: dict[str, list[tuple[float, float]]] = {"alice": [], "bob": []}
        for job_id, (c, h) in zip(ids, where, strict=True):
            job = await wait_for(c, job_id, "completed", headers=h)
            assert job["attempts"] == 1, job
            spans["alice" if h is ALICE else "bob"].append((job["started_at"], job["finished_at"]))
    for tenant_spans in spans.values():
        ordered = sorted(tenant_spans)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(ordered)), ordered
    assert served.backend.statistics().completed + served_2.backend.statistics().completed == 6
    assert first.jobs is not None and second.jobs is not None
    assert first.jobs.statistics().recovered == second.jobs.statistics().recovered == 0
    # Each job started once, by one router or the other (which one wins a claim
    # is up to the scheduler: on a loaded box one router can take them all).
    assert first.jobs.statistics().started + second.jobs.statistics().started == 6


async def test_a_job_cancelled_through_another_process_stops_running_within_the_lease(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    db = tmp_path / "jobs.db"
    router, client, served = await jobs_router(nursery, db, SLOW)
    async with client:
        job_id = await submit(client, chat())
        await wait_for(client, job_id, "running")
        elsewhere = SQLiteStore(db)  # another worker process's connection took the DELETE
        await elsewhere.cancel("alice", job_id)
        elsewhere.close()
        with trio.fail_after(2):  # lease 0.3 s: a heartbeat every 0.1 s
            while router.jobs is not None and router.jobs.statistics().running:
                await trio.sleep(0.01)
        job = (await client.get(f"/v1/jobs/{job_id}")).json()
    assert job["status"] == "cancelled" and "result" not in job
    with trio.fail_after(2):
        while served.backend.statistics().in_flight:
            await trio.sleep(0.01)

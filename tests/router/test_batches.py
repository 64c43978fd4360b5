"""Files and batches in the OpenAI Batch API shape, through the real router
over loopback to a real mock server, durable in a real SQLite file and data
directory: the lifecycle, output and error files, partial output, cancel,
bad input (a bad line fails only itself), tenant isolation (404), pagination."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import trio

from tests.router.test_jobs import BOB, SLOW, jobs_router


def line(custom_id: str, text: str = "hi", url: str = "/v1/chat/completions", **body: Any) -> dict[str, Any]:
    payload = {"messages": [{"role": "user", "content": text}], "max_tokens": 2, **body}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": payload}


def jsonl(rows: list[Any]) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


async def upload(client: httpx.AsyncClient, content: bytes, purpose: str = "batch", **kw: Any) -> httpx.Response:
    return await client.post("/v1/files", data={"purpose": purpose}, files={"file": ("in.jsonl", content)}, **kw)


async def start_batch(client: httpx.AsyncClient, content: bytes, **fields: Any) -> dict[str, Any]:
    r = await upload(client, content)
    assert r.status_code == 200, r.text
    body = {"input_file_id": r.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h", **fields}
    created = await client.post("/v1/batches", json=body)
    assert created.status_code == 200, created.text
    batch: dict[str, Any] = created.json()
    assert batch["status"] == "validating" and batch["object"] == "batch"
    return batch


async def wait_batch(client: httpx.AsyncClient, batch_id: str, *statuses: str, within: float = 10) -> dict[str, Any]:
    with trio.fail_after(within):
        while True:
            batch: dict[str, Any] = (await client.get(f"/v1/batches/{batch_id}")).json()
            if batch["status"] in statuses:
                return batch
            await trio.sleep(0.02)


async def content(client: httpx.AsyncClient, file_id: str) -> list[dict[str, Any]]:
    r = await client.get(f"/v1/files/{file_id}/content")
    assert r.status_code == 200, r.text
    return [json.loads(x) for x in r.content.splitlines()]


async def test_a_batch_validates_runs_and_completes_with_each_line_once_in_the_output_file(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    _, client, served = await jobs_router(nursery, tmp_path / "jobs.db", per_tenant=4)
    rows = [line(f"req-{i}", f"question {i}") for i in range(12)]
    async with client:
        up = await upload(client, jsonl(rows))
        assert up.json()["bytes"] == len(jsonl(rows)) and up.json()["purpose"] == "batch"
        assert (tmp_path / "files" / f"{up.json()['id']}.jsonl").read_bytes() == jsonl(rows)  # on disk, in the data dir
        assert (await client.get(f"/v1/files/{up.json()['id']}/content")).content == jsonl(rows)
        batch = await start_batch(client, jsonl(rows), metadata={"run": "1"})
        done = await wait_batch(client, batch["id"], "completed")
        assert done["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
        assert done["in_progress_at"] and done["finalizing_at"] and done["completed_at"] and done["metadata"] == {"run": "1"}
        output = await content(client, done["output_file_id"])
        assert [o["custom_id"] for o in output] == [f"req-{i}" for i in range(12)]  # input order
        first = output[0]
        assert first["id"].startswith("batch_req_") and first["error"] is None
        assert first["response"]["status_code"] == 200 and first["response"]["body"]["object"] == "chat.completion"
        assert await content(client, done["error_file_id"]) == []
        meta = (await client.get(f"/v1/files/{done['output_file_id']}")).json()
        assert meta["purpose"] == "batch_output" and meta["status"] == "processed" and meta["bytes"] > 0
        body = {"input_file_id": up.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        second = (await client.post("/v1/batches", json=body)).json()
        await wait_batch(client, second["id"], "completed")
        listed = (await client.get("/v1/batches", params={"limit": "1"})).json()
        assert [b["id"] for b in listed["data"]] == [second["id"]] and listed["has_more"] is True  # newest first
        older = (await client.get("/v1/batches", params={"after": second["id"]})).json()
        assert [b["id"] for b in older["data"]] == [batch["id"]] and older["has_more"] is False
        assert (await client.get("/v1/jobs")).json()["data"] == []  # items are not in the jobs list
    assert served.backend.statistics().completed == 24


async def test_a_malformed_line_fails_only_that_line_with_its_line_number_in_the_error_file(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    _, client, served = await jobs_router(nursery, tmp_path / "jobs.db", per_tenant=4)
    rows: list[Any] = [
        line("ok-1"),
        b"{not json",
        {"method": "POST", "url": "/v1/chat/completions", "body": {}},  # no custom_id
        line("ok-1"),  # duplicate custom_id
        line("wrong-url", url="/v1/completions"),
        line("bad-body", messages="hi"),
        line("no-model", model="nope"),
        b"   ",  # blank: skipped
        line("ok-2"),
    ]
    async with client:
        batch = await start_batch(client, jsonl(rows))
        done = await wait_batch(client, batch["id"], "completed")
        assert done["request_counts"] == {"total": 8, "completed": 2, "failed": 6}
        assert [o["custom_id"] for o in await content(client, done["output_file_id"])] == ["ok-1", "ok-2"]
        errors = await content(client, done["error_file_id"])
        assert [e["error"]["line"] for e in errors] == [2, 3, 4, 5, 6, 7]
        assert [e["error"]["code"] for e in errors[:4]] == ["invalid_json", "missing_custom_id", "duplicate_custom_id",
                                                              "mismatched_endpoint"]  # fmt: skip
        assert all(e["response"] is None and e["error"]["message"].startswith(f"line {e['error']['line']}:") for e in errors)
        # Every line bad: the batch fails, saying why.
        failed = await wait_batch(client, (await start_batch(client, jsonl([b"[1]", b"nope"])))["id"], "failed")
        assert [e["line"] for e in failed["errors"]["data"]] == [1, 2] and failed["failed_at"]
    assert served.backend.statistics().completed == 2


async def test_bad_files_and_batch_requests_get_clear_400s_in_the_openai_shape(nursery: trio.Nursery, tmp_path: Path) -> None:
    _, client, served = await jobs_router(nursery, tmp_path / "jobs.db", max_file_bytes=1000, max_batch_lines=3)
    async with client:
        good = (await upload(client, jsonl([line("a")]))).json()["id"]
        four = (await upload(client, jsonl([line(str(i)) for i in range(4)]))).json()["id"]
        cases: list[tuple[httpx.Response, int, str | None]] = [
            (await upload(client, b""), 400, "file"),
            (await upload(client, b"x" * 1001), 413, "file"),
            (await upload(client, jsonl([line("a")]), purpose="fine-tune"), 400, "purpose"),
            (await client.post("/v1/files", content=b"{}", headers={"content-type": "application/json"}), 400, None),
            (await client.post("/v1/files", data={"purpose": "batch"}), 400, None),
        ]
        batch: dict[str, Any] = {"input_file_id": good, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        changes: list[tuple[dict[str, Any], int, str]] = [
            ({"endpoint": "/v1/embeddings"}, 400, "endpoint"),
            ({"completion_window": "1h"}, 400, "completion_window"),
            ({"completion_window": None}, 400, "completion_window"),
            ({"input_file_id": "file-missing"}, 404, "input_file_id"),
            ({"input_file_id": four}, 400, "input_file_id"),  # over max_batch_lines
            ({"metadata": [1]}, 400, "metadata"),
        ]
        for change, code, name in changes:
            cases.append((await client.post("/v1/batches", json={**batch, **change}), code, name))
        cases.append((await client.post("/v1/batches", content=b"{nope"), 400, None))
        for path in ("/v1/batches/batch_missing", "/v1/files/file-missing", "/v1/files/file-missing/content"):
            cases.append((await client.get(path), 404, "id"))
        cases.append((await client.post("/v1/batches/batch_missing/cancel"), 404, "id"))
        cases.append((await client.get("/v1/batches", params={"limit": "0"}), 400, "limit"))
        for i, (r, status, param) in enumerate(cases):
            assert r.status_code == status, (i, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param, (i, error)
        assert (await client.get("/v1/batches")).json()["data"] == []
        # An output file is no batch input.
        done = await wait_batch(client, (await start_batch(client, jsonl([line("a")])))["id"], "completed")
        r = await client.post("/v1/batches", json={**batch, "input_file_id": done["output_file_id"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_file_id"
    assert not list((tmp_path / "files").glob(".*.part"))  # refused uploads leave nothing behind
    assert served.backend.statistics().completed == 1


async def test_another_tenants_files_and_batches_are_404s_never_403s(nursery: trio.Nursery, tmp_path: Path) -> None:
    _, client, _ = await jobs_router(nursery, tmp_path / "jobs.db")
    async with client:
        batch = await start_batch(client, jsonl([line("a")]))
        done = await wait_batch(client, batch["id"], "completed")
        for path in (f"/v1/batches/{batch['id']}", f"/v1/files/{batch['input_file_id']}",
                     f"/v1/files/{batch['input_file_id']}/content", f"/v1/files/{done['output_file_id']}/content"):  # fmt: skip
            r = await client.get(path, headers=BOB)
            assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error", (path, r.text)
        assert (await client.post(f"/v1/batches/{batch['id']}/cancel", headers=BOB)).status_code == 404
        theirs = {"input_file_id": batch["input_file_id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        assert (await client.post("/v1/batches", json=theirs, headers=BOB)).status_code == 404
        assert (await client.get("/v1/batches", headers=BOB)).json()["data"] == []
        assert (await client.get("/v1/batches", params={"after": batch["id"]}, headers=BOB)).status_code == 400


async def test_partial_output_is_readable_while_a_batch_runs_and_a_cancel_keeps_what_completed(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    _, client, served = await jobs_router(nursery, tmp_path / "jobs.db", SLOW, per_tenant=1)
    async with client:
        fast = [line("quick", max_tokens=1)]
        rows = fast + [line(f"slow-{i}") for i in range(3)]
        batch = await start_batch(client, jsonl(rows))
        running = await wait_batch(client, batch["id"], "in_progress")
        assert running["request_counts"]["total"] == 4
        with trio.fail_after(5):  # the first item runs (slow: ttft 30 s): its job is running
            while served.backend.statistics().started < 1:
                await trio.sleep(0.02)
        assert await content(client, running["output_file_id"]) == []  # nothing done yet, readable
        cancelled = await client.post(f"/v1/batches/{batch['id']}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] in ("cancelling", "cancelled")
        done = await wait_batch(client, batch["id"], "cancelled")
        assert done["cancelling_at"] and done["cancelled_at"]
        again = await client.post(f"/v1/batches/{batch['id']}/cancel")
        assert again.status_code == 200 and again.json()["status"] == "cancelled"
        errors = await content(client, done["error_file_id"])
        assert sorted(e["custom_id"] for e in errors) == ["quick", "slow-0", "slow-1", "slow-2"]
        assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
        with trio.fail_after(5):  # the running item's backend request was cancelled
            while served.backend.statistics().cancelled < 1:
                await trio.sleep(0.02)
        assert (await client.post(f"/v1/batches/{batch['id']}/cancel")).json()["status"] == "cancelled"


async def test_partial_output_lists_the_lines_done_so_far(nursery: trio.Nursery, tmp_path: Path) -> None:
    router, client, _ = await jobs_router(nursery, tmp_path / "jobs.db", per_tenant=1)
    async with client:
        batch = await start_batch(client, jsonl([line(f"r-{i}") for i in range(30)]))
        seen: list[int] = []
        with trio.fail_after(10):
            while (b := (await client.get(f"/v1/batches/{batch['id']}")).json())["status"] != "completed":
                if b["status"] == "in_progress":
                    out = await content(client, b["output_file_id"])
                    assert [o["custom_id"] for o in out] == [f"r-{i}" for i in range(len(out))]
                    seen.append(len(out))
                await trio.sleep(0.01)
        assert any(0 < n < 30 for n in seen), seen  # read while part of it was done
        assert len(await content(client, b["output_file_id"])) == 30
        assert router.data is not None and router.data.batches.statistics().validated == 1


async def test_a_batch_whose_input_file_is_gone_from_disk_fails_saying_so(nursery: trio.Nursery, tmp_path: Path) -> None:
    _, client, _ = await jobs_router(nursery, tmp_path / "jobs.db")
    async with client:
        file_id = (await upload(client, jsonl([line("a")]))).json()["id"]
        (tmp_path / "files" / f"{file_id}.jsonl").unlink()
        assert (await client.get(f"/v1/files/{file_id}/content")).status_code == 404
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        batch = (await client.post("/v1/batches", json=body)).json()
        failed = await wait_batch(client, batch["id"], "failed")
        assert failed["errors"]["data"][0]["code"] == "input_file_missing"


async def test_a_batch_past_its_completion_window_expires_keeping_what_completed(nursery: trio.Nursery, tmp_path: Path) -> None:
    """The window is 24 h; here the batch's ``expires_at`` is moved into the
    past in the SQLite file while its items wait behind a slow one."""
    _, client, served = await jobs_router(nursery, tmp_path / "jobs.db", SLOW, per_tenant=1)
    async with client:
        batch = await start_batch(client, jsonl([line(f"r-{i}") for i in range(3)]))
        running = await wait_batch(client, batch["id"], "in_progress")
        assert running["expires_at"] - running["created_at"] == 24 * 3600
        with sqlite3.connect(tmp_path / "jobs.db") as raw:
            raw.execute("UPDATE batches SET expires_at = 0 WHERE id = ?", (batch["id"],))
        raw.close()
        expired = await wait_batch(client, batch["id"], "expired")
        assert expired["expired_at"] and expired["request_counts"]["completed"] == 0
        errors = await content(client, expired["error_file_id"])
        assert [e["custom_id"] for e in errors] == ["r-0", "r-1", "r-2"] and {e["error"]["code"] for e in errors} == {"batch_expired"}
        assert (await client.post(f"/v1/batches/{batch['id']}/cancel")).status_code == 409
    assert served.backend.statistics().completed == 0


async def test_mangled_batch_and_upload_requests_are_4xx_in_the_openai_shape_never_5xx(nursery: trio.Nursery, tmp_path: Path) -> None:
    """A seeded sweep of wrong types in each field of POST /v1/batches, and
    of broken multipart bodies (cut short, no boundary, stray parts, binary)."""
    import random

    _, client, _ = await jobs_router(nursery, tmp_path / "jobs.db", max_file_bytes=4096)
    rng = random.Random(16)
    junk: list[Any] = [None, 1, -1.5, True, "", "x" * 300, [], [1], {}, {"a": 1}, "/v1/chat/completions", "24h", "\udc80"]
    async with client:
        good = (await upload(client, jsonl([line("a")]))).json()["id"]
        base = {"input_file_id": good, "endpoint": "/v1/chat/completions", "completion_window": "24h", "metadata": {}}
        responses = []
        for _ in range(40):
            body = dict(base)
            for field in rng.sample(sorted(base), rng.randint(1, 3)):
                if rng.random() < 0.2:
                    body.pop(field)
                else:
                    body[field] = rng.choice(junk)
            raw = json.dumps(body, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")
            responses.append(await client.post("/v1/batches", content=raw))
        multipart = (b"--B\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                     b"--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.jsonl\"\r\n\r\n{}\n\r\n--B--\r\n")  # fmt: skip
        for _ in range(40):
            cut = multipart[: rng.randint(0, len(multipart))]
            mangled = bytearray(cut)
            for _ in range(rng.randint(0, 3)):
                if mangled:
                    mangled[rng.randrange(len(mangled))] = rng.randrange(256)
            ctype = rng.choice(["multipart/form-data; boundary=B", "multipart/form-data", "multipart/form-data; boundary=",
                                "text/plain", "multipart/form-data; boundary=\"B\""])  # fmt: skip
            responses.append(await client.post("/v1/files", content=bytes(mangled), headers={"content-type": ctype}))
        for r in responses:  # some mutations leave a valid request (a field dropped that may be)
            assert r.status_code == 200 or 400 <= r.status_code < 500, r.text
            if r.status_code != 200:
                error = r.json()["error"]
                assert error["type"] == "invalid_request_error" and error["message"], r.text
        assert sum(r.status_code >= 400 for r in responses) > 60  # the sweep mostly hit refusals

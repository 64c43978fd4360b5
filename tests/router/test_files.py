"""The data directory (flag, environment, config, per-user default),
``Idempotency-Key`` on every POST, and a 10k-line batch handled with flat
memory: the real router over loopback, a real SQLite file."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import trio

from router.config import JobsConfig
from router.data import default_data_dir, resolve_data_dir, with_data_dir
from router.server import config_from_args, parse_args
from tests.router.test_batches import jsonl, line, start_batch, upload, wait_batch
from tests.router.test_jobs import BOB, jobs_router


def test_the_data_directory_comes_from_the_flag_then_the_environment_then_config_then_the_per_user_default(
    tmp_path: Path,
) -> None:
    env = {"HEADRACE_DATA_DIR": str(tmp_path / "env"), "XDG_DATA_HOME": str(tmp_path / "xdg")}
    config = JobsConfig(data_dir=str(tmp_path / "cfg"))
    assert with_data_dir(config, str(tmp_path / "flag"), env).data_dir == str(tmp_path / "flag")
    assert with_data_dir(config, None, env).data_dir == str(tmp_path / "env")
    assert with_data_dir(config, None, {}).data_dir == str(tmp_path / "cfg")
    assert default_data_dir(env) == tmp_path / "xdg" / "headrace"
    assert default_data_dir({}) == Path.home() / ".local" / "share" / "headrace"
    assert resolve_data_dir(JobsConfig()) is None  # off unless asked for
    assert resolve_data_dir(config) == (tmp_path / "cfg", tmp_path / "cfg" / "headrace.db")
    assert (tmp_path / "cfg" / "files").is_dir()
    # [jobs] path alone (the older spelling): its directory holds the files.
    assert resolve_data_dir(JobsConfig(path=str(tmp_path / "p" / "j.db"))) == (tmp_path / "p", tmp_path / "p" / "j.db")
    args = parse_args(["--data-dir", str(tmp_path / "flag")])
    assert config_from_args(args).jobs.data_dir == str(tmp_path / "flag")


async def test_an_idempotency_key_on_each_post_replays_the_stored_answer_without_new_work(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    _, client, served = await jobs_router(nursery, tmp_path / "jobs.db")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with client:
        file_id = (await upload(client, jsonl([line("a")]), headers={"idempotency-key": "f"})).json()["id"]
        batch = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        posts: list[tuple[str, dict[str, Any]]] = [
            ("/v1/chat/completions", chat),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
            ("/v1/generate", {"prompt": "hi", "max_tokens": 2}),
            ("/v1/jobs", chat),
            ("/v1/batches", batch),
        ]
        for i, (path, body) in enumerate(posts):
            key = {"idempotency-key": f"k-{i}"}
            first = await client.post(path, json=body, headers=key)
            assert first.status_code in (200, 202), (path, first.text)
            started = served.backend.statistics().started
            again = await client.post(path, json=body, headers=key)
            assert (again.status_code, again.content) == (first.status_code, first.content), path
            assert again.headers["idempotent-replayed"] == "true"
            if path not in ("/v1/jobs", "/v1/batches"):  # those work later: counted below
                assert served.backend.statistics().started == started, path  # no new work
            other = await client.post(path, json={**body, "max_tokens": 1}, headers=key)
            assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused", path
            theirs = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={**key, **BOB})
            assert theirs.status_code == 200 and "idempotent-replayed" not in theirs.headers  # per tenant
            elsewhere = await client.post("/v1/generate" if path == "/v1/completions" else "/v1/completions", json=body, headers=key)
            assert elsewhere.status_code == 422, path  # one key, another endpoint
        # The upload: a repeat answers the first file, and stores no second copy.
        stored = [p.read_bytes() for p in (tmp_path / "files").glob("file-*.jsonl")].count(jsonl([line("a")]))
        again = await upload(client, jsonl([line("a")]), headers={"idempotency-key": "f"})
        assert again.json()["id"] == file_id and again.headers["idempotent-replayed"] == "true"
        assert [p.read_bytes() for p in (tmp_path / "files").glob("file-*.jsonl")].count(jsonl([line("a")])) == stored == 1
        assert not list((tmp_path / "files").glob(".*.part"))
        b = (await client.post("/v1/batches", json=batch, headers={"idempotency-key": "k-4"})).json()
        await wait_batch(client, b["id"], "completed")
        assert len((await client.get("/v1/jobs")).json()["data"]) == len((await client.get("/v1/batches")).json()["data"]) == 1
        cancel = await client.post(f"/v1/batches/{b['id']}/cancel", headers={"idempotency-key": "c"})
        assert cancel.status_code == 409  # a completed batch: refused, and the key not used up
        assert (await client.post(f"/v1/batches/{b['id']}/cancel", headers={"idempotency-key": "c"})).status_code == 409
        # A streamed answer is not stored: its repeat says so (409), and does no new work.
        stream = {**chat, "stream": True}
        first = await client.post("/v1/chat/completions", json=stream, headers={"idempotency-key": "s"})
        assert first.status_code == 200 and b"[DONE]" in first.content
        started = served.backend.statistics().started
        again = await client.post("/v1/chat/completions", json=stream, headers={"idempotency-key": "s"})
        assert again.status_code == 409 and again.json()["error"]["code"] == "idempotency_key_stream_consumed"
        assert served.backend.statistics().started == started
        # A request that fails (here: an unknown model) leaves the key free.
        bad = await client.post("/v1/completions", json={"prompt": "x", "model": "nope"}, headers={"idempotency-key": "e"})
        assert bad.status_code == 404
        ok = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"idempotency-key": "e"})
        assert ok.status_code == 200


@pytest.mark.slow
async def test_a_10k_line_batch_is_uploaded_validated_and_written_with_flat_memory(nursery: trio.Nursery, tmp_path: Path) -> None:
    """6 MB of input in 10,000 lines, every one refused at validation (an
    unknown model: no backend calls, so it stays fast): the upload goes to
    disk, the lines are read in blocks, the error file is written and served
    a page at a time. Python's allocations peak far below the file's size."""
    _, client, served = await jobs_router(nursery, tmp_path / "jobs.db", max_file_bytes=64 * 1024 * 1024)
    pad = "x" * 600
    rows = [line(f"r-{i}", pad, model="nope") for i in range(10_000)]
    data = jsonl(rows)
    del rows
    async with client:
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            batch = await start_batch(client, data)
            failed = await wait_batch(client, batch["id"], "failed", within=120)
            size, first = 0, b""
            async with client.stream("GET", f"/v1/files/{failed['error_file_id']}/content") as r:
                async for chunk in r.aiter_bytes():
                    size += len(chunk)
                    first = first or chunk
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
    assert failed["request_counts"] == {"total": 10_000, "completed": 0, "failed": 10_000}
    assert json.loads(first.splitlines()[0])["error"]["line"] == 1 and size > 1_000_000
    # The client's own copy of the upload (6 MB) is the test's, outside the bound's reach:
    # httpx holds it in ``data`` and streams it; the router must not hold another.
    assert peak < len(data) // 2, (peak, len(data))
    assert served.backend.statistics().started == 0

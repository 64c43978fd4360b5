"""`headrace serve` with no backend configured runs two built-in engine
replicas as child processes and routes to them; a replica killed with SIGKILL
is restarted on the same port; SIGTERM on the router takes the replicas down.

Real processes end to end, on a tiny random GGUF model."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from tests.engine import tiny

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


async def _read_until(stream: trio.abc.ReceiveStream, marker: str, seen: list[str]) -> str:
    buffer = ""
    while True:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise AssertionError(f"process exited before {marker!r}; output: {''.join(seen)}")
        text = chunk.decode(errors="replace")
        seen.append(text)
        buffer += text
        for line in buffer.splitlines():
            if line.startswith(marker):
                return line


async def _wait_up(client: httpx.AsyncClient, names: set[str]) -> None:
    while True:
        r = await client.get("/admin/backends")
        up = {b["name"] for b in r.json()["data"] if b["state"] == "up"}
        if names <= up:
            return
        await trio.sleep(0.2)


async def test_serve_without_backends_runs_two_engine_replicas(tmp_path: Path) -> None:
    model = tiny.write_gguf(tiny.hf_model(), tmp_path / "tiny.gguf")
    # Round robin, so that two identical requests reach both replicas (the default, kv_aware, keeps them together).
    cmd = [sys.executable, "-m", "router.cli", "serve", "--workers", "1", "--port", "0", "--drain-timeout", "2",
           "--engine-args", f"--model {model} --max-num-seqs 4", "--set", "routing.policy=round_robin"]
    seen: list[str] = []
    async with trio.open_nursery() as nursery:
        proc: trio.Process = await nursery.start(
            lambda task_status: trio.run_process(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False, task_status=task_status)
        )
        assert proc.stdout is not None
        with trio.fail_after(180):
            line = await _read_until(proc.stdout, "headrace listening on ", seen)
            while not re.search(r"headrace admin on \S+\n", "".join(seen)):  # /admin/*: its own listener
                chunk = await proc.stdout.receive_some(65536)
                assert chunk, "".join(seen)
                seen.append(chunk.decode(errors="replace"))
        url = line.split(" on ", 1)[1].strip()
        admin_url = re.findall(r"headrace admin on (\S+)\n", "".join(seen))[0]
        nursery.start_soon(_drain, proc.stdout)
        engines = _children(proc.pid)
        assert len(engines) == 2, seen
        async with httpx.AsyncClient(base_url=url, http1=False, http2=True, timeout=30) as client, \
                httpx.AsyncClient(base_url=admin_url, timeout=30) as admin:
            with trio.fail_after(30):
                await _wait_up(admin, {"engine-0", "engine-1"})
            for _ in range(2):  # round robin: both replicas answer
                r = await client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0})
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] <= 4
            listed = {b["name"]: b for b in (await admin.get("/admin/backends")).json()["data"]}
            assert listed["engine-0"]["requests"] == listed["engine-1"]["requests"] == 1

            # A replica killed outright comes back on its port, and serves again.
            os.kill(engines[0], signal.SIGKILL)
            with trio.fail_after(120):
                while len(set(_children(proc.pid)) - {engines[0]}) < 2:
                    await trio.sleep(0.2)
                await _wait_up(admin, {"engine-0", "engine-1"})
            engines = _children(proc.pid)
            for _ in range(2):
                r = await client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2})
                assert r.status_code == 200, r.text

        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            await proc.wait()
        assert proc.returncode == 0, seen
        assert not [pid for pid in engines if _alive(pid)], "engine replicas outlived the router"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def _drain(stream: trio.abc.ReceiveStream) -> None:
    while await stream.receive_some(65536):
        pass


async def test_engines_warm_pool_scale_up_takes_the_warm_replica_and_refills(tmp_path: Path) -> None:
    """``[[engines]] replicas = 1, warm = 1``: two engines start, the warm one
    takes no traffic; POST /admin/engines replicas = 2 puts it in rotation
    (it answers the next request; no process started for it) and one more
    engine starts for the pool; each replica reports its footprint."""
    model = tiny.write_gguf(tiny.hf_model(), tmp_path / "tiny.gguf")
    (config := tmp_path / "headrace.toml").write_text(
        f'[[engines]]\nmodel = "{model}"\nname = "tiny"\nreplicas = 1\nwarm = 1\nargs = ["--max-num-seqs", "4", "--kv-cache-gb", "0.01"]\n'
        '[health]\ninterval = 0.2\n[routing]\npolicy = "round_robin"\n')  # fmt: skip
    cmd = [sys.executable, "-m", "router.cli", "serve", "--workers", "1", "--port", "0", "--drain-timeout", "2", "--config", str(config)]
    seen: list[str] = []
    async with trio.open_nursery() as nursery:
        proc: trio.Process = await nursery.start(
            lambda task_status: trio.run_process(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False, task_status=task_status)
        )
        assert proc.stdout is not None
        with trio.fail_after(180):
            line = await _read_until(proc.stdout, "headrace listening on ", seen)
            while not re.search(r"headrace admin on \S+\n", "".join(seen)):
                chunk = await proc.stdout.receive_some(65536)
                assert chunk, "".join(seen)
                seen.append(chunk.decode(errors="replace"))
        url = line.split(" on ", 1)[1].strip()
        admin_url = re.findall(r"headrace admin on (\S+)\n", "".join(seen))[0]
        assert len(re.findall(r"engine loaded \S+ in [\d.]+ s: weights [\d.]+ MiB, KV cache [\d.]+ MiB, RSS [\d.]+ MiB", "".join(seen))) == 2
        nursery.start_soon(_drain, proc.stdout)
        assert len(_children(proc.pid)) == 2, seen
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
        async with httpx.AsyncClient(base_url=url, http1=False, http2=True, timeout=30) as client, \
                httpx.AsyncClient(base_url=admin_url, timeout=30) as admin:
            with trio.fail_after(30):
                await _wait_up(admin, {"tiny-0", "tiny-1"})
            pool = (await admin.get("/admin/engines")).json()["data"][0]
            assert [(m["name"], m["state"]) for m in pool["members"]] == [("tiny-0", "serving"), ("tiny-1", "warm")]
            for m in pool["members"]:
                fp = m["footprint"]
                assert fp["load_seconds"] > 0 and fp["weights_bytes"] > 0 and fp["kv_cache_bytes"] > 0 and fp["rss_bytes"] > fp["weights_bytes"]
                assert m["cold_start_seconds"] > fp["load_seconds"]
            assert pool["footprint_source"] == "report"
            for _ in range(2):
                assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
            listed = {b["name"]: b for b in (await admin.get("/admin/backends")).json()["data"]}
            assert (listed["tiny-0"]["requests"], listed["tiny-1"]["requests"], listed["tiny-1"]["draining"]) == (2, 0, True)

            r = await admin.post("/admin/engines", json={"model": "tiny", "replicas": 2})
            assert r.status_code == 200 and r.json()["taken_warm"] == ["tiny-1"] and r.json()["refilling"] == ["tiny-2"], r.text
            for _ in range(2):
                assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
            listed = {b["name"]: b for b in (await admin.get("/admin/backends")).json()["data"]}
            assert listed["tiny-1"]["requests"] == 1  # round robin: in rotation at once
            with trio.fail_after(120):
                while (await admin.get("/admin/engines")).json()["data"][0]["warm"] != 1:
                    await trio.sleep(0.2)
            engines = _children(proc.pid)
            assert len(engines) == 3  # the refill is the one process started

        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            await proc.wait()
        assert proc.returncode == 0, seen
        assert not [pid for pid in engines if _alive(pid)], "engine replicas outlived the router"

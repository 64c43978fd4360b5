"""``[[engines]]`` and warm pools (router/engines.py).

The config decodes, and bad entries are one clear ConfigError. The pool
test runs the real manager and router with real child processes, mocks in
place of engines (the replica actor's program is a parameter): the warm
replica is up but takes no traffic; ``POST /admin/engines`` puts it in
rotation without starting a process for it (processes counted in /proc)
and refills the pool in the background; scaling down stops the one beyond
the pool; a fake memory reading too small for one more replica gets a 409
and changes nothing; the autoscale step scales to headrace_desired_replicas.
Real engines: tests/router/test_replicas.py; their footprint: tests/engine/test_footprint.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from policies.residency import GiB, MemoryReading
from router.app import Router
from router.config import ConfigError, EngineSpec, decode_config
from router.engines import EngineManager
from router.factory import build_backends
from router.replicas import EngineReplica
from tests.router.test_breakdown import serve_both

pytestmark = pytest.mark.timeout(90)


def test_engines_decode_with_defaults() -> None:
    config = decode_config({"engines": [{"model": "/m/a.gguf", "name": "a", "replicas": 2, "warm": 1, "args": ["--kv-cache-gb", "2"]},
                                        {"model": "/m/b.gguf"}]})  # fmt: skip
    a, b = config.engines
    assert (a.name, a.replicas, a.warm, a.args) == ("a", 2, 1, ("--kv-cache-gb", "2"))
    assert (b.name, b.replicas, b.warm, b.max_replicas) == (None, 1, 0, 64)
    assert decode_config({}).engines == ()


@pytest.mark.parametrize(("engines", "message"), [
    ([{"model": "x", "replica": 2}], "Object contains unknown field `replica` - at `$.engines[0]`"),
    ([{"warm": -1}], "Expected `int` >= 0 - at `$.engines[0].warm`"),
    ([{"replicas": 0}], "engines[0]: replicas = 0 and warm = 0 start nothing"),
    ([{"name": "a"}, {"name": "a"}], "engines[1].name: 'a' is already engines[0]'s"),
    ([{}, {"name": "engine"}], "engines[1].name: 'engine' is already engines[0]'s"),
    ([{"replicas": 9, "max_replicas": 4}], "engines[0].replicas: 9 is over max_replicas = 4"),
    ([{"args": ["--port", "9"]}], "engines[0].args: --port is set by headrace serve"),
])  # fmt: skip
def test_bad_engines_are_one_clear_error(engines: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        decode_config({"engines": engines})
    assert message in str(info.value)


def test_an_engine_name_clashing_with_a_backend_is_refused() -> None:
    with pytest.raises(ConfigError, match="backend 'engine-0' would share its replicas' names"):
        decode_config({"engines": [{}], "backends": [{"url": "http://127.0.0.1:1", "name": "engine-0"}]})


def test_a_missing_model_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file or folder"):
        EngineManager([EngineSpec(model=str(tmp_path / "none.gguf"))]).check_placement(0.0)


def test_startup_placement_counts_every_entry_on_the_device(tmp_path: Path) -> None:
    (model := tmp_path / "m.gguf").write_bytes(b"\0" * 1024)
    reading = MemoryReading("cpu", available=4 * GiB, total=8 * GiB, at=0.0)
    specs = [EngineSpec(model=str(model), name="a", args=("--kv-cache-gb", "0.5")),
             EngineSpec(model=str(model), name="b", replicas=2, warm=1, args=("--kv-cache-gb", "0.5"))]  # fmt: skip
    EngineManager(specs[:1], read=lambda device, now: reading).check_placement(0.0)  # 1.25 GiB of 3.6
    with pytest.raises(ConfigError, match=r"engines: 3 replicas of b need 3\.75 GiB .* promised to replicas starting"):
        EngineManager(specs, read=lambda device, now: reading).check_placement(0.0)


# ------------------------------------------------------------ the pool, with mock processes

MOCK = [sys.executable, "-m", "router.cli", "mock"]


GATED: set[str] = set()  # replicas whose process waits (forever) before it becomes the mock


def mock_replica(name: str, args: list[str]) -> EngineReplica:
    """A replica actor whose process is ``headrace mock`` (its engine flags dropped)."""
    program = MOCK if name not in GATED else ["sh", "-c", 'while :; do sleep 0.05; done; exec "$@"', "sh", *MOCK]
    return EngineReplica(name, ["--model", "mock"], program=program, ready_prefix="mock ", startup_timeout=60)


def mock_processes() -> int:
    """This process's children that are ``headrace mock``."""
    me, n = os.getpid(), 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == me and fields[0] != "Z" and b"\0mock\0" in cmdline:
                n += 1
    return n


class Memory:
    """A memory reading the test sets."""

    def __init__(self, available: int) -> None:
        self.available = available

    def __call__(self, device: str, now: float) -> MemoryReading:
        return MemoryReading(device, self.available, 64 * GiB, now)


async def _until(admin: httpx.AsyncClient, done: Any) -> dict[str, Any]:
    with trio.fail_after(60):
        while True:
            pool: dict[str, Any] = (await admin.get("/admin/engines")).json()["data"][0]
            if done(pool):
                return pool
            await trio.sleep(0.1)


async def test_the_warm_pool_takes_no_traffic_and_scale_up_takes_from_it(nursery: trio.Nursery, tmp_path: Path) -> None:
    (model := tmp_path / "m.gguf").write_bytes(b"\0" * 1024)
    memory = Memory(32 * GiB)
    manager = EngineManager([EngineSpec(model=str(model), name="m", replicas=1, warm=1, args=("--kv-cache-gb", "1"))],
                            read=memory, replica=mock_replica)  # fmt: skip
    specs = await manager.start(nursery)
    assert [s.name for s in specs] == ["m-0", "m-1"] and mock_processes() == 2
    config = decode_config({"server": {"port": 0}, "routing": {"policy": "round_robin"}, "health": {"interval": 0.2},
                            "capacity": {"min_replicas": 2},  # headrace_desired_replicas >= 2: for the autoscale step
                            "backends": [{"url": s.url, "kind": "openai", "name": s.name} for s in specs]})  # fmt: skip
    router = Router(config, build_backends(config))
    manager.attach(router)
    url, admin_url = await serve_both(nursery, router, config)
    requests = lambda: {a.name: a.statistics().requests for a in router.actors}  # noqa: E731
    async with httpx.AsyncClient(base_url=url, timeout=20) as client, httpx.AsyncClient(base_url=admin_url, timeout=20) as admin:
        with trio.fail_after(30):
            while not all(a.state.serving for a in router.actors):  # both probed up: the warm one too
                await trio.sleep(0.05)
        pool = (await admin.get("/admin/engines")).json()["data"][0]
        assert (pool["replicas"], pool["warm"], pool["starting"]) == (1, 1, 0)
        for _ in range(4):
            assert (await client.post("/v1/completions", json={"model": "mock", "prompt": "x", "max_tokens": 2})).status_code == 200
        assert requests() == {"m-0": 4, "m-1": 0}

        # Bad requests: the right status, never a 500.
        assert (await admin.post("/admin/engines", json={"model": "nope", "replicas": 2})).status_code == 404
        assert (await admin.post("/admin/engines", json={"model": "m", "replicas": -1})).status_code == 400
        assert (await admin.post("/admin/engines", content=b"{")).status_code == 400

        # Up by one: the warm replica, no process for it; the refill starts in the background.
        r = await admin.post("/admin/engines", json={"model": "m", "replicas": 2})
        assert r.status_code == 200, r.text
        assert (r.json()["taken_warm"], r.json()["cold_starting"], r.json()["refilling"]) == (["m-1"], [], ["m-2"])
        assert r.json()["replicas"] == 2
        for _ in range(4):
            assert (await client.post("/v1/completions", json={"model": "mock", "prompt": "x", "max_tokens": 2})).status_code == 200
        assert requests()["m-1"] == 2  # in rotation at once, whether or not the refill is up yet
        pool = await _until(admin, lambda p: p["warm"] == 1 and p["starting"] == 0)
        assert [(m["name"], m["state"]) for m in pool["members"]] == [("m-0", "serving"), ("m-1", "serving"), ("m-2", "warm")]
        assert mock_processes() == 3  # m-2 is the one process started
        assert router.actor("m-2").draining and requests()["m-2"] == 0

        # No memory for a cold start: 409, and nothing changes.
        memory.available = 2 * GiB
        r = await admin.post("/admin/engines", json={"model": "m", "replicas": 4})
        assert r.status_code == 409 and r.json()["error"]["code"] == "insufficient_memory", r.text
        assert "1 replica of m need 1.75 GiB" in r.json()["error"]["message"]  # the warm one would be taken, one cold
        pool = (await admin.get("/admin/engines")).json()["data"][0]
        assert (pool["replicas"], pool["warm"], pool["starting"]) == (2, 1, 0) and mock_processes() == 3
        memory.available = 32 * GiB

        # Down by one: the pool is full, so the dropped replica stops.
        r = await admin.post("/admin/engines", json={"model": "m", "replicas": 1})
        assert r.status_code == 200 and r.json()["stopping"] == ["m-1"], r.text
        pool = await _until(admin, lambda p: len(p["members"]) == 2)
        assert [(m["name"], m["state"]) for m in pool["members"]] == [("m-0", "serving"), ("m-2", "warm")]
        with trio.fail_after(10):
            while mock_processes() != 2:
                await trio.sleep(0.05)
        metrics = (await admin.get("/metrics")).text
        assert 'headrace_local_replicas{pool="m",state="serving"} 1.0' in metrics
        assert 'headrace_local_replicas{pool="m",state="warm"} 1.0' in metrics
        assert 'headrace_local_replica_footprint_bytes{pool="m",source="estimate"}' in metrics
        assert 'headrace_local_replica_cold_start_seconds{pool="m"}' in metrics

        GATED.add("m-3")
        # Autoscale ([capacity] autoscale's step): desired replicas (2, by min_replicas) -> the warm one serves.
        manager.pools[0].served = "mock"  # the mocks' ready line names no model; engines name theirs
        assert await manager.autoscale_once(trio.current_time()) == {"m": 2}
        assert [(m.name, m.state) for m in manager.pools[0].members][:2] == [("m-0", "serving"), ("m-2", "serving")]
        assert not router.actor("m-2").draining
        assert await manager.autoscale_once(trio.current_time()) == {}  # at the target: nothing to do

        # Down again while the refill (m-3, held before it serves) is still loading: the loaded
        # replica goes back into the pool and the refill is cancelled, its process stopped.
        pool = (await admin.get("/admin/engines")).json()["data"][0]
        assert [(m["name"], m["state"]) for m in pool["members"]][2:] == [("m-3", "starting")]
        with trio.fail_after(10):  # its process (held at the gate) is spawned in the background
            while mock_processes() != 3:
                await trio.sleep(0.05)
        r = await admin.post("/admin/engines", json={"model": "m", "replicas": 1})
        assert r.status_code == 200 and (r.json()["to_pool"], r.json()["cancelled"], r.json()["stopping"]) == (["m-2"], ["m-3"], []), r.text
        pool = await _until(admin, lambda p: len(p["members"]) == 2)
        assert [(m["name"], m["state"]) for m in pool["members"]] == [("m-0", "serving"), ("m-2", "warm")]
        assert router.actor("m-2").draining
        with trio.fail_after(10):
            while mock_processes() != 2:
                await trio.sleep(0.05)
    nursery.cancel_scope.cancel()


def test_headrace_serve_refuses_a_model_that_does_not_fit_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Placement at startup: exit status 2 and one clear line, no process started."""
    from router.server import main

    (model := tmp_path / "big.gguf").write_bytes(b"\0" * 1024)
    (config := tmp_path / "headrace.toml").write_text(f'[[engines]]\nmodel = "{model}"\nname = "big"\nargs = ["--kv-cache-gb", "100000"]\n')
    assert main(["--config", str(config), "--workers", "1", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("headrace serve: engines: 1 replica of big need 100000.75 GiB") and "left on cpu" in err[0], err

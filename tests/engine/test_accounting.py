"""Cost accounting: the engine splits each step's wall time across the
sequences in it by tokens computed (backends/engine/accounting.py), and the
router adds up each request's share per tenant and model (router/usage.py).

End to end on a real engine (tiny random model, in this process, served over
loopback HTTP) behind the real router: two tenants at once; the tenants'
GPU-seconds add up to the engine's busy time (measured apart, around each
step, within 5%), the router's per-tenant counters and ``GET /admin/usage``
(the job store's SQLite usage table) agree with what the clients were told."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from backends.engine.accounting import OTHER, StepMeter
from backends.engine.backend import EngineBackend, build_engine
from backends.engine.config import EngineConfig
from backends.engine.engine import StepOutput
from backends.engine.server import run_server
from frontend import metric_names as N
from frontend.serving import ServeOptions
from router.app import Router, key_digest
from router.config import decode_config
from router.factory import build_backends
from router.server import options_for, run_router

KEYS = {"alice": "key-alice", "bob": "key-bob"}


def test_a_steps_time_is_split_by_tokens_computed_and_adds_up_to_the_busy_time() -> None:
    meter = StepMeter(max_tenants=2)
    meter.admit("a1", "alice")
    meter.admit("b1", "bob")
    meter.charge(0.040, [("a1", 96), ("b1", 4)])  # a prefill chunk beside a decode
    meter.charge(0.010, [("a1", 1), ("b1", 1), ("gone", 0)])
    meter.generated("a1")
    assert meter.release("a1") == pytest.approx(0.0384 + 0.005)
    assert meter.release("a1") == 0.0  # forgotten
    stats = meter.statistics()
    assert stats.busy_seconds == pytest.approx(0.05) and stats.steps == 2
    assert stats.tenants["alice"].gpu_seconds == pytest.approx(0.0434) and stats.tenants["alice"].computed_tokens == 97
    assert stats.tenants["bob"].gpu_seconds == pytest.approx(0.0066) and stats.tenants["alice"].generated_tokens == 1
    meter.admit("c1", "carol")  # a third tenant past max_tenants: counted as other
    meter.charge(0.002, [("c1", 3)])
    assert set(meter.statistics().tenants) == {"alice", "bob", OTHER}
    assert math.isclose(sum(t.gpu_seconds for t in meter.statistics().tenants.values()), 0.052)


def samples(text: str, name: str) -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == name:
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[tuple(s.labels[k] for k in sorted(s.labels))] = s.value
    return out


def timed_steps(busy: list[float]) -> Callable[[Callable[[], list[StepOutput]]], Any]:
    """The backend's ``run_step``: each engine step in a worker thread, its wall time added to ``busy``."""

    def timed(fn: Callable[[], list[StepOutput]]) -> list[StepOutput]:
        started = time.perf_counter()
        try:
            return fn()
        finally:
            busy[0] += time.perf_counter() - started

    return lambda fn: trio.to_thread.run_sync(timed, fn)


@pytest.mark.timeout(120)
async def test_two_tenants_gpu_seconds_add_up_to_the_engines_busy_time_and_reach_admin_usage(
    nursery: trio.Nursery, tiny_gguf: Path, tmp_path: Path
) -> None:
    config = EngineConfig(model=str(tiny_gguf), num_kv_blocks=256, block_size=4, max_model_len=256, max_num_seqs=8)
    engine, tok, name = build_engine(config)
    busy = [0.0]
    backend = EngineBackend(engine, tok, model_name=name, run_step=timed_steps(busy))
    shutdown = trio.Event()
    engine_url = await nursery.start(functools.partial(run_server, backend, ServeOptions("127.0.0.1", 0), shutdown))
    router_config = decode_config({
        "backends": [{"kind": "engine", "url": engine_url, "name": "e"}],
        "health": {"interval": 30},
        "auth": {"api_keys": [{"sha256": key_digest(k), "tenant": t} for t, k in KEYS.items()]},
        "jobs": {"data_dir": str(tmp_path / "data")},
    })  # fmt: skip
    router = Router(router_config, build_backends(router_config))
    url = await nursery.start(lambda task_status: run_router(  # and the admin listener, as headrace serve runs them
        router, options_for(router_config), shutdown=trio.Event(), admin=ServeOptions("127.0.0.1", 0, graceful_timeout=0.1),
        task_status=task_status))  # fmt: skip
    told: dict[str, list[dict[str, Any]]] = {"alice": [], "bob": []}  # the usage each answer carried

    async def tenant(who: str, prompt: str, max_tokens: int, stream: bool) -> None:
        headers = {"authorization": f"Bearer {KEYS[who]}"}
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=headers) as client:
            for i in range(3):
                body = {"model": name, "prompt": f"{prompt} {i}", "max_tokens": max_tokens, "ignore_eos": True,
                        "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}  # fmt: skip
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                if stream:
                    chunks = [c for c in r.text.split("\n\n") if c.startswith("data: {")]
                    told[who].append(httpx.Response(200, content=chunks[-1].removeprefix("data: ")).json()["usage"])
                else:
                    told[who].append(r.json()["usage"])

    with trio.fail_after(90):
        async with trio.open_nursery() as clients:  # both tenants in the same batches
            clients.start_soon(tenant, "alice", "the the the the the the the the the the the the the the", 6, False)
            clients.start_soon(tenant, "bob", "the", 24, True)
            clients.start_soon(tenant, "alice", "in an er on", 12, True)
    async with httpx.AsyncClient(timeout=10) as client:
        engine_metrics = (await client.get(engine_url + "/metrics")).text
        assert router.admin_url is not None
        router_metrics = (await client.get(router.admin_url + "/metrics")).text
        usage = (await client.get(router.admin_url + "/admin/usage", params={"tenant": "alice", "since": "0"})).json()
        everyone = (await client.get(router.admin_url + "/admin/usage", params={"since": "1970-01-01T00:00:00Z"})).json()
        bad = await client.get(router.admin_url + "/admin/usage", params={"since": "yesterday"})
    shutdown.set()

    gpu = samples(engine_metrics, N.ENGINE_GPU_SECONDS.name)
    (engine_busy,) = samples(engine_metrics, N.ENGINE_BUSY_SECONDS.name).values()
    assert set(gpu) == {(name, "alice"), (name, "bob")}  # sorted label keys: model, tenant
    assert sum(gpu.values()) == pytest.approx(engine_busy, rel=1e-9)  # every step's time attributed
    assert sum(gpu.values()) == pytest.approx(busy[0], rel=0.05)  # ... and that is the engine's busy time
    computed = samples(engine_metrics, N.ENGINE_TENANT_COMPUTED.name)
    assert computed[(name, "bob")] >= 3 * 24 and computed[(name, "alice")] > computed[(name, "bob")] / 2
    for who in ("alice", "bob"):
        reported = sum(u["gpu_seconds"] for u in told[who])  # each answer's share, as the client saw it
        assert reported == pytest.approx(gpu[(name, who)], rel=1e-6), who
    # The router's counters, per tenant and model.
    prompt = samples(router_metrics, N.USAGE_PROMPT.name)
    generated = samples(router_metrics, N.USAGE_GENERATED.name)
    router_gpu = samples(router_metrics, N.USAGE_GPU.name)
    for who in ("alice", "bob"):
        assert prompt[(name, who)] == sum(u["prompt_tokens"] for u in told[who])
        assert generated[(name, who)] == sum(u["completion_tokens"] for u in told[who]) == (54 if who == "alice" else 72)
        assert router_gpu[(name, who)] == pytest.approx(gpu[(name, who)], rel=1e-6)
    # GET /admin/usage: the store's rows (flushed on the request), alice's only.
    [total] = usage["totals"]
    assert (total["tenant"], total["model"], total["requests"]) == ("alice", name, 6)
    assert total["prompt_tokens"] == prompt[(name, "alice")] and total["generated_tokens"] == 54
    assert total["gpu_seconds"] == pytest.approx(gpu[(name, "alice")], rel=1e-6)
    assert {r["tenant"] for r in usage["data"]} == {"alice"} and usage["bucket_seconds"] == 60
    assert sorted(t["tenant"] for t in everyone["totals"]) == ["alice", "bob"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "since", bad.text

"""One registry of metric names (frontend/metric_names.py): every family the
router exports is declared there with its labels, no exporter spells a name
itself, and a live router over loopback HTTP exports exactly the declared
families, labels and per-call SLIs (bounded tenant and model labels)."""

from __future__ import annotations

import ast
import functools
import inspect
import itertools
import math
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import httpx
import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from backends.mock import MockBackend, MockConfig
from backends.openai_http import OpenAIHTTPBackend
from frontend import metric_names as N
from frontend.serving import ServeOptions, serve
from router.app import NamedBackend, Router
from router.config import decode_config
from router.metrics import GAUGE_MODES
from tests.router.test_workers import Serve, one_request_per_connection, scrape

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"), "gauge": ("",)}


def check_exposition(text: str, exporter: N.Exporter, *, multiprocess: bool = False) -> dict[str, list[Sample]]:
    """Every family in ``text`` is declared for ``exporter``, of its declared
    type, and each sample carries exactly the declared labels (``le`` on
    buckets; ``multiprocess``: ``pid`` on the gauges mirrored per worker);
    returns the samples by family."""
    found: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        base = family.name.removesuffix("_created")
        if base != family.name and base in N.FAMILIES and N.FAMILIES[base].type != "gauge":
            # the text parser gives an instrument's _created series a family of its own
            assert all(set(s.labels) == set(N.FAMILIES[base].labels) for s in family.samples), family.name
            continue
        declared = N.FAMILIES.get(family.name)
        assert declared is not None, f"{family.name} is exported but not declared in frontend/metric_names.py"
        assert exporter in declared.exporters, f"{family.name} is not declared for the {exporter}"
        assert family.type == declared.type, family.name
        assert family.documentation == declared.help, family.name
        for sample in family.samples:
            suffix = sample.name[len(family.name):]
            assert suffix in SUFFIXES[declared.type], sample.name
            expected = set(declared.labels) | ({"le"} if suffix == "_bucket" else set())
            if multiprocess and declared.type == "gauge" and GAUGE_MODES.get(declared.name, "liveall") == "liveall":
                expected.add("pid")
            assert set(sample.labels) == expected, (sample.name, sample.labels, declared.labels)
        found[family.name] = family.samples
    return found


def test_the_registry_is_well_formed() -> None:
    assert N.FAMILIES, "no families declared"
    for name, f in N.FAMILIES.items():
        assert name == f.name and re.fullmatch(r"headrace_[a-z0-9_]+", name), name
        assert not name.endswith(("_total", "_created", "_bucket", "_count", "_sum")), name
        assert f.help and f.exporters, name
        assert all(re.fullmatch(r"[a-z_]+", label) for label in f.labels), name
        assert (f.type == "histogram") == bool(f.buckets), name
        assert list(f.buckets) == sorted(f.buckets), name


def test_first_token_histograms_resolve_the_slo_range_and_reach_the_first_token_timeout() -> None:
    """TTFT and resume-gap SLOs sit between 50 ms and 1 s: no bucket step there
    may exceed 1.5x, or a p50 is a straight line across 150 ms (the coarse
    token buckets' 100 -> 250 ms); and a first token may come as late as the
    backends' default first-token timeout, which must not fall in +Inf."""
    timeout = inspect.signature(OpenAIHTTPBackend).parameters["stall_timeout"].default  # first token's by default
    for family in (N.REQUEST_TTFT, N.TTFT, N.RESUME_GAP, N.ENGINE_TTFT):
        inside = [b for b in family.buckets if 0.05 <= b <= 1.0]
        assert inside[0] == 0.05 and inside[-1] == 1.0, family.name
        assert max(hi / lo for lo, hi in itertools.pairwise(inside)) <= 1.5, family.name
        assert family.buckets[-1] >= timeout, family.name
    assert max(hi / lo for lo, hi in itertools.pairwise(N.TOKEN_BUCKETS)) > 1.5  # what the first-token families left


def test_a_name_declared_twice_is_refused() -> None:
    try:
        N.declare("headrace_requests", "counter", "again")
    except ValueError as exc:
        assert "declared twice" in str(exc)
    else:
        raise AssertionError("declared twice without an error")


def _string_constants(path: Path) -> Iterable[str]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value


def test_no_exporter_spells_a_metric_name_itself() -> None:
    """Names live in frontend/metric_names.py only: no string in router/,
    backends/ or the rest of frontend/ starts with a declared family's name."""
    names = tuple(N.FAMILIES)
    offenders = []
    for folder in ("router", "backends", "frontend"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "metric_names.py":
                continue
            offenders += [f"{path.relative_to(ROOT)}: {s!r}" for s in _string_constants(path) if s.startswith(names)]
    assert offenders == []


async def _scrape(config: dict[str, object], calls: list[dict[str, object]]) -> str:
    backends = [MockBackend(MockConfig(name=f"mock-{i}", models=("mock",))) for i in range(2)]
    router = Router(decode_config(config), [NamedBackend(b.info().name, b) for b in backends])
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(router.run)
        url = await nursery.start(functools.partial(serve, router, ServeOptions("127.0.0.1", 0), shutdown=shutdown))
        async with httpx.AsyncClient(base_url=url) as client:
            for call in calls:
                headers = {str(k): str(v) for k, v in dict(call.pop("headers", {})).items()}  # type: ignore[call-overload]
                r = await client.post("/v1/completions", json=call, headers=headers)
                assert r.status_code in (200, 404), r.text
            text = (await client.get("/metrics")).text
        shutdown.set()
        nursery.cancel_scope.cancel()
    return text


CONFIG: dict[str, object] = {
    "tenants": {"team-a": {}},
    "auth": {"keys": {"key-a": "team-a", "key-b": "team-b"}},
    "retry": {"budget_ratio": 0.2},
}


async def test_a_live_router_exports_exactly_the_declared_families_and_labels() -> None:
    calls: list[dict[str, object]] = [
        {"model": "mock", "prompt": "hi", "max_tokens": 3, "stream": True, "headers": {"authorization": "Bearer key-a", "x-priority": "interactive"}},
        {"model": "mock", "prompt": "hi", "max_tokens": 2, "headers": {"authorization": "Bearer key-b"}},
    ]
    found = check_exposition(await _scrape(CONFIG, calls), "router")
    always = {f.name for f in N.exported_by("router", conditional=False)}
    assert always <= set(found), f"declared but not exported: {sorted(always - set(found))}"
    # this config turns on admission and the retry budget; nothing has finished a slot yet
    # when the scrape is not taken... so service_rate may or may not be there: the rest must
    local = {N.LOCAL_REPLICAS.name, N.LOCAL_FOOTPRINT.name, N.LOCAL_COLD_START.name}  # engine replicas: tests/router/test_engines.py
    conditional = {f.name for f in N.exported_by("router") if f.when and f.name != N.QUEUE_SERVICE_RATE.name} - local
    assert conditional <= set(found), sorted(conditional - set(found))

    def counts(family: N.Family) -> dict[tuple[str, ...], float]:
        return {tuple(s.labels[k] for k in family.labels): s.value for s in found[family.name] if s.name.endswith("_count")}

    ttft = counts(N.REQUEST_TTFT)
    bounds = {float(s.labels["le"]) for s in found[N.REQUEST_TTFT.name] if s.name.endswith("_bucket")}
    assert bounds == {*N.REQUEST_TTFT.buckets, math.inf}  # the declared buckets are the exported ones
    # team-b has a key but no [tenants] entry: still configured (keys are config), so named
    assert ttft == {("/v1/completions", "mock", "team-a", "interactive"): 1.0, ("/v1/completions", "mock", "team-b", "default"): 1.0}
    assert counts(N.REQUEST_QUEUE).keys() == ttft.keys() == counts(N.E2E_LATENCY).keys() == counts(N.REQUEST_INFERENCE).keys()
    # two more token events after the first in the stream of three tokens
    assert counts(N.REQUEST_ITL)[("/v1/completions", "mock", "team-a", "interactive")] >= 2.0


def _tasks_gauge(text: str) -> list[float]:
    return [s.value for f in text_string_to_metric_families(text) if f.name == N.ROUTER_TASKS.name for s in f.samples]


async def test_the_task_gauge_counts_every_trio_task_down_the_nurseries_and_falls_back_when_they_end() -> None:
    """What the chaos bench reads for leaked tasks: 50 tasks, one of them with
    a nursery of 10 more, count 60 above the idle count, in ``count_tasks``
    and in the rendered gauge; once they end, the idle count again."""
    from router.metrics import RouterMetrics, count_tasks

    metrics = RouterMetrics()
    idle = count_tasks()
    assert idle >= 2  # trio's init task and this test's own, at least
    assert _tasks_gauge(metrics.render().decode()) == [idle]

    async def parent() -> None:
        async with trio.open_nursery() as inner:
            for _ in range(10):
                inner.start_soon(trio.sleep_forever)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(parent)
        for _ in range(49):
            nursery.start_soon(trio.sleep_forever)
        await trio.testing.wait_all_tasks_blocked()
        assert count_tasks() == idle + 60 and _tasks_gauge(metrics.render().decode()) == [idle + 60]
        nursery.cancel_scope.cancel()
    assert count_tasks() == idle and _tasks_gauge((await metrics.render_async()).decode()) == [idle]


def test_the_task_gauge_is_left_out_of_a_render_outside_trio() -> None:
    from router.metrics import RouterMetrics

    text = RouterMetrics().render().decode()
    assert _tasks_gauge(text) == [] and "headrace_worker_requests" in text  # the rest renders as before


async def test_made_up_models_and_tenants_are_labelled_other() -> None:
    """A client cannot grow the series count: a model no route or backend
    serves and a tenant nobody configured come out as ``other``."""
    from router.metrics import LabelBounds

    bounds = LabelBounds(["team-a"], lambda: ["mock"])
    assert [bounds.tenant(t) for t in ("team-a", "default", "anonymous", "x" * 40)] == ["team-a", "default", "anonymous", "other"]
    assert [bounds.model(m) for m in ("mock", "gpt-9")] == ["mock", "other"]
    calls: list[dict[str, object]] = [{"model": f"gpt-{i}", "prompt": "hi", "headers": {"authorization": "Bearer key-a"}} for i in range(3)]
    found = check_exposition(await _scrape(CONFIG, calls), "router")
    values = {v for samples in found.values() for s in samples for v in s.labels.values()}
    assert not {v for v in values if v.startswith("gpt-")}, "a made-up model became a label value"
    assert {s.labels["model"] for s in found[N.DESIRED_REPLICAS.name]} == {"mock"}


async def test_retries_and_migrations_are_counted_per_backend() -> None:
    """One backend that answers 503 before any token, one that cuts every
    stream after two tokens, one that works: the first is where retries come
    from, the second where streams broke (and were migrated)."""
    from backends.mock import Fault

    backends = [
        MockBackend(MockConfig(name="bad", faults=(Fault(kind="status", status=503),))),
        MockBackend(MockConfig(name="cut", faults=(Fault(kind="cut", after=2),))),
        MockBackend(MockConfig(name="good")),
    ]
    # Round robin: the six identical requests visit all three (kv_aware would keep them on one).
    config = decode_config({"breaker": {"enabled": False}, "routing": {"policy": "round_robin"}})
    router = Router(config, [NamedBackend(b.info().name, b) for b in backends])
    async with trio.open_nursery() as nursery, httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://r") as client:
        await nursery.start(router.run)
        for _ in range(6):
            r = await client.post("/v1/completions", json={"model": "mock", "prompt": "hi", "max_tokens": 4})
            assert r.status_code == 200, r.text
        found = check_exposition((await client.get("/metrics")).text, "router")
        nursery.cancel_scope.cancel()

    def by_backend(family: N.Family) -> dict[str, float]:
        return {s.labels["backend"]: s.value for s in found[family.name] if s.name.endswith("_total")}

    assert set(by_backend(N.BACKEND_RETRIES)) == {"bad"} and by_backend(N.BACKEND_RETRIES)["bad"] >= 2
    assert set(by_backend(N.BACKEND_MIGRATIONS)) == {"cut"} and by_backend(N.BACKEND_MIGRATIONS)["cut"] >= 2
    resumed = sum(s.value for s in found[N.MIGRATIONS.name] if s.name.endswith("_total") and s.labels["outcome"] != "failed")
    assert resumed == by_backend(N.BACKEND_MIGRATIONS)["cut"]


@pytest.mark.slow
async def test_headrace_serve_with_two_workers_exports_the_declared_families(tmp_path: Path) -> None:
    """Real processes: ``headrace serve --workers 2`` over two mocks; the
    admin listener's /metrics (multiprocess mode) holds the declared families
    and labels, the per-worker gauges with a ``pid`` label."""
    config = tmp_path / "router.toml"
    config.write_text('[health]\ninterval = 0.2\n[[backends]]\nkind = "mock"\n[[backends]]\nkind = "mock"\n')
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "router.cli", "serve", "--config", str(config), "--port", "0", "--workers", "2", "--log-level", "WARNING"]
    proc = await trio.lowlevel.open_process(cmd, cwd=ROOT, stdout=subprocess.PIPE, env=env)
    serving = Serve(proc)
    try:
        with trio.fail_after(60):
            url = (await serving.read_until("headrace listening on ")).rsplit(" ", 1)[1].strip()
            admin = (await serving.read_until("headrace admin on ")).rsplit(" ", 1)[1].strip()
            await one_request_per_connection(url, 6)
            text = await scrape(admin)
            while not any(s.value for s in check_exposition(text, "router", multiprocess=True).get(N.ARRIVAL_RATE.name, [])):
                await trio.sleep(0.2)  # the other worker's mirror is at most 1 s old
                text = await scrape(admin)
        found = check_exposition(text, "router", multiprocess=True)
        # multiprocess mode writes only what has a value: counters still at zero are absent
        wanted = {N.REQUESTS, N.E2E_LATENCY, N.REQUEST_TTFT, N.REQUEST_QUEUE, N.BACKEND_UP, N.BACKEND_COUNTERS["requests"],
                  N.DESIRED_REPLICAS, N.ARRIVAL_RATE, N.MODEL_REPLICAS, N.PIPELINE_ADMITTED, N.QUEUE_DEPTH}  # fmt: skip
        assert {f.name for f in wanted} <= set(found), sorted({f.name for f in wanted} - set(found))
        assert sum(s.value for s in found[N.E2E_LATENCY.name] if s.name.endswith("_count")) == 6
        pids = {s.labels["pid"] for s in found[N.DESIRED_REPLICAS.name]}
        assert len(pids) == 2  # one estimate per worker, each for the whole fleet
    finally:
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            await serving.drain_output()
            await proc.wait()

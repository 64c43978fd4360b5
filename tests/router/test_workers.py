"""``headrace serve --workers N``: N router processes on one port, with
metrics that add up across them; a dead worker is restarted; SIGTERM drains
them all; local engine replicas are started once, by the supervisor. Also
the logging setup every ``headrace`` command shares.

Real processes on 127.0.0.1 (in-process mock backends in each worker, or mock
servers in the test process), bounded in time."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from backends.mock import MockBackend, MockConfig
from frontend.server import OpenAIServer
from frontend.serving import ServeOptions, reserve_port, serve
from router import cli
from router.config import decode_config
from router.server import worker_count
from router.workers import serve_workers
from tests.router.test_replicas import _children

REPO = Path(__file__).resolve().parents[2]
COMPLETION = {"prompt": "x", "max_tokens": 2}


def samples(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of one metric in a Prometheus text scrape."""
    found = {}
    for line in text.splitlines():
        m = re.fullmatch(rf"{name}(\{{[^}}]*\}})? (\S+)", line)
        if m:
            found[m.group(1) or ""] = float(m.group(2))
    return found


children = _children  # the processes whose parent is pid


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def leftovers(tmp: Path) -> list[Path]:
    return list(tmp.glob("headrace-workers-*"))


async def one_request_per_connection(url: str, n: int) -> None:
    """``n`` requests, each on a new connection (the kernel spreads connections,
    not requests, across SO_REUSEPORT listeners)."""
    for _ in range(n):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            r = await client.post("/v1/completions", json=COMPLETION)
            assert r.status_code == 200, r.text


async def scrape(url: str) -> str:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        r = await client.get("/metrics")
        assert r.status_code == 200
        return r.text


class Serve:
    """A ``headrace serve`` process whose stdout is collected."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self.out = ""

    async def read_until(self, marker: str) -> str:
        assert self.proc.stdout is not None
        while marker not in self.out:
            chunk = await self.proc.stdout.receive_some(65536)
            assert chunk, f"serve exited before {marker!r}; output: {self.out}"
            self.out += chunk.decode(errors="replace")
        return next(line for line in self.out.splitlines() if marker in line)

    async def drain_output(self) -> None:
        assert self.proc.stdout is not None
        while chunk := await self.proc.stdout.receive_some(65536):
            self.out += chunk.decode(errors="replace")


@pytest.mark.slow
async def test_two_workers_share_the_port_metrics_add_up_a_dead_worker_comes_back_and_sigterm_drains_all(
    tmp_path: Path,
) -> None:
    config = tmp_path / "router.toml"
    config.write_text('[server]\ndrain_timeout = 2\n[health]\ninterval = 0.2\n[[backends]]\nkind = "mock"\n')
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "router.cli", "serve", "--config", str(config), "--port", "0", "--workers", "2",
           "--log-level", "WARNING"]  # fmt: skip
    proc = await trio.lowlevel.open_process(cmd, cwd=REPO, stdout=subprocess.PIPE, env=env)
    serving = Serve(proc)
    try:
        with trio.fail_after(60):
            line = await serving.read_until("headrace listening on ")
            url = line.rsplit(" ", 1)[1].strip()
            assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
            admin = (await serving.read_until("headrace admin on ")).rsplit(" ", 1)[1].strip()
            assert admin.startswith("http://127.0.0.1:") and not admin.endswith(":0")  # /metrics: the workers' shared admin port
            workers = children(proc.pid)
            assert len(workers) == 2

            await one_request_per_connection(url, 40)
            text = await scrape(admin)
            assert samples(text, "headrace_requests_total")['{route="/v1/completions",status="200",tenant="default"}'] == 40
            per_worker = samples(text, "headrace_worker_requests_total")
            assert set(per_worker) == {'{worker="0"}', '{worker="1"}'}, per_worker
            assert all(v > 0 for v in per_worker.values()), per_worker  # both workers served
            assert sum(per_worker.values()) == sum(samples(text, "headrace_requests_total").values())
            # The actors' own counts reach the scrape by the mirror (at most 1 s old;
            # a request is counted when it starts, and leaves in-flight after its
            # client has the answer: wait for both).
            while (sum(samples(text, "headrace_backend_requests_total").values()) < 40
                   or sum(samples(text, "headrace_backend_in_flight").values()) != 0):  # fmt: skip
                await trio.sleep(0.2)
                text = await scrape(admin)
            assert samples(text, "headrace_backend_requests_total") == {'{backend="mock-0"}': 40.0}
            assert samples(text, "headrace_backend_in_flight") == {'{backend="mock-0"}': 0.0}
            up = samples(text, "headrace_backend_up")
            assert sorted(up) == sorted(f'{{backend="mock-0",pid="{pid}"}}' for pid in workers), up

            # A worker killed outright is replaced; the other serves meanwhile,
            # and the dead worker's counts stay in the totals.
            os.kill(workers[0], signal.SIGKILL)
            await one_request_per_connection(url, 5)
            while len(set(children(proc.pid)) - {workers[0]}) < 2:
                await trio.sleep(0.1)
            replaced = children(proc.pid)
            await one_request_per_connection(url, 20)
            text = await scrape(admin)
            assert samples(text, "headrace_requests_total")['{route="/v1/completions",status="200",tenant="default"}'] == 65
            up = samples(text, "headrace_backend_up")
            assert f'{{backend="mock-0",pid="{workers[0]}"}}' not in up, up  # the dead worker's gauges are gone

        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            await serving.drain_output()
            assert await proc.wait() == 0
        assert serving.out.count("headrace listening on") == 1, serving.out
        assert not [pid for pid in replaced if alive(pid)], "workers outlived the supervisor"
        assert not leftovers(tmp_path), "the supervisor left its temporary directory"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def counting(app: Any, hits: list[int], i: int) -> Any:
    async def counted(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/completions":
            hits[i] += 1
        await app(scope, receive, send)

    return counted


@pytest.mark.slow
async def test_the_supervisor_starts_the_engine_replicas_once_and_gives_them_to_every_worker(
    nursery: trio.Nursery, tmp_path: Path,
) -> None:
    """With no backend configured, the replicas are started by the supervisor
    (here: two mock servers standing in for engines), not by each worker."""
    hits = [0, 0]
    started: list[list[str]] = []

    async def start_backends(replicas: trio.Nursery) -> list[str]:
        urls = []
        for i in range(2):
            app = counting(OpenAIServer(MockBackend(MockConfig(name=f"m{i}", models=("mock",)))), hits, i)
            urls.append(await replicas.start(serve, app, ServeOptions(graceful_timeout=0.1)))
        started.append(urls)
        return urls

    held = reserve_port("127.0.0.1")  # the admin port every worker binds (headrace serve's supervisor holds one so)
    admin = f"http://127.0.0.1:{held.getsockname()[1]}"
    # Round robin: identical requests reach both replicas (the default, kv_aware, keeps them on one).
    config = decode_config({"server": {"port": 0, "drain_timeout": 1, "admin_port": held.getsockname()[1]}, "health": {"interval": 0.2},
                            "routing": {"policy": "round_robin"}})  # fmt: skip
    shutdown = trio.Event()
    done = trio.Event()

    async def supervise(task_status: trio.TaskStatus[str]) -> None:
        await serve_workers(config, 2, start_backends=start_backends, shutdown=shutdown, log_level="WARNING",
                            task_status=task_status)  # fmt: skip
        done.set()

    with trio.fail_after(60):
        url = await nursery.start(supervise)
        async with httpx.AsyncClient(base_url=admin, timeout=10) as client:
            listed = (await client.get("/admin/backends")).json()["data"]
        assert sorted(b["name"] for b in listed) == ["engine-0", "engine-1"]
        while not all(b["state"] == "up" for b in listed):
            await trio.sleep(0.1)
            async with httpx.AsyncClient(base_url=admin, timeout=10) as client:
                listed = (await client.get("/admin/backends")).json()["data"]
        await one_request_per_connection(url, 12)
    assert len(started) == 1
    assert sum(hits) == 12 and all(hits), hits  # both replicas, through whichever worker
    shutdown.set()
    with trio.fail_after(30):
        await done.wait()
    held.close()


def test_the_default_is_one_worker_per_core() -> None:
    assert worker_count(decode_config({})) == os.cpu_count()
    assert worker_count(decode_config({"server": {"workers": 1}})) == 1


def test_mirrored_statistics_add_up_across_processes_in_multiprocess_mode(tmp_path: Path) -> None:
    """Two processes each mirror their live statistics (counters by increase,
    a restart from zero counted as such; in-flight summed; up per process);
    a render in either reports the sums. Subprocesses: multiprocess mode is
    chosen when prometheus_client is imported."""
    script = textwrap.dedent("""
        import sys
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        from router.metrics import RouterMetrics

        class Collector:
            now = (0, 0)
            def collect(self):
                requests, in_flight = self.now
                c = CounterMetricFamily("headrace_backend_requests", "h", labels=["backend"])
                c.add_metric(["a"], requests)
                g = GaugeMetricFamily("headrace_backend_in_flight", "h", labels=["backend"])
                g.add_metric(["a"], in_flight)
                u = GaugeMetricFamily("headrace_backend_up", "h", labels=["backend"])
                u.add_metric(["a"], 1)
                return [c, g, u]

        metrics = RouterMetrics()
        collector = Collector()
        metrics.add_collector(collector)
        for collector.now in [(10, 1), (15, 2), (3, 3)]:  # 3: the count restarted from zero
            metrics.mirror()
        metrics.observe("/v1/completions", 200, "default", 0.01)
        sys.stdout.write(metrics.render().decode())
    """)
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
            for _ in range(2)]  # fmt: skip
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    text = runs[1].stdout
    assert samples(text, "headrace_backend_requests_total") == {'{backend="a"}': 2 * 18.0}
    assert samples(text, "headrace_backend_in_flight") == {'{backend="a"}': 2 * 3.0}  # livesum; both pids "live" here
    assert len(samples(text, "headrace_backend_up")) == 2  # one series per process
    assert samples(text, "headrace_requests_total") == {'{route="/v1/completions",status="200",tenant="default"}': 2.0}
    assert samples(text, "headrace_worker_requests_total") == {'{worker="0"}': 2.0}


# ---------------------------------------------------------------- logging


@pytest.fixture
def log_levels() -> Iterator[None]:
    names = ["", *cli.QUIET_LOGGERS]
    before = {name: logging.getLogger(name).level for name in names}
    yield
    for name, level in before.items():
        logging.getLogger(name).setLevel(level)


def test_httpx_and_httpcore_log_only_warnings_even_at_debug(log_levels: None) -> None:
    """httpx logged every upstream request and health probe at INFO."""
    logging.getLogger().setLevel(logging.DEBUG)
    cli.configure_logging("DEBUG")
    for name in ("httpx", "httpcore", "httpcore.http2"):
        logger = logging.getLogger(name)
        assert not logger.isEnabledFor(logging.INFO) and logger.isEnabledFor(logging.WARNING), name
    assert logging.getLogger("headrace").isEnabledFor(logging.DEBUG)


def test_every_headrace_command_quiets_httpx(log_levels: None, capsys: pytest.CaptureFixture[str]) -> None:
    logging.getLogger().setLevel(logging.DEBUG)
    with contextlib.suppress(SystemExit):  # some commands let argparse exit on --help
        cli.main(["mock", "--help"])
    capsys.readouterr()
    assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)


@pytest.mark.slow
async def test_an_admin_change_reaches_every_worker(tmp_path: Path) -> None:
    """The workers share the admin port, so the kernel gives an admin call to
    one of them; a drain must still stop every worker sending to the
    backend (router/admin_fanout.py), and each worker's answer says so."""
    config = tmp_path / "router.toml"
    config.write_text('[server]\ndrain_timeout = 2\n[health]\ninterval = 0.2\n[[backends]]\nkind = "mock"\n[[backends]]\nkind = "mock"\n')
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "router.cli", "serve", "--config", str(config), "--port", "0", "--workers", "2",
           "--log-level", "WARNING"]  # fmt: skip
    proc = await trio.lowlevel.open_process(cmd, cwd=REPO, stdout=subprocess.PIPE, env=env)
    serving = Serve(proc)
    try:
        with trio.fail_after(60):
            url = (await serving.read_until("headrace listening on ")).rsplit(" ", 1)[1].strip()
            admin = (await serving.read_until("headrace admin on ")).rsplit(" ", 1)[1].strip()
            async with httpx.AsyncClient(base_url=admin, timeout=10) as client:
                r = await client.post("/admin/backends", json={"backend": "mock-1", "action": "drain"})
            assert r.status_code == 200, r.text
            assert r.headers["x-headrace-workers"] == "2/2" and r.headers["x-headrace-worker"] in ("0", "1")
            # each worker, reached over fresh connections, has mock-1 draining
            seen: dict[str, bool] = {}
            while len(seen) < 2:
                async with httpx.AsyncClient(base_url=admin, timeout=10) as client:
                    r = await client.get("/admin/backends")
                mock1 = next(b for b in r.json()["data"] if b["name"] == "mock-1")
                seen[r.headers["x-headrace-worker"]] = mock1["draining"]
            assert seen == {"0": True, "1": True}
            before = samples(await scrape(admin), "headrace_backend_requests_total").get('{backend="mock-1"}', 0.0)
            await one_request_per_connection(url, 20)
            await trio.sleep(1.2)  # the mirror
            after = samples(await scrape(admin), "headrace_backend_requests_total")
            assert after.get('{backend="mock-1"}', 0.0) == before and after['{backend="mock-0"}'] >= 20, after
            # a bad change is answered by the worker that got it and passed on to none
            async with httpx.AsyncClient(base_url=admin, timeout=10) as client:
                r = await client.post("/admin/backends", json={"backend": "mock-1", "action": "explode"})
            assert r.status_code == 400 and "x-headrace-workers" not in r.headers
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            await serving.drain_output()
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

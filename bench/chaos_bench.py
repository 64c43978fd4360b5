"""``headrace bench chaos``: stream migration while backends die at random (issue 14).

A bed of ``--backends`` mocks on fixed ports (the mock honours the engine's
resume contract and its output is a pure function of prompt, seed and
position, so every answer has a reference), a router in front of them, and
one more mock beside them, the oracle, that only answers references::

    C streams, closed loop ──h2c──> headrace serve ──> mock0 :P0  <── SIGKILL, back on P0 after --down s
      │ each answer compared                         ──> mock1 :P1
      │ with its reference                           ──> ...
      └────────────────────────────────────────────────> oracle (no delays, not routed to)
    chaos task: every U(--interval) s, SIGKILL a random backend

Phases: every backend's prefix cache is warmed with the shared prompts; a
warm-up load of ``--warmup`` s (no kills) fills the router's pools and
drains; the router's RSS and open fds are read idle; ``--duration`` s of load
with kills; the load drains (nothing is cancelled) and they are read idle
again. Growth between the two idle readings is a leak. The router exposes no
task count, so its in-flight gauges after the drain stand in for leaked
streams.

Requests: ``--cold-fraction`` of them carry a fresh prompt that no backend
has seen (their TTFT is the cold yardstick); the others one of ``--prompts``
shared prompts (each live backend holds its blocks) with one of ``--seeds``
seeds. Each answer is ``identical``, ``truncated`` (a strict prefix of the
reference, or no ``[DONE]``), ``different``, or an error by kind (``http_502``,
``stream_error``, ...).

Resume gap: the router's ``headrace_resume_gap_seconds`` (from the break to
the next token relayed; p50/p99 interpolated in its buckets) against the cold
requests' TTFT. The client cannot see a migration, so it estimates: a gap
between two tokens longer than 2 TPOT + 20 ms that spans a kill is one (its
count is checked against the router's), split by whether the backend it
continued on held the prompt (the answer's ``usage.cached_tokens``: the mock
caches prompt blocks, so a restarted backend holds nothing).
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import sys
import tempfile
import time
from array import array
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import msgspec
import psutil
import trio
from prometheus_client.parser import text_string_to_metric_families

from backends.errors import BackendUnavailable
from backends.h2client import H2Pool
from bench.client import RequestResult, StreamTimer, classify, leaf
from bench.connect import make_client, make_pool
from bench.procs import Server, cpu_info, start_server
from bench.progress import ProgressBar
from bench.report import write_json
from bench.router_bench import _free_port, _python, _start_all
from bench.schedule import make_prompt
from bench.stats import summarize

__all__ = ["Shape", "Workload", "histogram_quantile", "judge", "main", "migration_gap"]

PATH = "/v1/completions"
STOP = (" old mill",)  # held back whenever " old" ends a piece: the look-behind crosses breaks
DEFAULT_OUT = "bench/results/issue14/chaos.json"
_JSON = [("content-type", "application/json")]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="headrace bench chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", type=int, default=4, help="mock backends behind the router")
    p.add_argument("--concurrency", type=int, default=200, help="streams kept in flight")
    p.add_argument("--duration", type=float, default=90.0, help="seconds of load with kills")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of load before, no kills")
    p.add_argument("--interval", type=float, nargs=2, default=[2.0, 5.0], metavar=("MIN", "MAX"),
                   help="seconds between kills, uniform (seeded)")
    p.add_argument("--down", type=float, default=1.0, help="seconds a killed backend stays down")
    p.add_argument("--max-kills", type=int, default=None, help="stop killing after this many")
    p.add_argument("--max-tokens", type=int, nargs=2, default=[100, 200], metavar=("MIN", "MAX"))
    p.add_argument("--prompt-tokens", type=int, default=1000, help="prompt length (mock tokens are bytes)")
    p.add_argument("--prompts", type=int, default=8, help="shared prompts")
    p.add_argument("--seeds", type=int, default=8, help="seeds per shared prompt")
    p.add_argument("--cold-fraction", type=float, default=0.05,
                   help="requests with a fresh prompt no backend has cached")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--ttft-ms", type=float, default=10.0, help="mock: time to first token")
    p.add_argument("--tpot-ms", type=float, default=20.0, help="mock: time per output token")
    p.add_argument("--block-size", type=int, default=16, help="mock: prefix-cache block size")
    p.add_argument("--cache-blocks", type=int, default=4096, help="mock: prefix-cache capacity")
    p.add_argument("--prefill-ms-per-token", type=float, default=0.2,
                   help="mock: prefill cost of an uncached prompt token (one lane per replica)")
    p.add_argument("--http", choices=("2", "1.1"), default="2",
                   help="2: the lean h2c client; 1.1: httpx, one connection per stream")
    p.add_argument("--policy", default=None, help="routing policy (default: the router's)")
    p.add_argument("--backend-concurrency", type=int, default=256,
                   help="admission slots per backend ([[backends]] max_concurrency)")
    p.add_argument("--workers", type=int, default=1, help="router processes")
    p.add_argument("--health-interval", type=float, default=0.5)
    p.add_argument("--timeout", type=float, default=60.0, help="per stream, seconds")
    p.add_argument("--seed", type=int, default=0, help="seeds the workload and the kills")
    p.add_argument("--out", "--json", dest="out", default=DEFAULT_OUT, help="JSON report path")
    p.add_argument("--plot", dest="plot_path", help="PNG path (default: beside the JSON)")
    p.add_argument("--no-plot", action="store_true")
    return p


# ---------------------------------------------------------------- the workload


class Shape(msgspec.Struct, frozen=True, kw_only=True):
    """What one request asks for; equal shapes have equal answers."""

    prompt: str
    seed: int
    max_tokens: int
    stop: tuple[str, ...] = ()

    def body(self, model: str, temperature: float) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model, "prompt": self.prompt, "max_tokens": self.max_tokens,
            "temperature": temperature, "seed": self.seed, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
        }
        if self.stop:
            body["stop"] = list(self.stop)
        return body


def _prompt(seed: int, index: int, length: int) -> str:
    return make_prompt(seed, index, length // 3 + 1)[:length]  # ASCII: one mock token a byte


class Workload:
    """The shared shapes, and which shape request ``index`` asks (seeded)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.seed, self.args = args.seed, args
        rng = random.Random(f"chaos:{args.seed}")
        self.prompts = [_prompt(args.seed, p, args.prompt_tokens) for p in range(args.prompts)]
        self.shared = [
            Shape(prompt=prompt, seed=rng.randrange(1 << 31), max_tokens=rng.randint(*args.max_tokens),
                  stop=STOP if s % 2 else ())
            for prompt in self.prompts for s in range(args.seeds)
        ]

    def pick(self, index: int) -> tuple[int | None, Shape]:
        """(shared shape number or None for a cold one, the shape)."""
        rng = random.Random(f"chaos:{self.seed}:{index}")
        if rng.random() < self.args.cold_fraction:
            prompt = _prompt(self.seed + 1_000_003, index, self.args.prompt_tokens)
            return None, Shape(prompt=prompt, seed=rng.randrange(1 << 31),
                               max_tokens=rng.randint(*self.args.max_tokens))
        key = rng.randrange(len(self.shared))
        return key, self.shared[key]


# ---------------------------------------------------------------- one stream


class _TextTimer(StreamTimer):
    """A :class:`StreamTimer` that also keeps the text and the cached tokens."""

    def __init__(self, result: RequestResult, start: float) -> None:
        super().__init__(result, start)
        self.parts: list[str] = []
        self.cached: int | None = None

    def _chunk(self, chunk: dict[str, Any], now: float) -> None:
        super()._chunk(chunk, now)
        for choice in chunk.get("choices") or ():
            self.parts.append(str(choice.get("text") or ""))
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


Client = httpx.AsyncClient | H2Pool


async def fetch(client: Client, body: dict[str, Any], patience: float) -> tuple[RequestResult, _TextTimer]:
    """One streamed completion, timed; faults become ``result.error``, never raise."""
    start = trio.current_time()
    result = RequestResult(index=0, scheduled=0.0)
    timer = _TextTimer(result, start)
    with trio.move_on_after(patience) as scope:
        try:
            await _exchange(client, body, result, timer)
        except Exception as exc:  # any fault is a counted outcome
            inner = leaf(exc)
            result.error, result.detail = classify(inner), f"{type(inner).__name__}: {inner}"[:200]
    if scope.cancelled_caught:
        result.error, result.detail = "timeout", f"no complete answer within {patience:g} s"
    if result.e2e is None:
        result.e2e = trio.current_time() - start
    return result, timer


async def _exchange(client: Client, body: dict[str, Any], result: RequestResult, timer: _TextTimer) -> None:
    if isinstance(client, H2Pool):
        async with client.stream("POST", PATH, headers=_JSON, body=msgspec.json.encode(body)) as r:
            if r.status != 200:
                result.error, result.detail = f"http_{r.status}", (await r.read())[:200].decode("utf-8", "replace")
                return
            async for data in r:
                timer.feed(data, trio.current_time())
    else:
        async with client.stream("POST", PATH, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                result.error, result.detail = f"http_{response.status_code}", text[:200]
                return
            async for data in response.aiter_raw():
                timer.feed(data, trio.current_time())
    timer.finish(trio.current_time())


def judge(text: str, error: str | None, reference: str) -> str:
    """``identical``, ``truncated`` (a strict prefix, or no [DONE]), ``different``,
    or ``error`` (an HTTP error, an in-band error event, a transport fault)."""
    if error is not None and error != "truncated":
        return "error"
    if error is None and text == reference:
        return "identical"
    return "truncated" if reference.startswith(text) else "different"


def migration_gap(result: RequestResult, started: float, kills: list[float], threshold: float,
                  slack: float = 0.25) -> float | None:
    """The first gap between token chunks longer than ``threshold`` that spans
    a kill (the kill up to ``slack`` s before the gap's start: the router was
    still relaying the victim's last tokens), or None."""
    if result.ttft is None:
        return None
    at = started + result.ttft
    for gap in result.itl:
        if gap > threshold and any(at - slack <= k <= at + gap for k in kills):
            return gap
        at += gap
    return None


class Outcome(msgspec.Struct, kw_only=True, array_like=True):
    index: int
    key: int | None  # None: a cold prompt
    started: float
    ended: float
    verdict: str
    error: str | None
    ttft: float | None
    gap: float | None  # a migration's client-side gap (estimate)
    warm: bool | None  # the backend answering last held the prompt


# ---------------------------------------------------------------- the load


class Load:
    """Closed loop: ``concurrency`` workers, each sending the next request as
    soon as its last answer is judged."""

    def __init__(self, args: argparse.Namespace, workload: Workload, oracle: Client,
                 model: str, kills: list[float]) -> None:
        self.args, self.workload, self.oracle, self.model, self.kills = args, workload, oracle, model, kills
        self.references: dict[Shape, str] = {}
        self.threshold = 2 * args.tpot_ms / 1000 + 0.02
        self.counter = itertools.count()
        self.reset()

    def reset(self) -> None:
        self.outcomes: list[Outcome] = []
        self.bad: list[dict[str, Any]] = []  # the first non-identical answers, for the report
        self.itl = array("d")
        self.in_flight = self.identical = 0

    async def reference(self, shape: Shape) -> str:
        """The oracle's answer (cached for shared shapes); the oracle never fails."""
        known = self.references.get(shape)
        if known is not None:
            return known
        result, timer = await fetch(self.oracle, shape.body(self.model, self.args.temperature), self.args.timeout)
        if result.error is not None:
            raise BackendUnavailable(f"the oracle failed: {result.error} {result.detail}")
        text = "".join(timer.parts)
        if shape.prompt in self.workload.prompts:
            self.references[shape] = text
        return text

    async def run(self, client: Client, until: float, t0: float) -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(self.args.concurrency):
                nursery.start_soon(self._worker, client, until, t0)

    async def _worker(self, client: Client, until: float, t0: float) -> None:
        while trio.current_time() < until:
            await self._one(client, next(self.counter), t0)

    async def _one(self, client: Client, index: int, t0: float) -> None:
        key, shape = self.workload.pick(index)
        started = trio.current_time()
        self.in_flight += 1
        try:
            result, timer = await fetch(client, shape.body(self.model, self.args.temperature), self.args.timeout)
        finally:
            self.in_flight -= 1
        text, reference = "".join(timer.parts), await self.reference(shape)
        verdict = judge(text, result.error, reference)
        gap = migration_gap(result, started, self.kills, self.threshold)
        warm = None
        if gap is not None and timer.cached is not None and result.prompt_tokens:
            warm = 2 * timer.cached >= result.prompt_tokens
        self.itl.extend(result.itl)
        self.identical += verdict == "identical"
        self.outcomes.append(Outcome(index=index, key=key, started=started - t0, ended=trio.current_time() - t0,
                                     verdict=verdict, error=result.error, ttft=result.ttft, gap=gap, warm=warm))
        if verdict != "identical" and len(self.bad) < 50:
            self.bad.append({"index": index, "key": key, "verdict": verdict, "error": result.error,
                             "detail": result.detail, "chars": len(text), "reference_chars": len(reference),
                             "first_difference": _first_difference(text, reference),
                             "at_s": started - t0})


def _first_difference(a: str, b: str) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


# ---------------------------------------------------------------- the bed


class Slot:
    """One backend position: a fixed port and the process serving it now."""

    def __init__(self, index: int, argv: list[str], port: int) -> None:
        self.name, self.argv, self.port = f"mock{index}", [*argv, "--port", str(port)], port
        self.server: Server | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, logdir: Path, attempts: int = 10) -> None:
        for attempt in range(attempts):
            self.starts += 1
            try:
                self.server = await start_server(f"{self.name}.{self.starts}", self.argv, logdir)
                return
            except BackendUnavailable:
                if attempt + 1 == attempts:
                    raise
                await trio.sleep(0.2)  # e.g. the port not free yet

    async def kill(self) -> None:
        assert self.server is not None
        self.server.process.kill()  # SIGKILL: no goodbye on any socket
        await self.server.process.wait()

    async def stop(self) -> None:
        if self.server is not None:
            with trio.CancelScope(shield=True):
                await self.server.stop(grace=2.0)


def _mock_argv(args: argparse.Namespace, *, oracle: bool = False) -> list[str]:
    argv = _python("router.cli", "mock", "--model", "mock", "--max-tokens", str(max(args.max_tokens)),
                   "--max-context", str(args.prompt_tokens + max(args.max_tokens) + 64))
    if oracle:
        return argv
    return [*argv, "--ttft-ms", f"{args.ttft_ms:g}", "--tpot-ms", f"{args.tpot_ms:g}",
            "--block-size", str(args.block_size), "--cache-blocks", str(args.cache_blocks),
            "--prefill-ms-per-token", f"{args.prefill_ms_per_token:g}"]


def router_config(args: argparse.Namespace, slots: list[Slot]) -> str:
    lines = ["[server]", f"workers = {args.workers}", "[health]", f"interval = {args.health_interval}"]
    if args.policy:
        lines += ["[routing]", f'policy = "{args.policy}"']
    for slot in slots:
        lines += ["[[backends]]", 'kind = "openai"', f'url = "{slot.url}"', f'name = "{slot.name}"',
                  f"max_concurrency = {args.backend_concurrency}"]
    return "\n".join(lines) + "\n"


def process_sample(pid: int) -> dict[str, float]:
    """RSS (MiB) and open fds of ``pid`` and its descendants (router workers)."""
    rss = fds = 0
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            rss += p.memory_info().rss
            fds += p.num_fds()
    except psutil.Error:
        pass
    return {"rss_mib": rss / 2**20, "fds": fds}


def _client(args: argparse.Namespace, url: str) -> Client:
    if args.http == "2":
        return make_pool(url, max_connections=max(4, args.concurrency // 50), api_key=None, timeout=args.timeout)
    return make_client(url, "1.1", max_connections=args.concurrency + 8, api_key=None, timeout=args.timeout)


async def _chaos(args: argparse.Namespace, slots: list[Slot], kills: list[float], log: list[dict[str, Any]],
                 until: float, t0: float, logdir: Path) -> None:
    """Kill a random backend every U(--interval) s, restart it after --down s;
    no kill whose restart would come after ``until``."""
    rng = random.Random(f"chaos-kills:{args.seed}")
    at = t0 + rng.uniform(*args.interval)
    while args.max_kills is None or len(kills) < args.max_kills:
        if at + args.down >= until:
            return
        await trio.sleep_until(at)
        slot = rng.choice(slots)
        killed = trio.current_time()
        await slot.kill()
        kills.append(killed)
        entry = {"at_s": killed - t0, "backend": slot.name}
        log.append(entry)
        await trio.sleep(args.down)
        await slot.start(logdir)
        entry["back_s"] = trio.current_time() - t0
        at = max(trio.current_time(), killed + rng.uniform(*args.interval))


async def _monitor(load: Load, router_pid: int, kills: list[float], timeline: list[dict[str, Any]],
                   t0: float, duration: float) -> None:
    bar = ProgressBar("chaos", log_every=1.0)
    while True:
        now = trio.current_time()
        sample = process_sample(router_pid)
        done = len(load.outcomes)
        timeline.append({"t_s": now - t0, "done": done, "in_flight": load.in_flight, **sample})
        pct = 100.0 * load.identical / done if done else 100.0
        bar.update(min(1.0, (now - t0) / duration),
                   f"{now - t0:5.1f}s streams {done} identical {pct:.2f}% bad {done - load.identical} "
                   f"kills {len(kills)} in-flight {load.in_flight} router RSS {sample['rss_mib']:.0f} MiB "
                   f"fds {sample['fds']:.0f}", time.monotonic())
        await trio.sleep(1.0)


# ---------------------------------------------------------------- router metrics


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus's ``histogram_quantile``: ``buckets`` are (le, cumulative
    count), +Inf last; linear inside the bucket; the +Inf bucket answers the
    last finite bound."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower
            inside = count - below
            return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = le, count
    return lower


def parse_metrics(text: str) -> dict[str, Any]:
    """The counters and histograms the report needs, summed over backends."""
    hist: dict[str, dict[float, float]] = {}
    out: dict[str, Any] = {"migrations": {}, "gauges": {}, "counters": {}}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_bucket") and family.type == "histogram":
                le = float(s.labels["le"])
                hist.setdefault(family.name, {})
                hist[family.name][le] = hist[family.name].get(le, 0.0) + s.value
            elif family.name == "headrace_migrations" and s.name.endswith("_total"):
                key = f"{s.labels['reason']}:{s.labels['outcome']}"
                out["migrations"][key] = out["migrations"].get(key, 0) + int(s.value)
            elif family.type == "gauge" and family.name.endswith(("in_flight", "_busy", "budget_active")):
                out["gauges"][family.name] = out["gauges"].get(family.name, 0.0) + s.value
            elif family.type == "counter" and s.name.endswith("_total"):
                out["counters"][family.name] = out["counters"].get(family.name, 0.0) + s.value
    out["histograms"] = {name: sorted(b.items()) for name, b in hist.items()}
    return out


def _hist_ms(metrics: dict[str, Any], name: str) -> dict[str, Any]:
    buckets = metrics["histograms"].get(name, [])
    n = int(buckets[-1][1]) if buckets else 0
    p50, p99 = (histogram_quantile(buckets, q) for q in (0.5, 0.99))
    return {"n": n, "p50": p50 * 1000 if p50 is not None else None,
            "p99": p99 * 1000 if p99 is not None else None}


# ---------------------------------------------------------------- the run


async def _scrape(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=10) as c:
        return parse_metrics((await c.get("/metrics")).text)


async def _warm_cache(args: argparse.Namespace, workload: Workload, slot: Slot) -> None:
    """The backend holds every shared prompt (as in a fleet that has run a while)."""
    async with make_pool(slot.url, max_connections=1, api_key=None, timeout=args.timeout) as pool:
        for prompt in workload.prompts:
            shape = Shape(prompt=prompt, seed=0, max_tokens=1)
            result, _ = await fetch(pool, shape.body("mock", args.temperature), args.timeout)
            if result.error is not None:
                raise BackendUnavailable(f"{slot.name} failed the cache warm-up: {result.error} {result.detail}")


async def _references(load: Load, at_once: int = 8) -> None:
    limit = trio.Semaphore(at_once)

    async def one(shape: Shape) -> None:
        async with limit:
            await load.reference(shape)

    async with trio.open_nursery() as nursery:
        for shape in load.workload.shared:
            nursery.start_soon(one, shape)


async def _all_up(url: str, n: int, patience: float = 60.0) -> None:
    """Until the router's /ready lists all ``n`` backends up."""
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=5) as client:
        with trio.move_on_after(patience):
            while True:
                try:
                    r = await client.get("/ready")
                    if r.status_code == 200 and len(r.json().get("backends_up", ())) == n:
                        return
                except httpx.HTTPError:
                    pass
                await trio.sleep(0.1)
    raise BackendUnavailable(f"{url}/ready did not list {n} backends up within {patience:g} s")


async def _check_oracle(args: argparse.Namespace, load: Load, slot: Slot) -> bool:
    """The oracle answers as a routed backend does (one shape asked directly)."""
    shape = load.workload.shared[-1]
    async with make_pool(slot.url, max_connections=1, api_key=None, timeout=args.timeout) as pool:
        result, timer = await fetch(pool, shape.body(load.model, args.temperature), args.timeout)
    return result.error is None and "".join(timer.parts) == await load.reference(shape)


async def _phase(load: Load, args: argparse.Namespace, url: str, seconds: float, t0: float) -> None:
    async with _client(args, url) as client:
        await load.run(client, t0 + seconds, t0)


async def run(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    logdir = Path(tempfile.mkdtemp(prefix="headrace-chaos-"))
    doc["logs"] = str(logdir)
    began = trio.current_time()
    workload = Workload(args)
    async with AsyncExitStack() as stack:
        slots = [Slot(i, _mock_argv(args), _free_port()) for i in range(args.backends)]
        for slot in slots:
            stack.push_async_callback(slot.stop)
        config = logdir / "router.toml"
        config.write_text(router_config(args, slots))
        serve = _python("router.cli", "serve", "--config", str(config), "--port", "0", "--log-level", "WARNING")
        started: list[Server] = []

        async def servers() -> None:  # the ports are fixed: the router need not wait for the mocks
            oracle_argv = [*_mock_argv(args, oracle=True), "--port", "0"]
            started.extend(await _start_all(stack, logdir, [("oracle", oracle_argv), ("router", serve)]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(servers)
            for slot in slots:
                nursery.start_soon(slot.start, logdir)
        oracle, router = started
        await _all_up(router.url, len(slots))
        doc["bed"] = {"router": router.url, "backends": [s.url for s in slots], "oracle": oracle.url,
                      "router_config": config.read_text()}
        oracle_pool = await stack.enter_async_context(
            make_pool(oracle.url, max_connections=2, api_key=None, timeout=args.timeout))
        kills: list[float] = []
        load = Load(args, workload, oracle_pool, "mock", kills)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_references, load)
            for slot in slots:
                nursery.start_soon(_warm_cache, args, workload, slot)
        doc["bed"]["oracle_agrees"] = await _check_oracle(args, load, slots[0])

        print(f"headrace bench chaos: bed up, references and caches ready in {trio.current_time() - began:.1f} s "
              f"(logs: {logdir}); warm-up: {args.warmup:g} s of load without kills", file=sys.stderr)
        await _phase(load, args, router.url, args.warmup, trio.current_time())
        doc["warmup"] = {"streams": len(load.outcomes), "identical": load.identical}
        await trio.sleep(1.0)
        doc["router"] = {"idle_before": process_sample(router.pid)}

        load.reset()
        timeline: list[dict[str, Any]] = doc["timeline"]
        t0 = trio.current_time()
        until = t0 + args.duration
        try:
            async with trio.open_nursery() as outer:
                outer.start_soon(_monitor, load, router.pid, kills, timeline, t0, args.duration)
                async with trio.open_nursery() as inner:
                    inner.start_soon(_chaos, args, slots, kills, doc["kills"], until, t0, logdir)
                    inner.start_soon(_phase, load, args, router.url, args.duration, t0)
                outer.cancel_scope.cancel()
            doc["drained_s"] = trio.current_time() - until
            await trio.sleep(1.0)
            metrics = await _scrape(router.url)
            await trio.sleep(0.5)
            doc["router"]["idle_after"] = process_sample(router.pid)
            doc["metrics"] = metrics
        finally:
            doc["streams"] = summarize_streams(load)
            doc["samples"] = _samples(load)


def summarize_streams(load: Load) -> dict[str, Any]:
    outcomes = load.outcomes
    verdicts = Counter(o.verdict for o in outcomes)
    total = len(outcomes)
    errors = Counter(o.error for o in outcomes if o.verdict == "error")
    migrated = [o for o in outcomes if o.gap is not None]
    ms = 1000.0
    return {
        "total": total,
        "identical": verdicts["identical"],
        "identical_pct": 100.0 * verdicts["identical"] / total if total else None,
        "truncated": verdicts["truncated"],
        "different": verdicts["different"],
        "errored": verdicts["error"],
        "errors": dict(sorted((str(k), v) for k, v in errors.items())),
        "cold_prompts": sum(o.key is None for o in outcomes),
        "not_identical": load.bad,
        "ttft_cold_ms": msgspec.to_builtins(summarize([o.ttft for o in outcomes if o.key is None and o.ttft is not None], scale=ms)),
        "ttft_warm_ms": msgspec.to_builtins(summarize([o.ttft for o in outcomes if o.key is not None and o.ttft is not None], scale=ms)),
        "itl_ms": msgspec.to_builtins(summarize(load.itl, scale=ms)),
        "client_migrated": {
            "count": len(migrated),
            "warm": sum(o.warm is True for o in migrated),
            "cold": sum(o.warm is False for o in migrated),
            "gap_ms": msgspec.to_builtins(summarize([o.gap for o in migrated if o.gap is not None], scale=ms)),
            "gap_warm_ms": msgspec.to_builtins(summarize([o.gap for o in migrated if o.warm and o.gap is not None], scale=ms)),
            "gap_cold_ms": msgspec.to_builtins(summarize([o.gap for o in migrated if o.warm is False and o.gap is not None], scale=ms)),
        },
    }


def _samples(load: Load, most: int = 2000) -> dict[str, Any]:
    """Raw values for the plot (the first ``most`` of each)."""
    def ms(values: list[float]) -> list[float]:
        return [round(v * 1000, 2) for v in values[:most]]

    out = load.outcomes
    return {
        "ttft_cold_ms": ms([o.ttft for o in out if o.key is None and o.ttft is not None]),
        "ttft_warm_ms": ms([o.ttft for o in out if o.key is not None and o.ttft is not None]),
        "gap_warm_ms": ms([o.gap for o in out if o.warm and o.gap is not None]),
        "gap_cold_ms": ms([o.gap for o in out if o.warm is False and o.gap is not None]),
        "ended_s": [round(o.ended, 2) for o in out],
        "identical": [o.verdict == "identical" for o in out],
    }


# ---------------------------------------------------------------- the report


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def conclude(doc: dict[str, Any]) -> None:
    """The summary numbers the issue asks for, from what the run recorded."""
    streams, router, metrics = doc.get("streams", {}), doc.get("router", {}), doc.get("metrics")
    before, after = router.get("idle_before"), router.get("idle_after")
    if before and after:
        router["rss_growth_pct"] = 100.0 * (after["rss_mib"] - before["rss_mib"]) / before["rss_mib"]
        router["fds_growth"] = after["fds"] - before["fds"]
    loaded = [r for r in doc.get("timeline", []) if 1.0 <= r["t_s"] <= doc["config"]["duration"]]
    if len(loaded) >= 2:
        router["loaded_start"], router["loaded_end"] = loaded[0], loaded[-1]
        router["loaded_rss_growth_pct"] = 100.0 * (loaded[-1]["rss_mib"] - loaded[0]["rss_mib"]) / loaded[0]["rss_mib"]
    router["tasks"] = ("the router exposes no task count; in_flight_after_drain (its in-flight gauges "
                       "after the load drained) stands in for leaked streams")
    if metrics is not None:
        router["in_flight_after_drain"] = metrics["gauges"]
        m = metrics["migrations"]
        doc["migrations"] = {
            "by_reason_outcome": m, "total": sum(m.values()),
            "resumed": sum(v for k, v in m.items() if k.endswith(":resumed")),
            "replayed": sum(v for k, v in m.items() if k.endswith(":replayed")),
            "failed": sum(v for k, v in m.items() if k.endswith(":failed")),
            "divergences": metrics["counters"].get("headrace_migration_replay_divergences", 0),
            "inexact": metrics["counters"].get("headrace_migration_inexact", 0),
            "retries_refused": metrics["counters"].get("headrace_dispatch_retries_refused", 0),
        }
        doc["resume_gap_ms"] = _hist_ms(metrics, "headrace_resume_gap_seconds")
        doc["router_ttft_ms"] = _hist_ms(metrics, "headrace_time_to_first_token_seconds")
        del doc["metrics"]["histograms"]
    cold = streams.get("ttft_cold_ms", {})
    gap = doc.get("resume_gap_ms", {})
    client = streams.get("client_migrated", {})
    doc["ratios"] = {
        "resume_gap_p50_over_cold_ttft_p50": _ratio(gap.get("p50"), cold.get("p50")),
        "resume_gap_p99_over_cold_ttft_p99": _ratio(gap.get("p99"), cold.get("p99")),
        "client_gap_warm_p50_over_cold_ttft_p50": _ratio(client.get("gap_warm_ms", {}).get("p50"), cold.get("p50")),
        "client_gap_warm_p99_over_cold_ttft_p99": _ratio(client.get("gap_warm_ms", {}).get("p99"), cold.get("p99")),
        "client_gap_cold_p50_over_cold_ttft_p50": _ratio(client.get("gap_cold_ms", {}).get("p50"), cold.get("p50")),
    }
    r = doc["ratios"]
    doc["targets"] = {
        "identical >= 99.9%": (streams.get("identical_pct") or 0) >= 99.9,
        "router RSS growth <= 10%": router.get("rss_growth_pct", math.inf) <= 10.0,
        "router fds not grown": router.get("fds_growth", math.inf) <= 0,
        "resume gap p50 <= 1x cold TTFT p50": (r["resume_gap_p50_over_cold_ttft_p50"] or math.inf) <= 1.0,
        "resume gap (prompt held) p50 <= 0.3x cold TTFT p50": (r["client_gap_warm_p50_over_cold_ttft_p50"] or math.inf) <= 0.3,
    }


def _f(value: float | None, spec: str = ".1f") -> str:
    return format(value, spec) if value is not None else "-"


def format_report(doc: dict[str, Any]) -> str:
    cpu, c, s = doc["cpu"], doc["config"], doc.get("streams", {})
    router, mig = doc.get("router", {}), doc.get("migrations", {})
    cold, warm = s.get("ttft_cold_ms", {}), s.get("ttft_warm_ms", {})
    gap, client = doc.get("resume_gap_ms", {}), s.get("client_migrated", {})
    before, after = router.get("idle_before", {}), router.get("idle_after", {})
    lines = [
        f"CPU: {cpu['model']} ({cpu['cores']} cores; {', '.join(cpu['features'])})",
        f"{c['backends']} mocks (TTFT {c['ttft_ms']:g} ms + {c['prefill_ms_per_token']:g} ms per uncached "
        f"prompt token, TPOT {c['tpot_ms']:g} ms), {c['concurrency']} streams (h{c['http']}), "
        f"{c['duration']:g} s, prompts of {c['prompt_tokens']} tokens, {c['max_tokens'][0]}-{c['max_tokens'][1]} out",
        f"kills: {len(doc.get('kills', []))} (SIGKILL, back after {c['down']:g} s, every "
        f"{c['interval'][0]:g}-{c['interval'][1]:g} s)",
        "",
        f"{'streams':<34} {s.get('total', 0):>8}",
        f"{'  identical to the reference':<34} {s.get('identical', 0):>8}  ({_f(s.get('identical_pct'), '.3f')} %)",
        f"{'  truncated / different':<34} {s.get('truncated', 0):>4} / {s.get('different', 0)}",
        f"{'  errored':<34} {s.get('errored', 0):>8}  {s.get('errors') or ''}",
        f"{'migrations (router)':<34} {mig.get('total', '-'):>8}  {mig.get('by_reason_outcome', '')}",
        f"{'  migrated streams seen by client':<34} {client.get('count', 0):>8}  "
        f"(new backend held the prompt: {client.get('warm', 0)}, did not: {client.get('cold', 0)})",
        "",
        f"{'':<34} {'p50 ms':>9} {'p99 ms':>9} {'n':>6}",
        f"{'cold TTFT (client, fresh prompt)':<34} {_f(cold.get('p50')):>9} {_f(cold.get('p99')):>9} {cold.get('n', 0):>6}",
        f"{'warm TTFT (client, shared prompt)':<34} {_f(warm.get('p50')):>9} {_f(warm.get('p99')):>9} {warm.get('n', 0):>6}",
        f"{'resume gap (router histogram)':<34} {_f(gap.get('p50')):>9} {_f(gap.get('p99')):>9} {gap.get('n', 0):>6}",
    ]
    for label, key in (("  client: new backend held prompt", "gap_warm_ms"), ("  client: it did not", "gap_cold_ms")):
        g = client.get(key, {})
        lines.append(f"{label:<34} {_f(g.get('p50')):>9} {_f(g.get('p99')):>9} {g.get('n', 0):>6}")
    itl = s.get("itl_ms", {})
    lines.append(f"{'inter-token latency (client)':<34} {_f(itl.get('p50')):>9} {_f(itl.get('p99')):>9}")
    lines.append("")
    for name, value in doc.get("ratios", {}).items():
        lines.append(f"  {name}: {_f(value, '.2f')}")
    if before and after:
        lines += ["", f"router idle before / after: RSS {before['rss_mib']:.1f} / {after['rss_mib']:.1f} MiB "
                      f"({_f(router.get('rss_growth_pct'), '+.1f')} %), fds {before['fds']:.0f} / {after['fds']:.0f}"]
    if "loaded_rss_growth_pct" in router:
        lines.append(f"router RSS under load, start / end: {router['loaded_start']['rss_mib']:.1f} / "
                     f"{router['loaded_end']['rss_mib']:.1f} MiB ({router['loaded_rss_growth_pct']:+.1f} %)")
    if "in_flight_after_drain" in router:
        lines.append(f"in-flight gauges after the drain: {router['in_flight_after_drain']} ({router['tasks'].split(';')[0]})")
    lines += ["", "targets: " + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in doc.get("targets", {}).items())]
    if doc.get("interrupted"):
        lines.append(f"interrupted: {doc['interrupted']}")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> Path:
    """Left: answers per second (identical / not) with the kills and the
    router's RSS; right: CDFs of cold and warm TTFT and of the resume gaps."""
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    from bench.plot import _figure, _save

    fig, (left, right) = _figure(2, f"bench chaos: {doc['config']['backends']} backends, "
                                    f"{doc['config']['concurrency']} streams")
    samples = doc.get("samples", {})
    ended, same = samples.get("ended_s", []), samples.get("identical", [])
    seconds = int(max(ended, default=0)) + 1
    good, bad = [0] * seconds, [0] * seconds
    for t, ok in zip(ended, same, strict=True):
        (good if ok else bad)[int(t)] += 1
    left.plot(range(seconds), good, color="C0", label="identical answers / s")
    if any(bad):
        left.plot(range(seconds), bad, "x", color="C3", label="not identical / s")
    for i, k in enumerate(doc.get("kills", [])):
        left.axvspan(k["at_s"], k.get("back_s", k["at_s"]), color="C3", alpha=0.2, label="backend down" if i == 0 else None)
    left.set_xlabel("seconds")
    left.set_ylabel("answers per second")
    rss = left.twinx()
    rows = doc.get("timeline", [])
    rss.plot([r["t_s"] for r in rows], [r["rss_mib"] for r in rows], "--", color="C2", label="router RSS")
    rss.set_ylabel("router RSS (MiB)")
    rss.set_ylim(0, 1.25 * max((r["rss_mib"] for r in rows), default=1.0))
    left.legend(fontsize="small", loc="lower left")
    left.grid(True, alpha=0.3)
    for key, label in (("ttft_cold_ms", "TTFT, fresh prompt"), ("ttft_warm_ms", "TTFT, shared prompt"),
                       ("gap_warm_ms", "resume gap, prompt held"), ("gap_cold_ms", "resume gap, not held")):
        values = sorted(samples.get(key, []))
        if values:
            right.plot(values, [(i + 1) / len(values) for i in range(len(values))], drawstyle="steps-post",
                       marker="o" if len(values) < 20 else None, label=f"{label} (n={len(values)})")
    right.set_xscale("log")
    right.xaxis.set_major_formatter(ScalarFormatter())
    right.xaxis.set_minor_formatter(NullFormatter())
    right.set_xlabel("ms (client side)")
    right.set_ylabel("fraction")
    right.grid(True, alpha=0.3)
    right.legend(fontsize="small")
    return _save(fig, path)


def _check(args: argparse.Namespace) -> None:
    from backends.errors import ClientError

    if args.backends < 2 or args.concurrency < 1 or args.duration <= 0 or args.warmup < 0:
        raise ClientError("--backends >= 2, --concurrency >= 1, --duration > 0, --warmup >= 0")
    if not 0 < args.interval[0] <= args.interval[1] or args.down < 0:
        raise ClientError("--interval MIN MAX with 0 < MIN <= MAX, --down >= 0")
    if not 1 <= args.max_tokens[0] <= args.max_tokens[1]:
        raise ClientError("--max-tokens MIN MAX with 1 <= MIN <= MAX")


def main(argv: list[str]) -> int:
    from bench.cli import describe_stop, is_interrupt

    args = _parser().parse_args(argv)
    _check(args)
    cpu = cpu_info()
    doc: dict[str, Any] = {"kind": "chaos", "cpu": {k: v for k, v in cpu.items() if k != "flags"},
                           "config": {k: v for k, v in vars(args).items() if k not in ("out", "plot_path", "no_plot")},
                           "kills": [], "timeline": []}
    try:
        trio.run(run, args, doc)
    except BaseException as exc:  # the report is written whatever stopped the run
        doc["interrupted"] = describe_stop(exc)
        _finish(args, doc)
        if is_interrupt(exc):
            return 130
        raise
    _finish(args, doc)
    return 0


def _finish(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    conclude(doc)
    print(format_report(doc))
    path = write_json(args.out, doc)
    print(f"wrote {path}", file=sys.stderr)
    if not args.no_plot:
        print(f"wrote {plot(doc, Path(args.plot_path or path.with_suffix('.png')))}", file=sys.stderr)

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
again. Growth between the two idle readings is a leak, or a warm-up: with
``--phases N`` the chaos phase and its drain run N times, read idle after
each, and a leak grows again in every phase where caches warming up do not.
``--tracemalloc FRAMES`` starts the router under :mod:`tracemalloc` (a
diagnostic run: tracing slows it) and diffs its heap between the idle
readings (after a ``gc.collect``): the allocation sites that grew most.
Leaked streams would show in the router's Trio task count
(``headrace_router_tasks``) idle before and after, and in its in-flight
gauges after the drain.

Requests: ``--cold-fraction`` of them carry a fresh prompt that no backend
has seen, the others one of ``--prompts`` shared prompts (every live backend
holds their blocks) with one of ``--seeds`` seeds. Each answer is
``identical``, ``truncated`` (a strict prefix of the reference, or no
``[DONE]``), ``different``, or an error by kind (``http_502``,
``stream_error``, ...).

Resume gap against cold TTFT: the client cannot tell a migrated stream (that
is the point), so both come from the router's histograms
(``headrace_resume_gap_seconds``, from the break to the next token relayed,
and ``headrace_time_to_first_token_seconds``; p50/p99 interpolated inside
their buckets), split by backend name: the router sees each mock twice, as
``mockI`` in the route ``mock`` (shared prompts) and as ``mockI-cold`` in the
route ``cold`` (fresh prompts, upstream model ``mock``). A stream of ``mock``
resumes on a backend that holds its prompt (the mock caches prompt blocks;
one restarted a moment ago may not yet), a stream of ``cold`` on one that
does not, and the TTFT of ``cold`` is the cold TTFT. The client's own TTFT
of the fresh prompts is reported beside it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import re
import sys
import tempfile
import time
import tracemalloc
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
from bench.procs import Server, cpu_info, cpu_seconds, start_server
from bench.progress import ProgressBar
from bench.report import dash, write_json
from bench.router_bench import _free_port, _python, _start_all
from bench.schedule import make_prompt
from bench.stats import summarize
from frontend import metric_names as N

__all__ = ["Shape", "Workload", "histogram_quantile", "judge", "main", "metrics_delta", "parse_metrics"]

PATH = "/v1/completions"
MODEL, COLD = "mock", "cold"  # the routes of the shared prompts and of the fresh ones
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
    p.add_argument("--max-tokens", type=int, nargs=2, default=[50, 100], metavar=("MIN", "MAX"),
                   help="output tokens, uniform per shape (5-10 s streams at the default TPOT: about "
                        "two kills in a stream's life, under the default limit of 3 migrations)")
    p.add_argument("--prompt-tokens", type=int, default=1000, help="prompt length (mock tokens are bytes)")
    p.add_argument("--prompts", type=int, default=8, help="shared prompts")
    p.add_argument("--seeds", type=int, default=8, help="seeds per shared prompt")
    p.add_argument("--cold-fraction", type=float, default=0.05,
                   help="requests with a fresh prompt no backend has cached")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--ttft-ms", type=float, default=10.0, help="mock: time to first token")
    p.add_argument("--tpot-ms", type=float, default=100.0,
                   help="mock: time per output token (200 streams at 20 ms are 10k tokens/s, more "
                        "than one router process relays on two shared cores)")
    p.add_argument("--block-size", type=int, default=16, help="mock: prefix-cache block size")
    p.add_argument("--cache-blocks", type=int, default=4096, help="mock: prefix-cache capacity")
    p.add_argument("--prefill-ms-per-token", type=float, default=0.2,
                   help="mock: prefill cost of an uncached prompt token (one lane per replica)")
    p.add_argument("--prefill-chunk-tokens", type=int, default=512,
                   help="mock: chunked prefill, tokens a prefill holds the lane at a time (the "
                        "engine's budget per step: a resumed stream waits at most one chunk of a "
                        "fresh prompt's prefill); 0: whole prompts, non-preemptive")
    p.add_argument("--http", choices=("2", "1.1"), default="2",
                   help="2: the lean h2c client; 1.1: httpx, one connection per stream")
    p.add_argument("--streams-per-connection", type=int, default=10,
                   help="h2: the router's max_concurrent_streams, so the load comes over "
                        "concurrency / N connections, as from many clients (hypercorn's "
                        "HTTP/2 scheduling costs grow with the streams on one connection)")
    p.add_argument("--policy", default=None, help="routing policy (default: the router's)")
    p.add_argument("--upstream-priority", choices=("higher_first", "off"), default="higher_first",
                   help="[[backends]] options.priority: the mocks order their prefill lane by it, as the "
                        "engine's scheduler does, so a resumed stream (priority raised by one) waits "
                        "behind no fresh prompt's prefill; off: every request in arrival order")
    p.add_argument("--standby-tokens", type=int, default=0,
                   help="[migration] standby_tokens: every N tokens a stream's prompt and output so far are "
                        "prefilled on a standby that holds its prompt, where a resume then goes (0: off)")
    p.add_argument("--backend-concurrency", type=int, default=256,
                   help="admission slots per backend ([[backends]] max_concurrency)")
    p.add_argument("--workers", type=int, default=1, help="router processes")
    p.add_argument("--mock-nice", type=int, default=10,
                   help="niceness of the mocks, so that a restarted mock's start (a second of "
                        "imports) does not take the router's core on a small box; 0: off")
    p.add_argument("--health-interval", type=float, default=0.5)
    p.add_argument("--max-ejection-fraction", type=float, default=0.25,
                   help="[breaker] max_ejection_fraction, of each route's backends (one entry per "
                        "mock): the default 0.25 ejects at most one of 4 mocks at once")
    p.add_argument("--breaker", action=argparse.BooleanOptionalAction, default=True,
                   help="the router's circuit breakers ([breaker] enabled)")
    p.add_argument("--error-pause", type=float, default=1.0,
                   help="seconds a client waits after an error before its next request (a "
                        "closed loop that does not would turn an outage into thousands of 503s)")
    p.add_argument("--timeout", type=float, default=60.0, help="per stream, seconds")
    p.add_argument("--settle", type=float, default=5.0,
                   help="seconds idle before each idle reading of the router (its heap trimmer runs every "
                        "2 s; runs before this option read after 1-1.5 s)")
    p.add_argument("--phases", type=int, default=1,
                   help="chaos phases (each --duration s and a drain), the router read idle after each: "
                        "a leak grows in every phase, a warm-up only in the first")
    p.add_argument("--tracemalloc", type=int, default=0, metavar="FRAMES",
                   help="run the router under tracemalloc with this many frames and diff its heap "
                        "between the idle readings (diagnostic: tracing slows the router several times, "
                        "and its RSS then counts the snapshots' own memory); 0: off")
    p.add_argument("--seed", type=int, default=0, help="seeds the workload and the kills")
    p.add_argument("--out", "--json", dest="out", default=DEFAULT_OUT, help="JSON report path")
    p.add_argument("--plot", dest="plot_path", help="PNG path (default: beside the JSON)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--report", metavar="JSON", help="print the table of a saved run; run nothing")
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
        """(shared shape number, or None for a fresh prompt: model ``cold``; the shape)."""
        rng = random.Random(f"chaos:{self.seed}:{index}")
        if rng.random() < self.args.cold_fraction:
            prompt = _prompt(self.seed + 1_000_003, index, self.args.prompt_tokens)
            return None, Shape(prompt=prompt, seed=rng.randrange(1 << 31),
                               max_tokens=rng.randint(*self.args.max_tokens))
        key = rng.randrange(len(self.shared))
        return key, self.shared[key]


# ---------------------------------------------------------------- one stream


class _TextTimer(StreamTimer):
    """A :class:`StreamTimer` that also keeps the text."""

    def __init__(self, result: RequestResult, start: float) -> None:
        super().__init__(result, start)
        self.parts: list[str] = []

    def _chunk(self, chunk: dict[str, Any], now: float) -> None:
        super()._chunk(chunk, now)
        for choice in chunk.get("choices") or ():
            self.parts.append(str(choice.get("text") or ""))


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


class Outcome(msgspec.Struct, kw_only=True, array_like=True):
    index: int
    key: int | None  # None: a cold prompt
    started: float
    ended: float
    verdict: str
    error: str | None
    ttft: float | None


# ---------------------------------------------------------------- the load


class Load:
    """Closed loop: ``concurrency`` workers, each sending the next request as
    soon as its last answer is judged."""

    def __init__(self, args: argparse.Namespace, workload: Workload, oracle: Client) -> None:
        self.args, self.workload, self.oracle = args, workload, oracle
        self.references: dict[Shape, str] = {}
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
        result, timer = await fetch(self.oracle, shape.body(MODEL, self.args.temperature), self.args.timeout)
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
            if not await self._one(client, next(self.counter), t0):
                await trio.sleep(self.args.error_pause)

    async def _one(self, client: Client, index: int, t0: float) -> bool:
        """One request, judged; False when it ended with an error."""
        key, shape = self.workload.pick(index)
        started = trio.current_time()
        self.in_flight += 1
        try:
            model = MODEL if key is not None else COLD
            result, timer = await fetch(client, shape.body(model, self.args.temperature), self.args.timeout)
        finally:
            self.in_flight -= 1
        text, reference = "".join(timer.parts), await self.reference(shape)
        verdict = judge(text, result.error, reference)
        self.itl.extend(result.itl)
        self.identical += verdict == "identical"
        self.outcomes.append(Outcome(index=index, key=key, started=started - t0, ended=trio.current_time() - t0,
                                     verdict=verdict, error=result.error, ttft=result.ttft))
        if verdict != "identical" and len(self.bad) < 50:
            self.bad.append({"index": index, "key": key, "verdict": verdict, "error": result.error,
                             "detail": result.detail, "chars": len(text), "reference_chars": len(reference),
                             "first_difference": _first_difference(text, reference),
                             "at_s": started - t0})
        return result.error is None


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
        self.spent = 0.0  # CPU seconds of the processes killed so far

    def cpu_seconds(self) -> float:
        """CPU seconds of every process that has served this slot (to about
        the kill: a process's last moments are not read)."""
        return self.spent + (cpu_seconds(self.server.pid) if self.server is not None else 0.0)

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
        self.spent += cpu_seconds(self.server.pid)
        self.server.process.kill()  # SIGKILL: no goodbye on any socket
        await self.server.process.wait()

    async def stop(self) -> None:
        if self.server is not None:
            with trio.CancelScope(shield=True):
                await self.server.stop(grace=2.0)


def _mock_argv(args: argparse.Namespace, *, oracle: bool = False) -> list[str]:
    nice = ["nice", "-n", str(args.mock_nice)] if args.mock_nice else []
    argv = nice + _python("router.cli", "mock", "--model", MODEL, "--max-tokens", str(max(args.max_tokens)),
                   "--max-context", str(args.prompt_tokens + max(args.max_tokens) + 64))
    if oracle:
        return argv
    return [*argv, "--ttft-ms", f"{args.ttft_ms:g}", "--tpot-ms", f"{args.tpot_ms:g}",
            "--block-size", str(args.block_size), "--cache-blocks", str(args.cache_blocks),
            "--prefill-ms-per-token", f"{args.prefill_ms_per_token:g}",
            "--prefill-chunk-tokens", str(args.prefill_chunk_tokens)]


# The router under tracemalloc: a thread takes a snapshot (after gc.collect)
# whenever a LABEL.want file appears in the directory, as LABEL.snap, then
# renames the request LABEL.done. argv: frames, directory, the router's argv.
_TRACED = """
import gc, os, runpy, sys, threading, time, tracemalloc
frames, where = int(sys.argv[1]), sys.argv[2]
tracemalloc.start(frames)
def watch():
    while True:
        for name in sorted(os.listdir(where)):
            if name.endswith('.want'):
                label = name[:-5]
                gc.collect()
                tracemalloc.take_snapshot().dump(os.path.join(where, label + '.snap'))
                os.replace(os.path.join(where, name), os.path.join(where, label + '.done'))
        time.sleep(0.2)
threading.Thread(target=watch, daemon=True, name='tracemalloc-snapshots').start()
sys.argv = ['router.cli', *sys.argv[3:]]
runpy.run_module('router.cli', run_name='__main__', alter_sys=True)
"""


def traced_argv(frames: int, where: Path, argv: list[str]) -> list[str]:
    """``python -m router.cli ...`` (``argv``) run under tracemalloc, snapshots on request in ``where``."""
    assert argv[1:3] == ["-m", "router.cli"], argv
    return [argv[0], "-c", _TRACED, str(frames), str(where), *argv[3:]]


async def heap_snapshot(where: Path, label: str, patience: float = 120.0) -> Path:
    """Ask the traced router for a snapshot; its path once written."""
    (where / f"{label}.want").touch()
    with trio.move_on_after(patience):
        while True:
            if (where / f"{label}.done").exists():
                return where / f"{label}.snap"
            await trio.sleep(0.2)
    raise BackendUnavailable(f"the router wrote no heap snapshot {label!r} within {patience:g} s")


_NOISE = (tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap*>"),
          tracemalloc.Filter(False, "<unknown>"))


def heap_diff(before: Path, after: Path, top: int = 20) -> dict[str, Any]:
    """The traced heap's growth from ``before`` to ``after``: totals, the
    sites (innermost frame) that grew most, and the tracebacks of the
    largest growths (their 8 innermost frames, the innermost last)."""
    a = tracemalloc.Snapshot.load(str(before)).filter_traces(_NOISE)
    b = tracemalloc.Snapshot.load(str(after)).filter_traces(_NOISE)

    def total(snap: tracemalloc.Snapshot) -> tuple[int, int]:
        stats = snap.statistics("filename")
        return sum(x.size for x in stats), sum(x.count for x in stats)

    (size_a, count_a), (size_b, count_b) = total(a), total(b)
    by_line = [{"site": str(d.traceback[0]), "growth_kib": d.size_diff / 1024, "size_kib": d.size / 1024,
                "count_growth": d.count_diff} for d in b.compare_to(a, "lineno")[:top]]
    by_trace = [{"growth_kib": d.size_diff / 1024, "count_growth": d.count_diff,
                 "traceback": [str(f) for f in d.traceback][-8:]}
                for d in b.compare_to(a, "traceback")[: top // 2]]
    return {"before_mib": size_a / 2**20, "after_mib": size_b / 2**20, "growth_kib": (size_b - size_a) / 1024,
            "blocks_before": count_a, "blocks_after": count_b, "top_sites": by_line, "top_tracebacks": by_trace}


def router_config(args: argparse.Namespace, slots: list[Slot]) -> str:
    """Each mock twice: ``mockI`` serves the route ``mock``, ``mockI-cold`` the
    route ``cold`` (so the router's per-backend histograms split by it)."""
    lines = ["[server]", f"workers = {args.workers}", f"max_concurrent_streams = {args.streams_per_connection}",
             "[health]", f"interval = {args.health_interval}"]
    if args.policy:
        lines += ["[routing]", f'policy = "{args.policy}"']
    if args.standby_tokens:
        lines += ["[migration]", f"standby_tokens = {args.standby_tokens}"]
    for slot in slots:
        for name in (slot.name, f"{slot.name}-{COLD}"):
            lines += ["[[backends]]", 'kind = "openai"', f'url = "{slot.url}"', f'name = "{name}"',
                      f"max_concurrency = {args.backend_concurrency}",
                      f'options = {{ priority = "{args.upstream_priority}" }}']
    # The breakers' fleet rule is per route (model group): the fraction is of its N entries.
    lines += ["[breaker]", f"enabled = {'true' if args.breaker else 'false'}",
              f"options = {{ max_ejection_fraction = {args.max_ejection_fraction} }}"]
    for route, suffix in ((MODEL, ""), (COLD, f"-{COLD}")):
        names = ", ".join(f'"{slot.name}{suffix}"' for slot in slots)
        lines += ["[[models]]", f'name = "{route}"', f'upstream_model = "{MODEL}"', f"backends = [{names}]"]
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


class CpuMeter:
    """Cores used over a phase by the router, the mocks, this client and the
    whole box (busy = not idle), so a saturated bed shows in the report."""

    def __init__(self, router: Server, slots: list[Slot]) -> None:
        self.router, self.slots = router, slots
        self.start = self._read()

    def _read(self) -> dict[str, float]:
        own = psutil.Process().cpu_times()
        box = psutil.cpu_times()
        return {"wall": time.monotonic(), "router": self.router.cpu_seconds(),
                "mocks": sum(s.cpu_seconds() for s in self.slots), "client": own.user + own.system,
                "box": sum(box) - box.idle - getattr(box, "iowait", 0.0)}

    def cores(self) -> dict[str, float]:
        end = self._read()
        wall = max(end["wall"] - self.start["wall"], 1e-9)
        out = {k: (end[k] - self.start[k]) / wall for k in ("router", "mocks", "client", "box")}
        out["box_cores"] = float(psutil.cpu_count() or 1)
        return out


async def _read_at(until: float, meter: CpuMeter, doc: dict[str, Any]) -> None:
    """The cores used under full load (the drain after ``until`` left out)."""
    await trio.sleep_until(until)
    doc["cpu_cores_used"] = meter.cores()


def _client(args: argparse.Namespace, url: str) -> Client:
    if args.http == "2":
        connections = -(-args.concurrency // args.streams_per_connection) + 2
        return make_pool(url, max_connections=connections, api_key=None, timeout=args.timeout)
    return make_client(url, "1.1", max_connections=args.concurrency + 8, api_key=None, timeout=args.timeout)


async def _chaos(args: argparse.Namespace, slots: list[Slot], log: list[dict[str, Any]],
                 until: float, t0: float, logdir: Path, start: float | None = None, phase: int = 0) -> None:
    """Kill a random backend every U(--interval) s from ``start`` (default
    ``t0``), restart it after --down s; no kill whose restart would come after
    ``until``. Times are logged from ``t0``."""
    rng = random.Random(f"chaos-kills:{args.seed}" + (f":{phase}" if phase else ""))
    at = (t0 if start is None else start) + rng.uniform(*args.interval)
    while args.max_kills is None or len(log) < args.max_kills:
        if at + args.down >= until:
            return
        await trio.sleep_until(at)
        slot = rng.choice(slots)
        killed = trio.current_time()
        await slot.kill()
        entry = {"at_s": killed - t0, "backend": slot.name}
        log.append(entry)
        await trio.sleep(args.down)
        await slot.start(logdir)
        entry["back_s"] = trio.current_time() - t0
        at = max(trio.current_time(), killed + rng.uniform(*args.interval))


def fleet_codes(listing: list[dict[str, Any]]) -> dict[str, str]:
    """One letter per backend entry of the route ``mock``, as the router sees
    it: ``U`` takes requests, ``E`` ejected by its breaker, ``H`` half-open,
    ``D`` not up (down, or not probed back up yet)."""
    out = {}
    for b in listing:
        if b["name"].endswith(f"-{COLD}"):
            continue
        breaker = (b.get("breaker") or {}).get("state", "closed")
        state = b.get("state")  # routers whose health machine holds the breaker's states
        if breaker == "open" or state == "ejected":
            out[b["name"]] = "E"
        elif breaker == "half_open" or state == "half_open":
            out[b["name"]] = "H"
        else:
            out[b["name"]] = "U" if b["up"] else "D"
    return dict(sorted(out.items()))


async def _monitor(load: Load, router: Server, admin: str, kills: list[dict[str, Any]],
                   timeline: list[dict[str, Any]], t0: float, duration: float) -> None:
    """Once a second: a progress line, and a timeline row (answers, in
    flight, the router's RSS and fds, and its view of the fleet)."""
    bar = ProgressBar("chaos", log_every=0.9)
    async with httpx.AsyncClient(base_url=admin, trust_env=False, timeout=2) as client:
        while True:
            now = trio.current_time()
            sample = process_sample(router.pid)
            try:
                fleet = fleet_codes((await client.get("/admin/backends")).json()["data"])
            except (httpx.HTTPError, ValueError, KeyError):
                fleet = {}
            done = len(load.outcomes)
            timeline.append({"t_s": now - t0, "done": done, "in_flight": load.in_flight, **sample,
                             "fleet": "".join(fleet.values())})
            pct = 100.0 * load.identical / done if done else 100.0
            bar.update(min(1.0, (now - t0) / duration),
                       f"{now - t0:5.1f}s streams {done} identical {pct:.2f}% bad {done - load.identical} "
                       f"kills {len(kills)} fleet {''.join(fleet.values()) or '?'} in-flight {load.in_flight} "
                       f"router RSS {sample['rss_mib']:.0f} MiB fds {sample['fds']:.0f}", time.monotonic())
            await trio.sleep(max(0.0, now + 1.0 - trio.current_time()))


async def idle_sample(router: Server, admin: str) -> dict[str, Any]:
    """:func:`process_sample`, where the memory is (``GET /admin/memory`` of
    the process that answers: the whole router with one worker): the C heap in
    use and free, in MiB, and Python's allocated blocks; and the router's Trio
    tasks (``headrace_router_tasks``, summed over workers). A leak grows the
    heap in use or the blocks; RSS that grows while they do not is memory
    freed but kept (the allocator's high-water mark), not live objects."""
    sample: dict[str, Any] = process_sample(router.pid)
    try:
        async with httpx.AsyncClient(base_url=admin, trust_env=False, timeout=5) as client:
            memory = (await client.get("/admin/memory")).json()
            metrics = (await client.get("/metrics")).text
    except (httpx.HTTPError, ValueError):
        return sample
    tasks = [s.value for f in text_string_to_metric_families(metrics) if f.name == N.ROUTER_TASKS.name for s in f.samples]
    if tasks:  # one series per worker with several
        sample["tasks"] = int(sum(tasks))
    for key in ("heap_in_use", "heap_free"):
        if isinstance(memory.get(f"{key}_bytes"), int):
            sample[f"{key}_mib"] = memory[f"{key}_bytes"] / 2**20
    if isinstance(memory.get("python_blocks"), int):
        sample["python_blocks"] = memory["python_blocks"]
    return sample


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


def _group(backend: str, prefix: str | None = None) -> str:
    """``cold`` for the entries of the fresh-prompt route, else ``held``; then
    ``/`` and the router's ``prefix`` label where the series has one (the
    resume gap's: held, missed or unknown by the continuation's usage)."""
    route = COLD if backend.endswith(f"-{COLD}") else "held"
    return route if prefix is None else f"{route}/{prefix}"


def parse_metrics(text: str) -> dict[str, Any]:
    """What the report needs from /metrics: migrations by reason and outcome,
    counters and in-flight gauges summed over backends, and histograms as
    {family: {group: [(le, cumulative)]}}, the backends summed per group."""
    hist: dict[str, dict[str, dict[float, float]]] = {}
    out: dict[str, Any] = {"migrations": {}, "gauges": {}, "counters": {}, "standby": {}}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if family.type == "histogram" and s.name.endswith("_bucket"):
                group = _group(s.labels.get("backend", ""), s.labels.get("prefix"))
                per = hist.setdefault(family.name, {}).setdefault(group, {})
                le = float(s.labels["le"])
                per[le] = per.get(le, 0.0) + s.value
            elif family.name == "headrace_migrations" and s.name.endswith("_total"):
                key = f"{s.labels['reason']}:{s.labels['outcome']}"
                out["migrations"][key] = out["migrations"].get(key, 0) + int(s.value)
            elif family.name == "headrace_migration_standby_syncs" and s.name.endswith("_total"):
                out["standby"][s.labels["outcome"]] = out["standby"].get(s.labels["outcome"], 0) + int(s.value)
            elif family.type == "gauge" and family.name.endswith(("in_flight", "_busy", "budget_active")):
                out["gauges"][family.name] = out["gauges"].get(family.name, 0.0) + s.value
            elif family.type == "counter" and s.name.endswith("_total"):
                out["counters"][family.name] = out["counters"].get(family.name, 0.0) + s.value
    out["histograms"] = {name: {g: sorted(b.items()) for g, b in groups.items()} for name, groups in hist.items()}
    return out


def metrics_delta(end: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """``end`` less ``base`` for the counters, migrations and histograms (the
    chaos phase alone); the gauges are ``end``'s."""
    def minus(a: dict[str, float], b: dict[str, float]) -> dict[str, Any]:
        return {k: v - b.get(k, 0) for k, v in a.items() if v - b.get(k, 0)}

    hist: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for name, groups in end["histograms"].items():
        for group, buckets in groups.items():
            before = dict(base["histograms"].get(name, {}).get(group, []))
            hist.setdefault(name, {})[group] = [(le, c - before.get(le, 0.0)) for le, c in buckets]
    return {"migrations": minus(end["migrations"], base["migrations"]), "gauges": end["gauges"],
            "counters": minus(end["counters"], base["counters"]), "histograms": hist,
            "standby": minus(end.get("standby", {}), base.get("standby", {}))}


def _merged(groups: dict[str, list[tuple[float, float]]]) -> list[tuple[float, float]]:
    total: dict[float, float] = {}
    for buckets in groups.values():
        for le, count in buckets:
            total[le] = total.get(le, 0.0) + count
    return sorted(total.items())


def hist_ms(buckets: list[tuple[float, float]]) -> dict[str, Any]:
    """n, p50 and p99 (ms) of one histogram's buckets."""
    p50, p99 = (histogram_quantile(buckets, q) for q in (0.5, 0.99))
    return {"n": int(buckets[-1][1]) if buckets else 0, "p50": p50 * 1000 if p50 is not None else None,
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


_ADMIN = re.compile(rb"headrace admin on (http://\S+)")


async def _metrics_url(router: Server, patience: float = 10.0) -> str:
    """Where the router serves /metrics: its own URL, or (routers with an
    admin listener) the ``headrace admin on URL`` its log names."""
    async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
        if (await client.get(f"{router.url}/metrics")).status_code == 200:
            return router.url
    with trio.move_on_after(patience):
        while True:
            found = _ADMIN.search(router.log.read_bytes())
            if found:
                return found.group(1).decode()
            await trio.sleep(0.1)
    raise BackendUnavailable(f"the router at {router.url} serves no /metrics and names no admin listener")


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
        result, timer = await fetch(pool, shape.body(MODEL, args.temperature), args.timeout)
    return result.error is None and "".join(timer.parts) == await load.reference(shape)


async def _phase(load: Load, args: argparse.Namespace, url: str, until: float, t0: float) -> None:
    async with _client(args, url) as client:
        await load.run(client, until, t0)


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
        heaps = logdir / "heap"
        if args.tracemalloc:
            heaps.mkdir()
            serve = traced_argv(args.tracemalloc, heaps, serve)
        started: list[Server] = []

        async def servers() -> None:  # the ports are fixed: the router need not wait for the mocks
            oracle_argv = [*_mock_argv(args, oracle=True), "--port", "0"]
            started.extend(await _start_all(stack, logdir, [("oracle", oracle_argv), ("router", serve)]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(servers)
            for slot in slots:
                nursery.start_soon(slot.start, logdir)
        oracle, router = started
        await _all_up(router.url, 2 * len(slots))
        metrics_url = await _metrics_url(router)
        doc["bed"] = {"router": router.url, "metrics": metrics_url, "backends": [s.url for s in slots], "oracle": oracle.url,
                      "router_config": config.read_text()}
        oracle_pool = await stack.enter_async_context(
            make_pool(oracle.url, max_connections=2, api_key=None, timeout=args.timeout))
        load = Load(args, workload, oracle_pool)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_references, load)
            for slot in slots:
                nursery.start_soon(_warm_cache, args, workload, slot)
        doc["bed"]["oracle_agrees"] = await _check_oracle(args, load, slots[0])

        print(f"headrace bench chaos: bed up, references and caches ready in {trio.current_time() - began:.1f} s "
              f"(logs: {logdir}); warm-up: {args.warmup:g} s of load without kills", file=sys.stderr)
        now = trio.current_time()
        await _phase(load, args, router.url, now + args.warmup, now)
        doc["warmup"] = {"streams": len(load.outcomes), "identical": load.identical}
        await trio.sleep(args.settle)
        doc["router"] = {"idle_before": await idle_sample(router, metrics_url), "idle_after_phase": []}
        snaps = [await heap_snapshot(heaps, "before")] if args.tracemalloc else []

        load.reset()
        base = await _scrape(metrics_url)
        scraped = [base]
        t0 = trio.current_time()
        doc["loadavg"] = {"start": os.getloadavg()}
        try:
            for phase in range(args.phases):
                start = trio.current_time()
                until = start + args.duration
                await _chaos_phase(args, load, router, metrics_url, slots, doc, phase, start, until, t0, logdir)
                if phase == 0:
                    doc["drained_s"] = trio.current_time() - until
                await trio.sleep(1.0)
                scraped.append(await _scrape(metrics_url))
                if phase == 0:
                    doc["metrics"] = metrics_delta(scraped[1], base)
                else:  # the later phases' gaps and TTFT, each phase alone (the report's figures are the first's)
                    doc.setdefault("later_phases", []).append(_gap_summary(metrics_delta(scraped[-1], scraped[-2])))
                await trio.sleep(max(0.5, args.settle - 1.0))
                idle = await idle_sample(router, metrics_url)
                doc["router"]["idle_after_phase"].append(idle)
                if phase == 0:
                    doc["router"]["idle_after"] = idle
                if args.tracemalloc:
                    snaps.append(await heap_snapshot(heaps, f"after{phase + 1}"))
                    doc.setdefault("heap", []).append(heap_diff(snaps[-2], snaps[-1]))
            doc["loadavg"]["end"] = os.getloadavg()
        finally:
            doc["streams"] = summarize_streams(load)
            doc["samples"] = _samples(load)


async def _chaos_phase(args: argparse.Namespace, load: Load, router: Server, metrics_url: str, slots: list[Slot],
                       doc: dict[str, Any], phase: int, start: float, until: float, t0: float, logdir: Path) -> None:
    """One chaos phase: load and kills from ``start`` to ``until``, then the
    drain (nothing cancelled); the cores used are read in the first."""
    meter = CpuMeter(router, slots)
    async with trio.open_nursery() as outer:
        outer.start_soon(_monitor, load, router, metrics_url, doc["kills"], doc["timeline"], t0, args.phases * args.duration)
        async with trio.open_nursery() as inner:
            inner.start_soon(_chaos, args, slots, doc["kills"], until, t0, logdir, start, phase)
            inner.start_soon(_phase, load, args, router.url, until, t0)
            if phase == 0:
                inner.start_soon(_read_at, until, meter, doc)
        outer.cancel_scope.cancel()


def summarize_streams(load: Load) -> dict[str, Any]:
    outcomes = load.outcomes
    verdicts = Counter(o.verdict for o in outcomes)
    total = len(outcomes)
    errors = Counter(o.error for o in outcomes if o.verdict == "error")

    def ms(values: list[float]) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.to_builtins(summarize(values, scale=1000.0))
        return out

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
        "ttft_cold_ms": ms([o.ttft for o in outcomes if o.key is None and o.ttft is not None]),
        "ttft_shared_ms": ms([o.ttft for o in outcomes if o.key is not None and o.ttft is not None]),
        "itl_ms": ms(list(load.itl)),
    }


def _samples(load: Load) -> dict[str, Any]:
    """When each answer ended and whether it was identical, for the plot."""
    return {"ended_s": [round(o.ended, 2) for o in load.outcomes],
            "identical": [o.verdict == "identical" for o in load.outcomes]}


# ---------------------------------------------------------------- the report

RESUME, TTFT = "headrace_resume_gap_seconds", "headrace_time_to_first_token_seconds"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _router_health(doc: dict[str, Any]) -> None:
    router = doc.setdefault("router", {})
    before, after = router.get("idle_before"), router.get("idle_after")
    if before and after:
        router["rss_growth_pct"] = 100.0 * (after["rss_mib"] - before["rss_mib"]) / before["rss_mib"]
        router["fds_growth"] = after["fds"] - before["fds"]
        # Each phase's growth over the one before it, in % of the idle RSS before any chaos.
        idle = [before, *router.get("idle_after_phase", [])]
        router["rss_growth_per_phase_pct"] = [100.0 * (b["rss_mib"] - a["rss_mib"]) / before["rss_mib"]
                                              for a, b in itertools.pairwise(idle)]
    loaded = [r for r in doc.get("timeline", []) if 1.0 <= r["t_s"] <= doc["config"]["duration"]]
    if len(loaded) >= 2:
        router["loaded_start"], router["loaded_end"] = loaded[0], loaded[-1]
        router["loaded_rss_growth_pct"] = 100.0 * (loaded[-1]["rss_mib"] - loaded[0]["rss_mib"]) / loaded[0]["rss_mib"]
    if before and after and "tasks" in before and "tasks" in after:
        router["tasks_growth"] = after["tasks"] - before["tasks"]
    if doc.get("metrics"):
        router["in_flight_after_drain"] = doc["metrics"]["gauges"]


def _series(metrics: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    """The resume gaps of the shared prompts whose new backend held the prompt
    (by the router's ``prefix`` label; a router without it: all of the shared
    route's), of the other shared ones, and of the fresh prompts; the TTFTs."""
    gaps, ttft = metrics["histograms"].get(RESUME, {}), metrics["histograms"].get(TTFT, {})
    shared = {k: v for k, v in gaps.items() if k.split("/")[0] == "held"}
    held = {k: v for k, v in shared.items() if k == "held/held" or "/" not in k}
    return {"resume_gap_held": _merged(held), "resume_gap_shared_missed": _merged({k: v for k, v in shared.items() if k not in held}),
            "resume_gap_not_held": _merged({k: v for k, v in gaps.items() if k.split("/")[0] == COLD}),
            "resume_gap_all": _merged(gaps), "ttft_cold": ttft.get(COLD, []), "ttft_shared": ttft.get("held", [])}


def _gap_summary(metrics: dict[str, Any]) -> dict[str, Any]:
    """A later phase: its migrations, and its resume gaps and TTFT (ms)."""
    return {"migrations": metrics["migrations"], "router_ms": {k: hist_ms(b) for k, b in _series(metrics).items()}}


def _migrations(doc: dict[str, Any]) -> None:
    metrics = doc["metrics"]
    m, counters = metrics["migrations"], metrics["counters"]
    doc["migrations"] = {
        "by_reason_outcome": m, "total": sum(m.values()),
        **{o: sum(v for k, v in m.items() if k.endswith(f":{o}")) for o in ("resumed", "replayed", "failed")},
        "divergences": counters.get("headrace_migration_replay_divergences", 0),
        "inexact": counters.get("headrace_migration_inexact", 0),
        "retries_refused": counters.get("headrace_dispatch_retries_refused", 0),
        "standby_syncs": metrics.get("standby", {}),
        "standby_tokens": counters.get("headrace_migration_standby_tokens", 0),
    }
    series = _series(metrics)
    doc["router_ms"] = {name: hist_ms(b) for name, b in series.items()}
    # For the plot: cumulative fractions at the finite bucket bounds.
    doc["cdf"] = {name: [(le, c / b[-1][1]) for le, c in b if not math.isinf(le)] for name, b in series.items()
                  if b and b[-1][1] > 0}
    del metrics["histograms"]


def conclude(doc: dict[str, Any]) -> None:
    """The numbers the issue asks for, from what the run recorded."""
    _router_health(doc)
    if doc.get("metrics"):
        _migrations(doc)
    r = doc.get("router_ms", {})
    cold = r.get("ttft_cold", {})
    ratios = {}
    for name in ("resume_gap_all", "resume_gap_held", "resume_gap_not_held"):
        for q in ("p50", "p99"):
            ratios[f"{name}_{q}_over_cold_ttft_{q}"] = _ratio(r.get(name, {}).get(q), cold.get(q))
    doc["ratios"] = ratios
    streams, router = doc.get("streams", {}), doc["router"]

    def under(key: str, limit: float) -> bool:
        value = ratios.get(key)
        return value is not None and value <= limit

    doc["targets"] = {
        "identical >= 99.9%": (streams.get("identical_pct") or 0) >= 99.9,
        "router RSS growth <= 10%": router.get("rss_growth_pct", math.inf) <= 10.0,
        # A pool may keep one more idle connection per backend entry than before; a leak
        # (a socket per broken stream) would be hundreds.
        "router fds not grown (<= 1 per backend entry)": router.get("fds_growth", math.inf) <= 2 * doc["config"]["backends"],
        # Its tasks likewise: a pool's connection has its reader task; a leak (a task per broken stream) is hundreds.
        **({"router tasks not grown (<= 1 per backend entry)": router["tasks_growth"] <= 2 * doc["config"]["backends"]}
           if "tasks_growth" in router else {}),
        **({"router RSS growth in each later phase <= 10% (a leak grows again, a warm-up does not)":
            all(g <= 10.0 for g in router["rss_growth_per_phase_pct"][1:])}
           if len(router.get("rss_growth_per_phase_pct", [])) > 1 else {}),
        "resume gap <= 1x cold TTFT (p50, p99)": under("resume_gap_all_p50_over_cold_ttft_p50", 1.0)
        and under("resume_gap_all_p99_over_cold_ttft_p99", 1.0),
        "resume gap, prefix held, <= 0.3x cold TTFT (p50, p99)": under("resume_gap_held_p50_over_cold_ttft_p50", 0.3)
        and under("resume_gap_held_p99_over_cold_ttft_p99", 0.3),
    }


def _chunks(tokens: int | None) -> str:
    return f"prefill in chunks of {tokens}" if tokens else "whole prefills"


def format_report(doc: dict[str, Any]) -> str:
    cpu, c, s = doc["cpu"], doc["config"], doc.get("streams", {})
    router, mig, r = doc.get("router", {}), doc.get("migrations", {}), doc.get("router_ms", {})
    before, after = router.get("idle_before", {}), router.get("idle_after", {})
    lines = [
        f"CPU: {cpu['model']} ({cpu['cores']} cores; {', '.join(cpu['features'])})",
        f"{c['backends']} mocks (TTFT {c['ttft_ms']:g} ms + {c['prefill_ms_per_token']:g} ms per uncached "
        f"prompt token, {_chunks(c.get('prefill_chunk_tokens'))}, TPOT {c['tpot_ms']:g} ms), {c['concurrency']} streams (h{c['http']}), "
        f"{c['duration']:g} s, prompts of {c['prompt_tokens']} tokens, {c['max_tokens'][0]}-{c['max_tokens'][1]} out",
        f"kills: {len(doc.get('kills', []))} (SIGKILL, back after {c['down']:g} s plus a restart, every "
        f"{c['interval'][0]:g}-{c['interval'][1]:g} s)",
        "",
        f"{'streams':<36} {s.get('total', 0):>8}  ({s.get('cold_prompts', 0)} with a fresh prompt)",
        f"{'  identical to the reference':<36} {s.get('identical', 0):>8}  ({dash(s.get('identical_pct'), '.3f')} %)",
        f"{'  truncated / different':<36} {s.get('truncated', 0):>8} / {s.get('different', 0)}",
        f"{'  errored':<36} {s.get('errored', 0):>8}  {s.get('errors') or ''}",
        f"{'migrations (router)':<36} {mig.get('total', '-'):>8}  {mig.get('by_reason_outcome', '')}",
        *([f"{'warm standby syncs (every ' + str(c['standby_tokens']) + ')':<36} "
           f"{sum(mig.get('standby_syncs', {}).values()):>8}  {mig.get('standby_syncs', {})}, "
           f"{mig.get('standby_tokens', 0):.0f} tokens sent less cached"] if c.get("standby_tokens") else []),
        "",
        f"{'':<36} {'p50 ms':>9} {'p99 ms':>9} {'n':>6}",
    ]
    rows = [("cold TTFT (router, fresh prompt)", r.get("ttft_cold", {})),
            ("TTFT (router, shared prompt)", r.get("ttft_shared", {})),
            ("resume gap (router), all", r.get("resume_gap_all", {})),
            ("  shared prompt, held*", r.get("resume_gap_held", {})),
            ("  shared prompt, not held*", r.get("resume_gap_shared_missed", {})),
            ("  fresh prompt (never held)", r.get("resume_gap_not_held", {})),
            ("cold TTFT (client, fresh prompt)", s.get("ttft_cold_ms", {})),
            ("TTFT (client, shared prompt)", s.get("ttft_shared_ms", {})),
            ("inter-token latency (client)", s.get("itl_ms", {}))]
    for label, d in rows:
        lines.append(f"{label:<36} {dash(d.get('p50')):>9} {dash(d.get('p99')):>9} {d.get('n', 0):>6}")
    for i, later in enumerate(doc.get("later_phases", []), start=2):
        g, t = later["router_ms"]["resume_gap_all"], later["router_ms"]["ttft_cold"]
        lines.append(f"phase {i} alone: resume gap p50/p99 {dash(g.get('p50'))}/{dash(g.get('p99'))} ms (n={g.get('n', 0)}), "
                     f"cold TTFT p50/p99 {dash(t.get('p50'))}/{dash(t.get('p99'))} ms (n={t.get('n', 0)})")
    bounds = ", ".join(f"{b * 1000:g}" for b in N.RESUME_GAP.buckets if 0.05 <= b <= 0.5)
    lines.append(f"router figures: p50/p99 interpolated inside the histogram's buckets (.., {bounds} ms, ..)")
    lines.append("* by the continuation's usage: its backend served >= 90% of the prompt from its cache (or not, or it "
                 "broke again); a router without the prefix label: held = the shared prompts' route")
    lines.append("")
    for name, value in doc.get("ratios", {}).items():
        lines.append(f"  {name}: {dash(value, '.2f')}")
    if before and after:
        lines += ["", f"router idle before / after: RSS {before['rss_mib']:.1f} / {after['rss_mib']:.1f} MiB "
                      f"({dash(router.get('rss_growth_pct'), '+.1f')} %), fds {before['fds']:.0f} / {after['fds']:.0f}"]
        if "heap_in_use_mib" in before and "heap_in_use_mib" in after:
            lines.append(f"router idle before / after: C heap in use {before['heap_in_use_mib']:.1f} / "
                         f"{after['heap_in_use_mib']:.1f} MiB, free {before['heap_free_mib']:.1f} / "
                         f"{after['heap_free_mib']:.1f} MiB, Python blocks {before['python_blocks']:,} / "
                         f"{after['python_blocks']:,}")
    if len(router.get("idle_after_phase", [])) > 1:
        lines.append("router idle after each phase: " + " / ".join(f"{x['rss_mib']:.1f}" for x in router["idle_after_phase"])
                     + " MiB; growth per phase: " + " / ".join(f"{g:+.1f}" for g in router["rss_growth_per_phase_pct"]) + " %")
    if "loaded_rss_growth_pct" in router:
        lines.append(f"router RSS under load, start / end: {router['loaded_start']['rss_mib']:.1f} / "
                     f"{router['loaded_end']['rss_mib']:.1f} MiB ({router['loaded_rss_growth_pct']:+.1f} %)")
    if "in_flight_after_drain" in router:
        lines.append(f"in-flight gauges after the drain: {router['in_flight_after_drain']}")
    if "tasks_growth" in router:
        lines.append(f"router tasks idle before / after: {before['tasks']} / {after['tasks']} ({router['tasks_growth']:+d})")
    if "loadavg" in doc:
        lines.append("load average (1, 5, 15 min) at the chaos start / end: "
                     + " / ".join(", ".join(f"{x:.2f}" for x in doc["loadavg"][k]) for k in ("start", "end") if k in doc["loadavg"]))
    for i, heap in enumerate(doc.get("heap", [])):
        lines.append(f"traced heap (after gc.collect), {'idle before' if i == 0 else f'after phase {i}'} -> after phase {i + 1}: "
                     f"{heap['before_mib']:.1f} -> {heap['after_mib']:.1f} MiB ({heap['growth_kib']:+.0f} KiB); top sites:")
        lines += [f"    {s['growth_kib']:+9.1f} KiB {s['count_growth']:+7d} blocks  {s['site']}" for s in heap["top_sites"][:10]]
    used = doc.get("cpu_cores_used")
    if used:
        lines.append(f"cores used under load: router {used['router']:.2f}, mocks {used['mocks']:.2f}, "
                     f"client {used['client']:.2f}; box busy {used['box']:.2f} of {used['box_cores']:.0f}")
    lines += ["", "targets: " + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in doc.get("targets", {}).items())]
    if doc.get("interrupted"):
        lines.append(f"interrupted: {doc['interrupted']}")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> Path:
    """Left: answers per second (identical / not), the kills and the router's
    RSS; right: the router's TTFT and resume-gap distributions (bucket CDFs)."""
    from bench.plot import _figure, _save

    c = doc["config"]
    fig, (left, right) = _figure(2, f"bench chaos: {c['backends']} backends, {c['concurrency']} streams, "
                                    f"{len(doc.get('kills', []))} kills")
    samples = doc.get("samples", {})
    ended, same = samples.get("ended_s", []), samples.get("identical", [])
    seconds = int(max(ended, default=0)) + 1
    good, bad = [0] * seconds, [0] * seconds
    for t, ok in zip(ended, same, strict=True):
        (good if ok else bad)[int(t)] += 1
    left.plot(range(seconds), good, color="C0", label="identical answers / s")
    worse = [(t, n) for t, n in enumerate(bad) if n]
    if worse:
        left.plot(*zip(*worse, strict=True), "x", color="C3", label="not identical / s")
    for i, k in enumerate(doc.get("kills", [])):
        left.axvspan(k["at_s"], k.get("back_s", k["at_s"]), color="C3", alpha=0.2,
                     label="a backend down" if i == 0 else None)
    left.set_xlabel("seconds")
    left.set_ylabel("answers per second")
    left.set_ylim(bottom=0)
    rows = doc.get("timeline", [])
    rss = left.twinx()
    rss.plot([r["t_s"] for r in rows], [r["rss_mib"] for r in rows], "--", color="C2", label="router RSS")
    rss.set_ylim(0, 1.25 * max((r["rss_mib"] for r in rows), default=1.0))
    rss.set_ylabel("router RSS (MiB)")
    left.legend(fontsize="small", loc="lower left")
    left.grid(True, alpha=0.3)
    labels = {"ttft_cold": "TTFT, fresh prompt", "ttft_shared": "TTFT, shared prompt",
              "resume_gap_held": "resume gap, prefix held", "resume_gap_shared_missed": "resume gap, shared prompt not held",
              "resume_gap_not_held": "resume gap, fresh prompt"}
    for name, label in labels.items():
        points = doc.get("cdf", {}).get(name)
        if points:
            n = doc["router_ms"][name]["n"]
            right.plot([1000 * le for le, _ in points], [f for _, f in points], "-o", label=f"{label} (n={n})")
    right.set_xscale("log")
    right.set_xlabel("ms (router histogram bucket bounds)")
    right.set_ylabel("fraction at or below")
    right.grid(True, alpha=0.3)
    if right.get_lines():
        right.legend(fontsize="small")
    return _save(fig, path)


def _check(args: argparse.Namespace) -> None:
    from backends.errors import ClientError

    if args.backends < 2 or args.concurrency < 1 or args.duration <= 0 or args.warmup < 0 or args.phases < 1:
        raise ClientError("--backends >= 2, --concurrency >= 1, --duration > 0, --warmup >= 0, --phases >= 1")
    if args.tracemalloc < 0 or args.settle < 0:
        raise ClientError("--tracemalloc FRAMES >= 0, --settle >= 0")
    if not 0 < args.interval[0] <= args.interval[1] or args.down < 0:
        raise ClientError("--interval MIN MAX with 0 < MIN <= MAX, --down >= 0")
    if not 1 <= args.max_tokens[0] <= args.max_tokens[1]:
        raise ClientError("--max-tokens MIN MAX with 1 <= MIN <= MAX")


def main(argv: list[str]) -> int:
    from bench.cli import run_reported

    args = _parser().parse_args(argv)
    if args.report:
        print(format_report(json.loads(Path(args.report).read_text())))
        return 0
    _check(args)
    cpu = cpu_info()
    doc: dict[str, Any] = {"kind": "chaos", "cpu": {k: v for k, v in cpu.items() if k != "flags"},
                           "config": {k: v for k, v in vars(args).items() if k not in ("out", "plot_path", "no_plot", "report")},
                           "kills": [], "timeline": []}
    return run_reported(run, args, doc, _finish)


def _finish(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    conclude(doc)
    print(format_report(doc))
    path = write_json(args.out, doc)
    print(f"wrote {path}", file=sys.stderr)
    if not args.no_plot:
        print(f"wrote {plot(doc, Path(args.plot_path or path.with_suffix('.png')))}", file=sys.stderr)

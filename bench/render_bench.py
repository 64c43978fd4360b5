"""``python -m bench.render_bench``: what a /metrics scrape costs the router's event loop.

An in-process router over 4 mock backends takes ``--requests`` requests
from 6 tenants at 3 priorities (streamed and not), which fills its label
sets as traffic does; then a task ticks every millisecond while /metrics is
rendered ``--scrapes`` times, synchronously (``generate_latest``, as before)
and cooperatively (frontend/exposition.py). The ticker's gaps are how long
every other request on the router waited. Prints a table, writes JSON
(default under bench/results/issue12/) and names the CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from backends.mock import MockBackend, MockConfig
from bench.procs import cpu_info
from bench.report import write_json
from bench.stats import percentile
from router.app import NamedBackend, Router
from router.config import decode_config
from router.server import options_for, run_router

TENANTS = ("chat", "app", "bulk", "quiet", "flood", "probe")


def _router() -> Router:
    keys = [{"sha256": hashlib.sha256(f"k-{t}".encode()).hexdigest(), "tenant": t} for t in TENANTS]
    config = decode_config({
        "auth": {"api_keys": keys}, "tenants": {t: {"max_priority": "interactive"} for t in TENANTS},
        "backends": [{"kind": "mock", "name": f"m{i}"} for i in range(4)], "health": {"interval": 5},
        "server": {"port": 0},
    })  # fmt: skip
    mocks = [NamedBackend(f"m{i}", MockBackend(MockConfig(name=f"m{i}", models=("m",), tpot_s=0, ttft_s=0))) for i in range(4)]
    return Router(config, mocks)


async def _traffic(url: str, n: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        for i in range(n):
            headers = {"authorization": f"Bearer k-{TENANTS[i % 6]}", "x-priority": ("interactive", "default", "batch")[i % 3]}
            r = await client.post("/v1/completions", headers=headers,
                                  json={"model": "m", "prompt": "hi", "max_tokens": 3, "stream": i % 2 == 0})  # fmt: skip
            r.raise_for_status()


async def _gaps(router: Router, mode: str, scrapes: int) -> dict[str, Any]:
    gaps: list[float] = []
    renders: list[float] = []

    async def ticker() -> None:
        last = time.perf_counter()
        while True:
            await trio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.sleep(0.05)
        for _ in range(scrapes):
            began = time.perf_counter()
            if mode == "sync":
                router.metrics.render()
            else:
                await router.metrics.render_async()
            renders.append(time.perf_counter() - began)
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    ms = [g * 1000 for g in gaps]
    return {"render_ms_median": round(statistics.median(renders) * 1000, 2), "gap_ms_p50": round(percentile(ms, 50) or 0, 2),
            "gap_ms_p99": round(percentile(ms, 99) or 0, 2), "gap_ms_max": round(max(ms), 2), "ticks": len(ms)}  # fmt: skip


async def run(args: argparse.Namespace) -> dict[str, Any]:
    router = _router()
    doc: dict[str, Any] = {"kind": "metrics_render", "cpu": {k: v for k, v in cpu_info().items() if k != "flags"},
                           "requests": args.requests, "scrapes": args.scrapes, "modes": {}}  # fmt: skip
    async with trio.open_nursery() as nursery:
        options = options_for(router.config)
        url = await nursery.start(lambda task_status: run_router(router, options, shutdown=trio.Event(), task_status=task_status))
        print(f"filling labels with {args.requests} requests", file=sys.stderr)
        await _traffic(url, args.requests)
        body = router.metrics.render()
        doc["exposition"] = {"bytes": len(body), "samples": sum(1 for line in body.splitlines() if not line.startswith(b"#"))}
        for mode in ("sync", "cooperative"):
            print(f"{args.scrapes} scrapes, {mode}", file=sys.stderr)
            doc["modes"][mode] = await _gaps(router, mode, args.scrapes)
        nursery.cancel_scope.cancel()
    return doc


def render(doc: dict[str, Any]) -> str:
    e = doc["exposition"]
    out = [f"/metrics: {e['samples']} samples, {e['bytes']} bytes; CPU {doc['cpu']['model']} x {doc['cpu']['cores']}", "",
           f"{'mode':<13}{'render ms':>10}{'gap p50':>9}{'gap p99':>9}{'gap max':>9}  (ms the loop waited, ticking every 1 ms)"]  # fmt: skip
    for mode, m in doc["modes"].items():
        out.append(f"{mode:<13}{m['render_ms_median']:>10.1f}{m['gap_ms_p50']:>9.2f}{m['gap_ms_p99']:>9.2f}{m['gap_ms_max']:>9.2f}")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.render_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--scrapes", type=int, default=20)
    p.add_argument("--json", dest="json_path")
    args = p.parse_args(argv)
    doc = trio.run(run, args)
    print(render(doc))
    path = Path(args.json_path or f"bench/results/issue12/metrics-render-{time.strftime('%Y%m%d-%H%M%S')}.json")
    print(f"wrote {write_json(path, doc)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

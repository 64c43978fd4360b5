"""Batch inference beside interactive traffic (issue 16), through the real
router in its own process: ``python -m bench.batch_bench``.

The bed, each part its own process: ``--mocks`` slotted mocks
(bench/overload_bench.py: ``--slots`` streams at once each, the rest wait
in order, as an engine queues past its batch) and ``headrace serve`` over
them with admission on and a data directory.

1. **Alone**: interactive streamed completions, Poisson at ``--rps``, for
   ``--duration`` s; their TTFT and end-to-end p50/p99.
2. **Beside a batch**: a ``--lines``-line batch (the OpenAI Batch API:
   upload, create) is started and left to soak up the spare slots at the
   batch class; once its items run, the same interactive schedule again.
   Target: interactive p99 (TTFT and end to end) within 1.2x of alone.
3. **Memory**: the batch is left to finish; the router's RSS is sampled
   every 0.5 s from its start to the batch's end (flat: the input, items and
   output live on disk and in SQLite, read a page at a time).

Prints a table and writes JSON (default bench/results/issue16/batch.json), with the CPU's name.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import psutil
import trio

from bench.overload_bench import (
    Outcome,
    _key,
    _stop,
    router_config,
    run_phase,
    schedule,
    start_mocks,
)
from bench.procs import Server, cpu_info, start_server
from bench.report import write_json
from bench.stats import percentile

__all__ = ["main"]

RESULTS = "bench/results/issue16"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.batch_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--mocks", type=int, default=2)
    p.add_argument("--slots", type=int, default=8, help="streams at once per mock (its max_concurrency)")
    p.add_argument("--ttft-ms", type=float, default=50.0)
    p.add_argument("--tpot-ms", type=float, default=10.0)
    p.add_argument("--max-tokens", type=int, default=20, help="tokens per interactive answer")
    p.add_argument("--batch-tokens", type=int, default=4, help="tokens per batch item's answer")
    p.add_argument("--prompt-words", type=int, default=20)
    p.add_argument("--rps", type=float, default=4.0, help="interactive arrivals per second")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of interactive arrivals per phase")
    p.add_argument("--lines", type=int, default=10_000, help="requests in the batch")
    p.add_argument("--reserve-slots", type=int, default=4, help="[admission] reserve_slots")
    p.add_argument("--jobs-concurrency", type=int, default=8, help="[jobs] concurrency and per_tenant")
    p.add_argument("--finish-timeout", type=float, default=600.0, help="seconds to wait for the batch to finish")
    p.add_argument("--mock-nice", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path")
    return p


def config_text(mocks: list[Server], args: argparse.Namespace, data_dir: Path) -> str:
    args.deadlines = [30.0, 60.0, 600.0]  # what router_config and run_phase read: nobody gives up here
    text = router_config(mocks, args, admission=True, reserve=args.reserve_slots)
    return text + "\n".join(["[jobs]", f'data_dir = "{data_dir}"', f"concurrency = {args.jobs_concurrency}",
                             f"per_tenant = {args.jobs_concurrency}", "poll_interval = 0.2"]) + "\n"  # fmt: skip


def batch_file(args: argparse.Namespace) -> bytes:
    lines = []
    for i in range(args.lines):
        body = {"model": "m", "prompt": f"document {i % 50}: summarise " + "words " * args.prompt_words,
                "max_tokens": args.batch_tokens}  # fmt: skip
        lines.append(json.dumps({"custom_id": f"item-{i}", "method": "POST", "url": "/v1/completions", "body": body}))
    return ("\n".join(lines) + "\n").encode()


def latency(outcomes: list[Outcome]) -> dict[str, Any]:
    ok = [o for o in outcomes if o.status == 200 and o.e2e is not None]
    ttft = [o.ttft for o in ok if o.ttft is not None]
    e2e = [o.e2e for o in ok if o.e2e is not None]

    def ms(xs: list[float], q: float) -> float | None:
        return round(percentile(xs, q) * 1000, 1) if xs else None

    return {"sent": len(outcomes), "ok": len(ok), "ttft_ms": {"p50": ms(ttft, 50), "p99": ms(ttft, 99)},
            "e2e_ms": {"p50": ms(e2e, 50), "p99": ms(e2e, 99)},
            "errors": sorted(o.code or o.error or f"http_{o.status}" for o in outcomes if o not in ok)}  # fmt: skip


async def sample_rss(pid: int, out: list[tuple[float, float]], start: float) -> None:
    proc = psutil.Process(pid)
    while True:
        out.append((round(time.monotonic() - start, 1), proc.memory_info().rss / 2**20))
        await trio.sleep(0.5)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    doc: dict[str, Any] = {"kind": "batch", "cpu": {k: v for k, v in cpu_info().items() if k != "flags"},
                           "bed": {k: v for k, v in vars(args).items() if k != "json_path"}}  # fmt: skip
    rng_plan = [(t, "chat", "interactive") for t in schedule(args.rps, args.duration, __import__("random").Random(args.seed))]
    with tempfile.TemporaryDirectory(prefix="headrace-batch-") as tmp:
        logdir = Path(tmp)
        async with AsyncExitStack() as stack:
            mocks = await start_mocks(stack, args, logdir)
            config = logdir / "router.toml"
            config.write_text(config_text(mocks, args, logdir / "data"))
            router = await start_server("router", [sys.executable, "-m", "router.cli", "serve", "--config", str(config),
                                                   "--port", "0", "--workers", "1", "--log-level", "WARNING"], logdir)  # fmt: skip
            stack.push_async_callback(_stop, router)
            began = time.monotonic()
            rss: list[tuple[float, float]] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sample_rss, router.pid, rss, began)
                await trio.sleep(1.0)
                print(f"alone: {len(rng_plan)} interactive requests over {args.duration:g} s", file=sys.stderr)
                doc["alone"] = latency(await run_phase(router.url, rng_plan, args))
                headers = {"authorization": f"Bearer {_key('bulk')}"}
                async with httpx.AsyncClient(base_url=router.url, headers=headers, timeout=60) as client:
                    up = await client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", batch_file(args))})
                    up.raise_for_status()
                    created = await client.post("/v1/batches", json={"input_file_id": up.json()["id"],
                                                                     "endpoint": "/v1/completions", "completion_window": "24h"})  # fmt: skip
                    created.raise_for_status()
                    batch_id = created.json()["id"]
                    while (b := (await client.get(f"/v1/batches/{batch_id}")).json())["request_counts"]["completed"] < 50:  # noqa: ASYNC110 (polls the router)
                        await trio.sleep(0.2)
                    before = b["request_counts"]["completed"]
                    print(f"beside a {args.lines}-line batch ({before} items done)", file=sys.stderr)
                    doc["beside_batch"] = latency(await run_phase(router.url, rng_plan, args))
                    b = (await client.get(f"/v1/batches/{batch_id}")).json()
                    doc["beside_batch"]["batch_items_done_meanwhile"] = b["request_counts"]["completed"] - before
                    with trio.move_on_after(args.finish_timeout):
                        while b["status"] not in ("completed", "failed", "expired", "cancelled"):
                            await trio.sleep(1.0)
                            b = (await client.get(f"/v1/batches/{batch_id}")).json()
                    doc["batch"] = {"status": b["status"], "request_counts": b["request_counts"],
                                    "seconds": round(time.monotonic() - began, 1)}  # fmt: skip
                    if b["status"] == "completed":
                        size = 0
                        async with client.stream("GET", f"/v1/files/{b['output_file_id']}/content") as r:
                            async for chunk in r.aiter_bytes():
                                size += len(chunk)
                        doc["batch"]["output_bytes"] = size
                nursery.cancel_scope.cancel()
    mib = [m for _, m in rss]
    doc["router_rss_mib"] = {"start": round(mib[0], 1), "peak": round(max(mib), 1), "end": round(mib[-1], 1),
                             "samples": [(t, round(m, 1)) for t, m in rss]}  # fmt: skip
    ratio = {k: _ratio(doc["beside_batch"][k]["p99"], doc["alone"][k]["p99"]) for k in ("ttft_ms", "e2e_ms")}
    doc["p99_ratio"] = ratio
    doc["target_met"] = all(r is not None and r <= 1.2 for r in ratio.values())
    return doc


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def render(doc: dict[str, Any]) -> str:
    lines = [f"CPU: {doc['cpu'].get('model', '?')} ({doc['cpu'].get('cores', '?')} cores)",
             f"{'phase':<14}{'sent':>6}{'ok':>6}{'TTFT p50':>10}{'TTFT p99':>10}{'e2e p50':>10}{'e2e p99':>10}"]  # fmt: skip
    for name in ("alone", "beside_batch"):
        r = doc[name]
        lines.append(f"{name:<14}{r['sent']:>6}{r['ok']:>6}{r['ttft_ms']['p50']!s:>10}{r['ttft_ms']['p99']!s:>10}"
                     f"{r['e2e_ms']['p50']!s:>10}{r['e2e_ms']['p99']!s:>10}")  # fmt: skip
    lines.append(f"p99 beside / alone: TTFT {doc['p99_ratio']['ttft_ms']}x, e2e {doc['p99_ratio']['e2e_ms']}x "
                 f"(target <= 1.2x: {'met' if doc['target_met'] else 'MISSED'})")  # fmt: skip
    lines.append(f"batch items done during the interactive phase: {doc['beside_batch']['batch_items_done_meanwhile']}")
    lines.append(f"batch: {doc['batch']}")
    m = doc["router_rss_mib"]
    lines.append(f"router RSS MiB: start {m['start']}, peak {m['peak']}, end {m['end']}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    doc = trio.run(run, args)
    path = Path(args.json_path or f"{RESULTS}/batch.json")
    write_json(path, doc)
    print(render(doc))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

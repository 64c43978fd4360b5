"""Cold start against warm take-over of an engine replica (issue 18).

``python -m bench.replica_bench [--model PATH] [--runs 3] [--out FILE]``

- **cold start**: ``headrace engine --port 0`` as a new process, from spawn
  to its ``engine serving`` line (``serving_s``), and to the end of its first
  request (``first_request_s``, one token); its own reported load time too.
- **warm take-over**: ``headrace serve --workers 1`` with ``[[engines]]
  replicas = 1, warm = 1`` (router/engines.py); once both engines are up,
  ``POST /admin/engines replicas = 2`` and requests one after another until
  one has been served by the warm replica: from the POST to the end of that
  request (``takeover_s``). Then back to 1 (the replica returns to the pool)
  for the next run. ``request_s``: one such request to a serving replica, the
  floor under ``takeover_s``.

Prints a table and writes JSON (bench/results/issue18/replicas.json by
default) with the CPU's name.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.procs import admin_url, cpu_info, start_server

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}


async def cold_start(model: list[str], threads: int, logdir: Path, i: int) -> dict[str, float]:
    began = time.perf_counter()
    server = await start_server(f"engine-{i}", [sys.executable, "-m", "router.cli", "engine", "--port", "0",
                                                "--threads", str(threads), *model], logdir, patience=300)  # fmt: skip
    serving = time.perf_counter() - began
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            r = await client.post("/v1/chat/completions", json=BODY)
            r.raise_for_status()
            first = time.perf_counter() - began
            footprint = (await client.get("/v1/models")).json()["data"][0]["footprint"]
    finally:
        await server.stop()
    return {"serving_s": serving, "first_request_s": first, "load_s": footprint["load_seconds"],
            "rss_mib": footprint["rss_bytes"] / 2**20, "weights_mib": footprint["weights_bytes"] / 2**20,
            "kv_cache_mib": footprint["kv_cache_bytes"] / 2**20}  # fmt: skip


async def poll(check: Any, limit: float) -> None:
    with trio.fail_after(limit):
        while True:
            if await check():
                return
            await trio.sleep(0.1)


async def requests_of(admin: httpx.AsyncClient, name: str) -> int:
    return next(int(b["requests"]) for b in (await admin.get("/admin/backends")).json()["data"] if b["name"] == name)


async def warm_takeover(model: list[str], threads: int, logdir: Path, runs: int) -> list[dict[str, float]]:
    spec = f'model = "{model[1]}"\n' if model else ""
    config = logdir / "engines.toml"
    config.write_text(f'[[engines]]\n{spec}name = "e"\nreplicas = 1\nwarm = 1\nmax_replicas = 2\n'
                      f'args = ["--threads", "{threads}"]\n[health]\ninterval = 0.5\n')  # fmt: skip
    router = await start_server("router", [sys.executable, "-m", "router.cli", "serve", "--workers", "1", "--port", "0",
                                           "--config", str(config)], logdir, patience=600)  # fmt: skip
    results = []
    try:
        admin_base = await admin_url(router)
        # The router's own line: the engines' "engine serving ... on URL" lines, echoed, come first.
        router.url = re.findall(r"headrace listening on (\S+)\n", router.log.read_text())[0]
        async with httpx.AsyncClient(base_url=router.url, timeout=60) as client, httpx.AsyncClient(base_url=admin_base, timeout=60) as admin:
            async def all_up() -> bool:
                return all(b["state"] == "up" for b in (await admin.get("/admin/backends")).json()["data"])

            async def pool_full() -> bool:
                return bool((await admin.get("/admin/engines")).json()["data"][0]["warm"] == 1)

            await poll(all_up, 120)
            for _ in range(runs):
                t = time.perf_counter()
                (await client.post("/v1/chat/completions", json=BODY)).raise_for_status()
                request = time.perf_counter() - t
                warm = next(m["name"] for m in (await admin.get("/admin/engines")).json()["data"][0]["members"] if m["state"] == "warm")
                before = await requests_of(admin, warm)
                began = time.perf_counter()
                r = await admin.post("/admin/engines", json={"model": "e", "replicas": 2})
                assert r.status_code == 200 and r.json()["taken_warm"] == [warm], r.text
                sent = 0
                while True:
                    (await client.post("/v1/chat/completions", json=BODY)).raise_for_status()
                    sent += 1
                    if await requests_of(admin, warm) > before:
                        break
                takeover = time.perf_counter() - began
                results.append({"takeover_s": takeover, "request_s": request, "requests_sent": sent, "replica": warm})
                r = await admin.post("/admin/engines", json={"model": "e", "replicas": 1})  # back into the pool
                assert r.status_code == 200, r.text
                await poll(pool_full, 60)
    finally:
        await router.stop()
    return results


def _median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model = ["--model", args.model] if args.model else []
    with tempfile.TemporaryDirectory(prefix="replica-bench-") as tmp:
        logdir = Path(tmp)
        cold = [await cold_start(model, args.threads, logdir, i) for i in range(args.runs)]
        warm = await warm_takeover(model, args.threads, logdir, args.runs)
    cpu = cpu_info()
    return {"cpu": cpu["model"], "cores": cpu["cores"], "model": args.model or "default (SmolLM2-135M-Instruct Q4_1)",
            "threads": args.threads, "runs": args.runs, "cold": cold, "warm": warm,
            "summary": {"cold_serving_s": _median(cold, "serving_s"), "cold_first_request_s": _median(cold, "first_request_s"),
                        "load_s": _median(cold, "load_s"), "warm_takeover_s": _median(warm, "takeover_s"),
                        "request_s": _median(warm, "request_s"), "rss_mib": _median(cold, "rss_mib")}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replica_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="GGUF file or Hugging Face folder (default: the installed SmolLM2)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--out", default="bench/results/issue18/replicas.json")
    args = p.parse_args(argv)
    report = trio.run(main_async, args)
    s = report["summary"]
    print(f"CPU: {report['cpu']} ({report['cores']} cores), model: {report['model']}, {args.threads} thread(s) per engine, "
          f"median of {args.runs}")  # fmt: skip
    print(f"{'':34} {'seconds':>9}")
    rows = [("cold: process start to serving", s["cold_serving_s"]), ("cold: ... to first request served", s["cold_first_request_s"]),
            ("cold: engine's own load time", s["load_s"]), ("warm take-over (POST to first served)", s["warm_takeover_s"]),
            ("one request (floor under take-over)", s["request_s"])]  # fmt: skip
    for name, value in rows:
        print(f"{name:<38} {value:>9.3f}")
    print(f"engine RSS {s['rss_mib']:.0f} MiB")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

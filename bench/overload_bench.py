"""``headrace bench overload`` (issue 15): admission control at twice the
fleet's capacity, through the real router in its own process.

The bed, each part its own process::

    N x slotted mock   (``python -m bench.overload_bench mock``: the mock backend behind a
                        FIFO of S slots, as an engine queues what exceeds its batch)
    headrace serve --config   [[backends]] max_concurrency = S, admission on or off

Phase 1, mixed overload: Poisson arrivals at ``--load`` x the fleet's
capacity (N x S / the service time of one request), each request of a class
(``--mix``: interactive, default, batch) sent by that class's tenant with
``X-Priority`` and ``X-Deadline-Ms`` (``--deadlines``). A client gives up at
its deadline (the router cancels the backend stream). The same schedule runs
with admission on and off. Per class: goodput (answers complete within their
deadline / requests sent), p50/p99 TTFT of those answered, refusals by code;
and the refusals' latency (p50/p99, to their last byte, at the client).

Phase 2, fairness: a quiet tenant alone at ``--quiet-rps`` (its solo TTFT),
then the same beside a flooding tenant at 20x its rate (more than the fleet
serves), admission on. The quiet tenant's p99 TTFT must stay within 1.2x its
solo p99.

Targets (checked and printed): interactive goodput >= 95% while overloaded;
total goodput higher with admission than without; refusal p99 < 10 ms; the
quiet tenant's p99 TTFT <= 1.2x solo. Prints a table, writes JSON and a PNG
(default under bench/results/issue15/), and names the CPU.

CPUs: every process may run on every CPU. The mocks and the load
generator stand in for other machines, and on a small box they share the
router's CPUs: the probe notes, per refusal, how long it and the router's
main thread waited for a CPU (``/proc/<pid>/schedstat``; on two cores
2-3 ms at p90 and 4-10 ms at p99 of a refusal's time), and the plot shows
the refusals' CDF with and without those waits. ``--pin-router`` (a box
of two or more CPUs) runs the router and the probe on the first CPU and
the rest on the others; the JSON's ``bed.cpus`` names the layout.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import msgspec
import psutil
import trio

from backends.base import BackendInfo, GenerateRequest, Health
from backends.h2client import H2Pool
from backends.mock import MockBackend, MockConfig
from bench.client import RequestResult, StreamTimer
from bench.procs import Server, admin_url, cpu_info, cpu_seconds, start_server
from bench.report import dash, write_json
from bench.stats import percentile

__all__ = ["Slotted", "main"]

CLASSES = ("interactive", "default", "batch")
RESULTS = "bench/results/issue15"


class Slotted:
    """A backend that runs ``slots`` streams at once; the others wait their turn, in order."""

    def __init__(self, inner: MockBackend, slots: int) -> None:
        self.inner, self.slots = inner, trio.Semaphore(slots)

    async def stream(self, request: GenerateRequest) -> Any:
        async with self.slots:
            gen = self.inner.stream(request)
            try:
                async for event in gen:
                    yield event
            finally:
                with trio.CancelScope(shield=True):
                    await gen.aclose()

    def info(self) -> BackendInfo:
        return self.inner.info()

    async def health(self) -> Health:
        return await self.inner.health()

    async def aclose(self) -> None:
        await self.inner.aclose()


def _serve_mock(argv: list[str]) -> int:
    from frontend.server import OpenAIServer
    from frontend.serving import ServeOptions, serve

    p = argparse.ArgumentParser(prog="python -m bench.overload_bench mock")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--ttft-ms", type=float, default=100)
    p.add_argument("--tpot-ms", type=float, default=20)
    p.add_argument("--max-tokens", type=int, default=40)
    args = p.parse_args(argv)
    config = MockConfig(ttft_s=args.ttft_ms / 1000, tpot_s=args.tpot_ms / 1000, max_tokens=args.max_tokens, models=("m",))
    app = OpenAIServer(Slotted(MockBackend(config), args.slots), coalesce=True)  # type: ignore[arg-type]

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve, app, ServeOptions("127.0.0.1", args.port))
            print(f"slotted mock listening on {url}", flush=True)

    trio.run(run)
    return 0


# ---------------------------------------------------------------- the bed


def _key(tenant: str) -> str:
    return f"sk-bench-{tenant}"


def router_config(mocks: list[Server], args: argparse.Namespace, *, admission: bool, reserve: int) -> str:
    deadlines = dict(zip(CLASSES, args.deadlines, strict=True))
    tenants = {"chat": "interactive", "app": "default", "bulk": "batch", "quiet": "default", "flood": "default",
               "probe": "batch"}
    lines = ["[health]", "interval = 5", "[admission]", f"enabled = {str(admission).lower()}",
             f"reserve_slots = {reserve}",
             "queue_timeout = { " + ", ".join(f"{c} = {deadlines[c]:g}" for c in CLASSES) + " }"]
    for tenant, cls in tenants.items():
        lines += [f"[tenants.{tenant}]", f'max_priority = "{cls}"']
    for tenant in tenants:
        lines += ["[[auth.api_keys]]", f'sha256 = "{hashlib.sha256(_key(tenant).encode()).hexdigest()}"', f'tenant = "{tenant}"']
    for i, mock in enumerate(mocks):
        lines += ["[[backends]]", f'name = "m{i}"', f'url = "{mock.url}"', f"max_concurrency = {args.slots}"]
    return "\n".join(lines) + "\n"


async def start_mocks(stack: AsyncExitStack, args: argparse.Namespace, logdir: Path) -> list[Server]:
    argv = ["nice", "-n", str(args.mock_nice), sys.executable, "-m", "bench.overload_bench", "mock",
            "--slots", str(args.slots), "--ttft-ms", f"{args.ttft_ms:g}", "--tpot-ms", f"{args.tpot_ms:g}",
            "--max-tokens", str(args.max_tokens)]  # fmt: skip
    mocks = [await start_server(f"mock{i}", argv, logdir) for i in range(args.mocks)]
    for mock in mocks:
        stack.push_async_callback(_stop, mock)
    return mocks


async def _metrics_url(router: Server) -> str:
    """Where the router serves /metrics: its admin listener when it names one, else its own URL."""
    try:
        return await admin_url(router, patience=2.0)
    except Exception:
        return router.url


async def _stop(server: Server) -> None:
    with trio.CancelScope(shield=True):
        await server.stop()


async def start_router(args: argparse.Namespace, mocks: list[Server], logdir: Path, *, admission: bool, reserve: int,
                       cpus: list[int] | None = None) -> Server:  # fmt: skip
    """The router in its own process, ready; on ``cpus`` when given."""
    config = logdir / f"router-{'on' if admission else 'off'}-{reserve}.toml"
    config.write_text(router_config(mocks, args, admission=admission, reserve=reserve))
    argv = [sys.executable, "-m", "router.cli", "serve", "--config", str(config), "--port", "0",
            "--workers", "1", "--log-level", "WARNING"]  # fmt: skip
    router = await start_server(f"router-{'on' if admission else 'off'}", argv, logdir)
    if cpus:
        pin(router.pid, cpus)
    async with H2Pool("127.0.0.1", int(router.url.rsplit(":", 1)[1])) as pool:
        for _ in range(300):
            if (await pool.request("GET", "/ready")).status == 200:
                return router
            await trio.sleep(0.1)
    await _stop(router)
    raise RuntimeError(f"the router at {router.url} was not ready within 30 s")


# ---------------------------------------------------------------- the load


class Outcome(msgspec.Struct, kw_only=True):
    tenant: str
    cls: str
    scheduled: float  # offset from the phase's start
    status: int = 0  # 0: no answer (gave up at the deadline, or a transport error)
    code: str | None = None  # a refusal's error code
    ttft: float | None = None
    e2e: float | None = None
    good: bool = False  # complete within its deadline
    error: str | None = None


def schedule(rate: float, duration: float, rng: random.Random) -> list[float]:
    """Poisson arrival offsets in [0, duration)."""
    out, t = [], 0.0
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(t)
    return out


async def send(pool: H2Pool, body: bytes, tenant: str, cls: str, deadline: float, start: float, run_start: float) -> Outcome:
    """One streamed request planned for ``start``, timed from then; the
    client gives up at ``start + deadline``."""
    await trio.sleep_until(start)
    out = Outcome(tenant=tenant, cls=cls, scheduled=start - run_start)
    headers = [("authorization", f"Bearer {_key(tenant)}"), ("content-type", "application/json"),
               ("x-priority", cls), ("x-deadline-ms", str(int(deadline * 1000)))]  # fmt: skip
    result = RequestResult(index=0, scheduled=out.scheduled)
    with trio.move_on_at(start + deadline):
        try:
            async with pool.stream("POST", "/v1/completions", headers=headers, body=body) as resp:
                out.status = resp.status
                if resp.status != 200:
                    data = await resp.read()
                    out.e2e = trio.current_time() - start
                    try:
                        out.code = msgspec.json.decode(data)["error"]["code"]
                    except (msgspec.DecodeError, KeyError, TypeError):
                        out.code = f"http_{resp.status}"
                    return out
                timer = StreamTimer(result, start)
                async for chunk in resp:
                    timer.feed(chunk, trio.current_time())
                timer.finish(trio.current_time())
        except Exception as exc:
            out.error = type(exc).__name__
            return out
    out.ttft = result.ttft
    if result.e2e is not None and result.error is None and out.status == 200:
        out.e2e = result.e2e
        out.good = result.e2e <= deadline
    elif out.status == 200:
        out.error = result.error or "deadline"
    return out


async def sample(metrics_url: str, timeline: list[dict[str, float]], start: float) -> None:
    """Every 0.5 s, the router's admission slots held and requests queued (from /metrics)."""
    parts = metrics_url.rsplit(":", 1)
    async with H2Pool(parts[0].removeprefix("http://"), int(parts[1])) as pool:
        while True:
            reply = await pool.request("GET", "/metrics", limit=1 << 22)
            point = {"t": round(trio.current_time() - start, 2), "busy": 0.0, "queued": 0.0, "capacity": 0.0}
            for line in reply.body.decode().splitlines():
                name, _, value = line.rpartition(" ")
                if name == "headrace_queue_busy":
                    point["busy"] = float(value)
                elif name == "headrace_queue_capacity":
                    point["capacity"] = float(value)
                elif name.startswith("headrace_queue_depth{"):
                    point["queued"] += float(value)
                elif name.startswith("headrace_backend_in_flight{"):
                    point["in_flight"] = point.get("in_flight", 0.0) + float(value)
            timeline.append(point)
            await trio.sleep(0.5)


async def router_rejections(metrics_url: str) -> dict[str, float | None]:
    """The router's own arrival-to-refusal p50/p99 (ms), from its /metrics."""
    host, port = metrics_url.removeprefix("http://").rsplit(":", 1)
    async with H2Pool(host, int(port)) as pool:
        body = (await pool.request("GET", "/metrics", limit=1 << 22)).body.decode()
    found: dict[str, float | None] = {"p50": None, "p99": None}
    for line in body.splitlines():
        for q, key in (('quantile="0.5"', "p50"), ('quantile="0.99"', "p99")):
            if line.startswith("headrace_pipeline_rejection_seconds{") and q in line:
                found[key] = round(float(line.rsplit(" ", 1)[1]) * 1000, 3)
    return found


async def run_phase(url: str, plan: list[tuple[float, str, str]], args: argparse.Namespace,
                    metrics_url: str | None = None, timeline: list[dict[str, float]] | None = None) -> list[Outcome]:
    """``plan``: (offset, tenant, class) for each request. Each tenant has
    its own connections, so one tenant's streams never queue behind
    another's on one TCP connection at the client."""
    deadlines = dict(zip(CLASSES, args.deadlines, strict=True))
    body = msgspec.json.encode({"model": "m", "prompt": "hello " * args.prompt_words, "max_tokens": args.max_tokens,
                                "stream": True, "stream_options": {"include_usage": True}})  # fmt: skip
    port = int(url.rsplit(":", 1)[1])
    outcomes: list[Outcome] = []
    async with AsyncExitStack() as stack:
        pools = {t: await stack.enter_async_context(H2Pool("127.0.0.1", port, max_connections=16, pool_timeout=30))
                 for t in sorted({t for _, t, _ in plan})}  # fmt: skip
        for pool in pools.values():  # open the connections before the clock starts
            await pool.request("GET", "/health")
        start = trio.current_time() + 0.5

        async def one(offset: float, tenant: str, cls: str) -> None:
            outcomes.append(await send(pools[tenant], body, tenant, cls, deadlines[cls], start + offset, start))

        async with trio.open_nursery() as outer:
            if metrics_url is not None and timeline is not None:
                outer.start_soon(sample, metrics_url, timeline, start)
            async with trio.open_nursery() as nursery:
                for offset, tenant, cls in plan:
                    nursery.start_soon(one, offset, tenant, cls)
            outer.cancel_scope.cancel()
    return sorted(outcomes, key=lambda o: o.scheduled)


def mixed_plan(rate: float, duration: float, mix: list[float], seed: int) -> list[tuple[float, str, str]]:
    rng = random.Random(seed)
    tenants = dict(zip(CLASSES, ("chat", "app", "bulk"), strict=True))
    plan = []
    for t in schedule(rate, duration, rng):
        cls = rng.choices(CLASSES, weights=mix)[0]
        plan.append((t, tenants[cls], cls))
    return plan


def fairness_plan(quiet: float, duration: float, seed: int, *, flood: bool) -> list[tuple[float, str, str]]:
    rng = random.Random(seed)
    plan = [(t, "quiet", "default") for t in schedule(quiet, duration, rng)]
    if flood:
        plan += [(t, "flood", "default") for t in schedule(20 * quiet, duration, random.Random(seed + 1))]
    return sorted(plan)


async def run_probe(url: str, args: argparse.Namespace, out: list[dict[str, Any]], router_pid: int,
                    cpus: list[int] | None = None) -> None:  # fmt: skip
    """The refusal probe (bench/refusal_probe.py) in its own process, from
    3 s into the phase (the queues have built) to 3 s before its end, on
    ``cpus`` when given; it also notes its own and the router's run-queue
    waits per answer."""
    await trio.sleep(3.5)
    argv = [sys.executable, "-m", "bench.refusal_probe", "--url", url, "--key", _key("probe"),
            "--rate", f"{args.probe_rate:g}", "--duration", f"{max(1.0, args.duration - 6):g}",
            "--router-pid", str(router_pid)]  # fmt: skip
    if cpus:
        argv += ["--cpus", ",".join(map(str, cpus))]
    done = await trio.run_process(argv, capture_stdout=True)
    out.extend(msgspec.json.decode(done.stdout)["answers"])


def summarize_probe(answers: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    refused = [a["ms"] / 1000 for a in answers if a["code"] is not None]
    codes: dict[str, int] = {}
    for a in answers:
        if a["code"] is not None:
            codes[a["code"]] = codes.get(a["code"], 0) + 1
    return {"sent": len(answers), "refused": codes, "rate": args.probe_rate,
            "refusal_ms": {"count": len(refused), "p50": _ms(refused, 50), "p99": _ms(refused, 99)},
            "samples": [[a.get("at"), a["ms"], a["code"], a.get("probe_wait_ms"), a.get("router_wait_ms")] for a in answers]}


# ---------------------------------------------------------------- the report


def _ms(xs: list[float], q: float) -> float | None:
    value = percentile(xs, q)
    return None if value is None else round(value * 1000, 1)


def summarize(outcomes: list[Outcome], tenant_filter: str | None = None) -> dict[str, Any]:
    by_class: dict[str, Any] = {}
    for cls in CLASSES:
        mine = [o for o in outcomes if o.cls == cls and (tenant_filter is None or o.tenant == tenant_filter)]
        if not mine:
            continue
        ttfts = [o.ttft for o in mine if o.ttft is not None]
        codes: dict[str, int] = {}
        for o in mine:
            if o.code is not None:
                codes[o.code] = codes.get(o.code, 0) + 1
        by_class[cls] = {
            "sent": len(mine),
            "good": sum(o.good for o in mine),
            "goodput": round(sum(o.good for o in mine) / len(mine), 4),
            "ttft_ms": {"p50": _ms(ttfts, 50), "p99": _ms(ttfts, 99)},
            "refused": codes,
            "gave_up": sum(1 for o in mine if o.status == 200 and not o.good) + sum(1 for o in mine if o.status == 0),
            "errors": sum(1 for o in mine if o.error not in (None, "deadline")),
        }
    # At arrival (shed, queue_full, rate_limited, no_healthy_backend); a
    # queue_timeout waited by definition and is counted apart.
    refusals = [o.e2e for o in outcomes if o.code not in (None, "queue_timeout") and o.e2e is not None]
    sent = sum(c["sent"] for c in by_class.values())
    return {
        "classes": by_class,
        "sent": sent,
        "goodput": round(sum(c["good"] for c in by_class.values()) / sent, 4) if sent else None,
        "refusal_ms": {"count": len(refusals), "p50": _ms(refusals, 50), "p99": _ms(refusals, 99)},
    }


def quiet_ttfts(outcomes: list[Outcome]) -> list[float]:
    return [o.ttft for o in outcomes if o.tenant == "quiet" and o.ttft is not None]


def verdicts(doc: dict[str, Any]) -> dict[str, Any]:
    empty: dict[str, Any] = {"classes": {}, "goodput": None, "refusal_ms": {"p99": None}}
    on, off = doc["mixed"].get("on", empty), doc["mixed"].get("off", empty)
    solo, flooded = doc["fairness"]["solo"]["ttft_ms"]["p99"], doc["fairness"]["flooded"]["ttft_ms"]["p99"]
    ratio = flooded / solo if solo and flooded else None
    refusal = ((on.get("probe") or {}).get("refusal_ms") or {}).get("p99")
    in_load = on["refusal_ms"]["p99"]
    inside = (on.get("router_refusal_ms") or {}).get("p99")
    inter = on["classes"].get("interactive", {}).get("goodput")
    return {
        "interactive_goodput_on": {"value": inter, "target": ">= 0.95", "ok": inter is not None and inter >= 0.95},
        "total_goodput_on_vs_off": {"value": [on["goodput"], off["goodput"]], "target": "on > off",
                                    "ok": (on["goodput"] or 0) > (off["goodput"] or 0)},
        "refusal_p99_ms": {"value": refusal, "target": "< 10 (at a probe client in its own process)",
                           "ok": refusal is not None and refusal < 10},
        "load_generator_refusal_p99_ms": {"value": in_load, "target": "none: informative, the load generator's own loop lag included",
                                          "ok": None},
        "router_refusal_p99_ms": {"value": inside, "target": "< 10 (inside the router)", "ok": inside is not None and inside < 10},
        "quiet_ttft_p99_ratio": {"value": None if ratio is None else round(ratio, 3), "target": "<= 1.2",
                                 "ok": ratio is not None and ratio <= 1.2},
    }  # fmt: skip


def render(doc: dict[str, Any]) -> str:
    out = [f"overload at {doc['bed']['load']:g}x capacity ({doc['bed']['capacity_rps']:.1f} req/s: "
           f"{doc['bed']['mocks']} mocks x {doc['bed']['slots']} slots, {doc['bed']['service_s']:.2f} s a request); "
           f"CPU {doc['cpu']['model']} x {doc['cpu']['cores']}", "",
           f"{'admission':<10}{'class':<13}{'sent':>6}{'goodput':>9}{'TTFT p50':>10}{'TTFT p99':>10}  refused"]  # fmt: skip
    for mode in doc["mixed"]:
        run = doc["mixed"][mode]
        for cls, c in run["classes"].items():
            refused = ", ".join(f"{k} {v}" for k, v in sorted(c["refused"].items())) or "-"
            out.append(f"{mode:<10}{cls:<13}{c['sent']:>6}{c['goodput']:>9.1%}{dash(c['ttft_ms']['p50']):>10}"
                       f"{dash(c['ttft_ms']['p99']):>10}  {refused}")  # fmt: skip
        r, inside = run["refusal_ms"], run.get("router_refusal_ms") or {}
        out.append(f"{mode:<10}{'all':<13}{run['sent']:>6}{run['goodput']:>9.1%}   refusals at arrival: {r['count']}, "
                   f"p50/p99 {dash(r['p50'])}/{dash(r['p99'])} ms at the client, "
                   f"{dash(inside.get('p50'))}/{dash(inside.get('p99'))} ms inside the router; router CPU {run.get('router_cpu', 0):.0%}"
                   + (f"; box {run['box']['cores_busy']:.2f} cores busy, {run['box']['other_cores']:.2f} not this bed, "
                      f"load {run['box']['load_avg_1m']:.2f}" if "box" in run else ""))  # fmt: skip
        if "probe" in run:
            pr = run["probe"]
            codes = ", ".join(f"{k} {v}" for k, v in sorted(pr["refused"].items())) or "-"
            out.append(f"{mode:<10}{'probe':<13}{pr['sent']:>6}{'':>9}   refused {pr['refusal_ms']['count']} ({codes}), "
                       f"p50/p99 {dash(pr['refusal_ms']['p50'])}/{dash(pr['refusal_ms']['p99'])} ms at a client in its own process")  # fmt: skip
    f = doc["fairness"]
    out += ["", f"quiet tenant at {f['quiet_rps']:g} req/s, TTFT ms p50/p99: solo {dash(f['solo']['ttft_ms']['p50'])}/"
                f"{dash(f['solo']['ttft_ms']['p99'])} ({f['solo']['count']}), beside a 20x flood "
                f"{dash(f['flooded']['ttft_ms']['p50'])}/{dash(f['flooded']['ttft_ms']['p99'])} ({f['flooded']['count']}); "
                f"flood goodput {f['flood_goodput']:.1%}", ""]  # fmt: skip
    for name, v in doc["verdicts"].items():
        out.append(f"{'INFO' if v['ok'] is None else 'PASS' if v['ok'] else 'MISS'}  {name}: {v['value']} (target {v['target']})")
    return "\n".join(out)


def plot(doc: dict[str, Any], path: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(19, 4.2), layout="constrained")
    fig.suptitle(f"headrace bench overload: {doc['bed']['load']:g}x capacity, {doc['cpu']['model']}")
    ax1, ax2, ax3, ax4 = fig.subplots(1, 4)
    width = 0.38
    for i, mode in enumerate(m for m in ("on", "off") if m in doc["mixed"]):
        classes = doc["mixed"][mode]["classes"]
        xs = [j + (i - 0.5) * width for j in range(len(CLASSES))]
        ax1.bar(xs, [classes.get(c, {}).get("goodput", 0) for c in CLASSES], width, label=f"admission {mode}")
        ax2.bar(xs, [classes.get(c, {}).get("ttft_ms", {}).get("p99") or 0 for c in CLASSES], width, label=f"admission {mode}")
    for ax, title in ((ax1, "goodput (complete within deadline)"), (ax2, "TTFT p99 of answered (ms)")):
        ax.set_xticks(range(len(CLASSES)), CLASSES)
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize="small")
    ax1.axhline(0.95, color="grey", linestyle="--")
    ax2.set_yscale("log")
    for name in ("solo", "flooded"):
        xs = sorted(doc["fairness"][name]["ttfts_ms"])
        ax3.plot(xs, [(k + 1) / len(xs) for k in range(len(xs))], label=f"quiet tenant, {name}")
    ax3.set_title("quiet tenant TTFT CDF (ms)")
    ax3.grid(True, alpha=0.3)
    ax3.legend(fontsize="small")
    samples = (doc["mixed"].get("on") or {}).get("probe", {}).get("samples", [])
    waited = [row for row in samples if row[3] is not None]  # waits noted (the probe knew the router's pid)
    for label, values in (("at the probe", [row[1] for row in samples]),
                          ("less run-queue waits", [row[1] - row[3] - row[4] for row in waited])):  # fmt: skip
        if not values:
            continue
        xs = sorted(values)
        ax4.plot(xs, [(k + 1) / len(xs) for k in range(len(xs))], label=label)
    ax4.axvline(10, color="grey", linestyle="--")
    ax4.set_title("refusal latency CDF at the probe (ms)")
    ax4.grid(True, alpha=0.3)
    ax4.legend(fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return path


# ---------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="headrace bench overload", description=__doc__.split("\n\n")[0])
    p.add_argument("--mocks", type=int, default=4)
    p.add_argument("--slots", type=int, default=4, help="streams at once per mock (its max_concurrency)")
    p.add_argument("--ttft-ms", type=float, default=100.0)
    p.add_argument("--tpot-ms", type=float, default=20.0)
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--prompt-words", type=int, default=20)
    p.add_argument("--load", type=float, default=2.0, help="offered load, x the fleet's capacity")
    p.add_argument("--mix", type=float, nargs=3, default=[0.2, 0.3, 0.5], metavar=("I", "D", "B"),
                   help="shares of interactive, default, batch requests")
    p.add_argument("--deadlines", type=float, nargs=3, default=[3.0, 8.0, 20.0], metavar=("I", "D", "B"),
                   help="seconds each class waits for a complete answer")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per mixed run")
    p.add_argument("--quiet-rps", type=float, default=1.0)
    p.add_argument("--fair-duration", type=float, default=90.0, help="seconds of arrivals per fairness run")
    p.add_argument("--reserve-slots", type=int, default=0, help="[admission] reserve_slots of the mixed runs")
    p.add_argument("--fair-reserve-slots", type=int, default=4, help="[admission] reserve_slots of the fairness runs")
    p.add_argument("--probe-rate", type=float, default=5.0,
                   help="refusal probes per second from their own process while admission is on (0: none)")
    p.add_argument("--mock-nice", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pin-router", action="store_true",
                   help="the router and the refusal probe on the first CPU, the mocks and the load generator on the others")
    p.add_argument("--skip-fairness", action="store_true")
    p.add_argument("--skip-mixed", action="store_true")
    p.add_argument("--skip-off", action="store_true",
                   help="mixed phase with admission on only (no on/off goodput comparison)")
    p.add_argument("--json", dest="json_path")
    p.add_argument("--plot", dest="plot_path")
    p.add_argument("--no-plot", action="store_true")
    return p


def cpu_layout(pinned: bool) -> dict[str, list[int]] | None:
    """The router's CPU and everyone else's (None: all share all CPUs)."""
    cpus = sorted(os.sched_getaffinity(0))
    if not pinned or len(cpus) < 2:
        return None
    return {"router": cpus[:1], "others": cpus[1:]}


def pin(pid: int, cpus: list[int]) -> None:
    """Every thread of ``pid`` onto ``cpus``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass


def _box_sample() -> tuple[float, float, float]:
    """(wall, CPU seconds of the whole box, CPU seconds of this bed: this
    process and its live descendants, the router, mocks and probe)."""
    busy = psutil.cpu_times()
    return time.monotonic(), sum(busy) - busy.idle - getattr(busy, "iowait", 0.0), cpu_seconds(os.getpid())


def _box(before: tuple[float, float, float], after: tuple[float, float, float]) -> dict[str, float]:
    """How busy the box was during a run, in cores: all of it, and what
    was not this bed (another benchmark sharing the box shows here), with
    the load average at the end."""
    wall = after[0] - before[0]
    return {"cores_busy": round((after[1] - before[1]) / wall, 2),
            "other_cores": round(max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / wall, 2),
            "load_avg_1m": round(os.getloadavg()[0], 2)}  # fmt: skip


async def run(args: argparse.Namespace) -> dict[str, Any]:
    service = args.ttft_ms / 1000 + args.tpot_ms / 1000 * args.max_tokens
    capacity = args.mocks * args.slots / service
    doc: dict[str, Any] = {
        "kind": "overload",
        "cpu": {k: v for k, v in cpu_info().items() if k != "flags"},
        "bed": {"mocks": args.mocks, "slots": args.slots, "ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms,
                "max_tokens": args.max_tokens, "service_s": service, "capacity_rps": capacity, "load": args.load,
                "mix": dict(zip(CLASSES, args.mix, strict=True)), "deadlines_s": dict(zip(CLASSES, args.deadlines, strict=True)),
                "reserve_slots": {"mixed": args.reserve_slots, "fairness": args.fair_reserve_slots},
                "router": "own process, --workers 1"},
        "mixed": {},
    }  # fmt: skip
    layout = cpu_layout(args.pin_router)
    doc["bed"]["cpus"] = layout or "shared"
    router_cpus = layout["router"] if layout is not None else None
    if layout is not None:
        pin(os.getpid(), layout["others"])  # the mocks inherit it
    with tempfile.TemporaryDirectory(prefix="headrace-overload-") as tmp:
        logdir = Path(tmp)
        async with AsyncExitStack() as stack:
            mocks = await start_mocks(stack, args, logdir)
            plan = mixed_plan(args.load * capacity, args.duration, args.mix, args.seed)
            for mode in () if args.skip_mixed else ("on",) if args.skip_off else ("on", "off"):
                router = await start_router(args, mocks, logdir, admission=mode == "on", reserve=args.reserve_slots, cpus=router_cpus)
                try:
                    print(f"mixed load, admission {mode}: {len(plan)} requests over {args.duration:g} s", file=sys.stderr)
                    timeline: list[dict[str, float]] = []
                    metrics = await _metrics_url(router)
                    cpu = router.cpu_seconds()
                    box = _box_sample()
                    began = time.monotonic()
                    probed: list[dict[str, Any]] = []
                    async with trio.open_nursery() as nursery:
                        if mode == "on" and args.probe_rate > 0:
                            # Pinned, the probe is beside the router: a client at 5-10
                            # requests a second does not queue behind the load generator.
                            nursery.start_soon(run_probe, router.url, args, probed, router.pid, router_cpus)
                        doc["mixed"][mode] = summarize(await run_phase(router.url, plan, args, metrics, timeline))
                    if probed:
                        doc["mixed"][mode]["probe"] = summarize_probe(probed, args)
                    doc["mixed"][mode]["router_cpu"] = round((router.cpu_seconds() - cpu) / (time.monotonic() - began), 3)
                    doc["mixed"][mode]["box"] = _box(box, _box_sample())
                    doc["mixed"][mode]["router_rss_mb"] = round(psutil.Process(router.pid).memory_info().rss / 2**20, 1)
                    doc["mixed"][mode]["timeline"] = timeline
                    doc["mixed"][mode]["router_refusal_ms"] = await router_rejections(metrics)
                finally:
                    await _stop(router)
                await trio.sleep(1.0)  # the mocks finish what the router cancelled
            if not args.skip_fairness:
                router = await start_router(args, mocks, logdir, admission=True, reserve=args.fair_reserve_slots, cpus=router_cpus)
                try:
                    fair: dict[str, Any] = {"quiet_rps": args.quiet_rps, "flood_rps": 20 * args.quiet_rps}
                    for name, flood in (("solo", False), ("flooded", True)):
                        print(f"fairness, {name}", file=sys.stderr)
                        outcomes = await run_phase(router.url, fairness_plan(args.quiet_rps, args.fair_duration, args.seed, flood=flood), args)
                        ttfts = quiet_ttfts(outcomes)
                        quiet = [o for o in outcomes if o.tenant == "quiet"]
                        fair[name] = {"count": len(ttfts), "sent": len(quiet), "good": sum(o.good for o in quiet),
                                      "refused": sorted(o.code for o in quiet if o.code is not None),
                                      "ttft_ms": {"p50": _ms(ttfts, 50), "p99": _ms(ttfts, 99)},
                                      "ttfts_ms": [round(x * 1000, 2) for x in ttfts]}  # fmt: skip
                        if flood:
                            floods = [o for o in outcomes if o.tenant == "flood"]
                            fair["flood_goodput"] = sum(o.good for o in floods) / max(1, len(floods))
                    doc["fairness"] = fair
                finally:
                    await _stop(router)
    if "fairness" not in doc:
        empty = {"count": 0, "ttft_ms": {"p50": None, "p99": None}, "ttfts_ms": []}
        doc["fairness"] = {"quiet_rps": args.quiet_rps, "solo": empty, "flooded": empty, "flood_goodput": 0.0}
    doc["verdicts"] = verdicts(doc)
    return doc


def main(argv: list[str]) -> int:
    if argv and argv[0] == "mock":
        return _serve_mock(argv[1:])
    args = _parser().parse_args(argv)
    doc = trio.run(run, args)
    print(render(doc))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    json_path = Path(args.json_path or f"{RESULTS}/overload-{stamp}.json")
    print(f"wrote {write_json(json_path, doc)}", file=sys.stderr)
    if not args.no_plot:
        print(f"wrote {plot(doc, Path(args.plot_path or json_path.with_suffix('.png')))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

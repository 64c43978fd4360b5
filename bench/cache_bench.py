"""``headrace bench cache``: cache-aware routing against round robin, through the real router.

A shared-prefix multi-tenant workload (issue 13's): ``--groups`` tenants, each
with its own system prompt of ``--system-tokens`` tokens, and multi-turn
conversations that grow (each turn re-sends the conversation so far: the
system prompt, every earlier question and answer, and a new question).
Conversations start as a Poisson process; a conversation's turns follow each
other ``--think-s`` apart. For each ``--policy`` and each ``--rate`` (new
requests per second) it starts a fresh bed::

    N x headrace mock --block-size 16 --cache-blocks C --prefill-ms-per-token P     (--kind mock)
    N x headrace engine (the default model)                                          (--kind engine)
    headrace serve --policy P --backend ...

and replays the same requests, streamed, through the router. Per policy and
rate: the prefix-cache hit rate (cached prompt tokens / prompt tokens, from
each answer's ``usage``), TTFT p50/p99, throughput (answers and prompt tokens
per second), errors, and load balance two ways, max over mean across
backends: of the requests each served (the router's /admin/backends counts)
and of its time-averaged in-flight streams (sampled from /admin/backends
every ``--sample-s``; the load bounded-load policies bound). It also reports the policy's own prediction of what was
cached (``predicted_cached_tokens`` of kv_aware's statistics, when the
router exposes them) beside what the backends reported.

The highest rate whose p99 TTFT stays under ``--slo-ms`` is each policy's
throughput at that SLO; the ratios to round_robin at equal p99 go in the
report. Prints a table, writes JSON and a PNG under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio

from bench.procs import admin_url, cpu_info
from bench.progress import ProgressBar
from bench.report import write_json
from bench.router_bench import _python, _ready, _start_all

__all__ = ["Conversation", "main", "parse_args", "workload"]

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey", "xray", "yankee", "zulu"]


class Conversation(msgspec.Struct, kw_only=True):
    group: int
    system: str
    questions: list[str]
    answers: list[str]  # synthetic earlier answers (the workload is fixed, whatever the model says)


class Planned(msgspec.Struct, frozen=True, kw_only=True):
    at: float  # seconds from the start
    conversation: int
    turn: int


def _text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


def workload(args: argparse.Namespace, rate: float) -> tuple[list[Conversation], list[Planned]]:
    """The same conversations for every policy at a rate (seeded); ``rate``
    is requests per second, so conversations start at rate / turns."""
    rng = random.Random(args.seed)
    chars_per_token = 1.0 if args.kind == "mock" else 4.0  # the mock's tokens are bytes
    systems = [f"[tenant {g}] " + _text(rng, int(rng.uniform(*args.system_tokens) * chars_per_token))
               for g in range(args.groups)]
    q_chars = int(args.turn_tokens * chars_per_token)
    a_chars = int((args.turn_tokens if args.answer_tokens is None else args.answer_tokens) * chars_per_token)
    count = max(1, math.ceil(args.duration * rate / args.turns))
    conversations, plan = [], []
    start = 0.0
    for c in range(count):
        start += rng.expovariate(rate / args.turns)
        g = rng.randrange(args.groups)
        conversations.append(Conversation(
            group=g, system=systems[g],
            questions=[f"q{c}.{t}: " + _text(rng, q_chars) for t in range(args.turns)],
            answers=[f"a{c}.{t}: " + _text(rng, a_chars) for t in range(args.turns)],
        ))
        for t in range(args.turns):
            plan.append(Planned(at=start + t * args.think_s, conversation=c, turn=t))
    plan.sort(key=lambda p: p.at)
    return conversations, plan


def messages(conv: Conversation, turn: int) -> list[dict[str, str]]:
    out = [{"role": "system", "content": conv.system}]
    for t in range(turn):
        out += [{"role": "user", "content": conv.questions[t]}, {"role": "assistant", "content": conv.answers[t]}]
    out.append({"role": "user", "content": conv.questions[turn]})
    return out


class Result(msgspec.Struct, kw_only=True):
    ttft: float | None = None
    e2e: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


async def _one(client: httpx.AsyncClient, body: dict[str, Any], out: list[Result], patience: float) -> None:
    result = Result()
    start = trio.current_time()
    try:
        with trio.fail_after(patience):
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    result.error = f"http_{r.status_code}"
                    await r.aread()
                else:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if result.ttft is None and chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                            result.ttft = trio.current_time() - start
                        usage = chunk.get("usage")
                        if usage:
                            result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                            details = usage.get("prompt_tokens_details") or {}
                            result.cached_tokens = int(details.get("cached_tokens") or 0)
    except trio.TooSlowError:
        result.error = "timeout"
    except httpx.HTTPError as exc:
        result.error = type(exc).__name__
    result.e2e = trio.current_time() - start
    out.append(result)


async def _replay(url: str, args: argparse.Namespace, conversations: list[Conversation], plan: list[Planned],
                  label: str) -> tuple[list[Result], float]:
    out: list[Result] = []
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    bar = ProgressBar(label)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits, trust_env=False) as client:
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i, p in enumerate(plan):
                await trio.sleep_until(t0 + p.at)
                body = {"model": args.model, "messages": messages(conversations[p.conversation], p.turn),
                        "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}}
                if args.kind == "mock":
                    body["ignore_eos"] = True
                nursery.start_soon(_one, client, body, out, args.timeout)
                bar.update(i / len(plan), f"{len(out)} done", time.monotonic())
        elapsed = trio.current_time() - t0
    bar.close(f"{len(out)} answers in {elapsed:.1f} s")
    return out, elapsed


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(results: list[Result], elapsed: float, per_backend: dict[str, int]) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    loads = list(per_backend.values())
    mean = statistics.mean(loads) if loads else 0
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "hit_rate": cached / prompt if prompt else 0.0,
        "ttft_p50_ms": 1000 * (_percentile(ttfts, 0.5) or 0),
        "ttft_p99_ms": 1000 * (_percentile(ttfts, 0.99) or 0),
        "answers_per_s": len(ok) / elapsed if elapsed else 0.0,
        "prompt_tokens_per_s": prompt / elapsed if elapsed else 0.0,
        "max_over_avg_load": max(loads) / mean if mean else None,
        "per_backend": per_backend,
    }


def _backend_argv(args: argparse.Namespace) -> list[str]:
    if args.kind == "mock":
        return _python("router.cli", "mock", "--port", "0", "--model", args.model,
                       "--tpot-ms", f"{args.tpot_ms:g}", "--ttft-ms", f"{args.ttft_ms:g}",
                       "--block-size", "16", "--cache-blocks", str(args.cache_blocks),
                       "--prefill-ms-per-token", f"{args.prefill_ms_per_token:g}",
                       "--max-tokens", str(args.max_tokens))
    return _python("router.cli", "engine", "--port", "0", *args.engine_args.split())


async def run_one(args: argparse.Namespace, policy: str, rate: float, logdir: Path) -> dict[str, Any]:
    conversations, plan = workload(args, rate)
    async with AsyncExitStack() as stack:
        backends = await _start_all(stack, logdir, [(f"{args.kind}{i}", _backend_argv(args)) for i in range(args.backends)])
        serve = _python("router.cli", "serve", "--port", "0", "--workers", "1", "--log-level", "WARNING",
                        "--policy", policy)
        for b in backends:
            serve += ["--backend", b.url]
        if args.policy_options:
            serve += ["--set", f"routing.options={args.policy_options}"]
        (router,) = await _start_all(stack, logdir, [("router", serve)])
        await _ready(router.url, "/ready", patience=120.0)
        if args.model == "auto":  # whatever the backends serve
            async with httpx.AsyncClient(base_url=router.url, trust_env=False) as client:
                args.model = (await client.get("/v1/models")).json()["data"][0]["id"]
        admin = await admin_url(router)
        samples: dict[str, float] = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_sample_in_flight, admin, samples, args.sample_s)
            results, elapsed = await _replay(router.url, args, conversations, plan, f"{policy} @ {rate:g} req/s")
            nursery.cancel_scope.cancel()
        async with httpx.AsyncClient(base_url=admin, trust_env=False) as client:
            listed = (await client.get("/admin/backends")).json()["data"]
            routing = await client.get("/admin/routing")
    per_backend = {b["name"]: b["requests"] for b in listed}
    row = {"policy": policy, "rate": rate, **summarize(results, elapsed, per_backend)}
    count = samples.pop("", 0.0)
    in_flight = {name: total / count for name, total in samples.items()} if count else {}
    mean = statistics.mean(in_flight.values()) if in_flight else 0.0
    row["in_flight_mean"] = in_flight
    row["in_flight_max_over_avg"] = max(in_flight.values()) / mean if mean else None
    stats = routing.json()["data"][0]["statistics"] if routing.status_code == 200 else None
    if stats and stats.get("checked"):  # kv_aware: its prediction at each pick against what the backend reported
        row["predicted_agreement"] = stats["agreed"] / stats["checked"]
        row["predicted_checked"] = stats["checked"]
        row["predicted_over"], row["predicted_under"] = stats.get("over", 0), stats.get("under", 0)
    return row


async def _sample_in_flight(admin: str, samples: dict[str, float], every: float) -> None:
    """Sum each backend's in-flight count from /admin/backends every
    ``every`` seconds (the count of samples under ""), until cancelled: their
    mean is the time-averaged in-flight load, the load bounded loads bound."""
    async with httpx.AsyncClient(base_url=admin, trust_env=False) as client:
        while True:
            await trio.sleep(every)
            try:
                listed = (await client.get("/admin/backends")).json()["data"]
            except (httpx.HTTPError, ValueError, KeyError):
                continue
            for b in listed:
                samples[b["name"]] = samples.get(b["name"], 0.0) + b["in_flight"]
            samples[""] = samples.get("", 0.0) + 1


def at_slo(rows: list[dict[str, Any]], slo_ms: float) -> dict[str, dict[str, Any]]:
    """Per policy: the highest-rate row with no errors and p99 TTFT under the SLO."""
    best: dict[str, dict[str, Any]] = {}
    for r in rows:
        fits = r["errors"] == 0 and r["ttft_p99_ms"] <= slo_ms
        if fits and (r["policy"] not in best or r["rate"] > best[r["policy"]]["rate"]):
            best[r["policy"]] = r
    return best


def row_line(r: dict[str, Any]) -> str:
    mx, fl = r["max_over_avg_load"], r.get("in_flight_max_over_avg")
    return (f"{r['policy']:<13} {r['rate']:>6g} {r['hit_rate']:>6.1%} {r['ttft_p50_ms']:>9.1f} "
            f"{r['ttft_p99_ms']:>8.1f} {r['answers_per_s']:>7.1f} {r['prompt_tokens_per_s']:>8.0f} "
            f"{(f'{mx:.2f}' if mx else '-'):>8} {(f'{fl:.2f}' if fl else '-'):>9} {r['errors']:>4}")


def format_report(doc: dict[str, Any]) -> str:
    cpu = doc["cpu"]
    lines = [f"CPU: {cpu['model']} ({cpu['cores']} cores; {', '.join(cpu['features'])})",
             f"{doc['args']['backends']} x {doc['args']['kind']}, {doc['args']['groups']} groups, "
             f"{doc['args']['turns']} turns, SLO p99 TTFT {doc['args']['slo_ms']:g} ms",
             f"{'policy':<13} {'rate':>6} {'hit':>6} {'TTFT p50':>9} {'p99':>8} {'ans/s':>7} {'ptok/s':>8} {'req max/avg':>8} {'inflight':>9} {'err':>4}"]
    lines += [row_line(r) for r in doc["rows"]]
    agreed = [r for r in doc["rows"] if "predicted_agreement" in r]
    if agreed:
        lines.append("")
        lines.append("kv_aware's predicted cached tokens agreeing (within a block) with the backend's usage.cached_tokens:")
        lines += [f"  {r['rate']:>6g} req/s: {r['predicted_agreement']:.1%} of {r['predicted_checked']} requests"
                  f" ({r.get('predicted_over', 0)} over, {r.get('predicted_under', 0)} under)" for r in agreed]
    if doc.get("simulated"):
        lines.append("")
        lines.append("the simulator's prediction for the same requests (headrace simulate --trace):")
        for r in doc["simulated"]:
            lines.append(f"  {r['policy']:<13} {r['rate']:>6g} hit {r['hit_rate']:>6.1%} TTFT p50 {r['ttft_p50_ms']:>7.1f} "
                         f"p99 {r['ttft_p99_ms']:>7.1f} ms, {r['answers_per_s']:.1f} ans/s, max/avg requests "
                         f"{r['max_over_avg_load']:.2f}, in flight {r['in_flight_max_over_avg']:.2f}")
    if doc.get("at_slo"):
        lines.append("")
        lines.append("at the SLO (highest rate with p99 TTFT under it, no errors), against round_robin:")
        base = doc["at_slo"].get("round_robin")
        for policy, r in doc["at_slo"].items():
            ratio = ""
            if base and policy != "round_robin":
                hit = r["hit_rate"] / base["hit_rate"] if base["hit_rate"] else float("inf")
                ratio = f"  hit x{hit:.2f}, throughput x{r['answers_per_s'] / base['answers_per_s']:.2f}"
            lines.append(f"  {policy:<13} {r['rate']:g} req/s, hit {r['hit_rate']:.1%}, "
                         f"p99 TTFT {r['ttft_p99_ms']:.0f} ms{ratio}")
    return "\n".join(lines)


def _plot(doc: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for policy in dict.fromkeys(r["policy"] for r in doc["rows"]):
        rows = [r for r in doc["rows"] if r["policy"] == policy]
        a.plot([r["answers_per_s"] for r in rows], [r["ttft_p99_ms"] for r in rows], marker="o", label=policy)
        b.plot([r["rate"] for r in rows], [100 * r["hit_rate"] for r in rows], marker="o", label=policy)
    a.axhline(doc["args"]["slo_ms"], color="grey", linestyle=":")
    a.set_xlabel("answers per second")
    a.set_ylabel("p99 TTFT (ms)")
    a.set_yscale("log")
    b.set_xlabel("offered requests per second")
    b.set_ylabel("prefix-cache hit rate (%)")
    for ax in (a, b):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"cache-aware routing, {doc['args']['backends']} x {doc['args']['kind']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="headrace bench cache", description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=["mock", "engine"], default="mock")
    p.add_argument("--policy", action="append", help="repeatable (default: round_robin, prefix_hash, kv_aware)")
    p.add_argument("--policy-options", default="", help="TOML inline table for [routing.options]")
    p.add_argument("--rate", type=float, action="append", help="requests per second, repeatable (default 10, 20, 30)")
    p.add_argument("--backends", type=int, default=4)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--system-tokens", type=int, nargs=2, default=[1500, 2000])
    p.add_argument("--turn-tokens", type=int, default=60, help="tokens of each question and earlier answer")
    p.add_argument("--answer-tokens", type=int, default=None,
                   help="tokens of each earlier answer in the history (default: --turn-tokens)")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--think-s", type=float, default=2.0)
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per run")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--model", default=None,
                   help="the model to ask for; auto: the first the router lists (default: mock for --kind mock, "
                        "auto for --kind engine, whose model is named by its file)")
    p.add_argument("--cache-blocks", type=int, default=600, help="mock: KV capacity per replica in 16-token blocks")
    p.add_argument("--prefill-ms-per-token", type=float, default=0.05)
    p.add_argument("--ttft-ms", type=float, default=2.0)
    p.add_argument("--tpot-ms", type=float, default=5.0)
    p.add_argument("--engine-args", default="", help="extra `headrace engine` arguments (--kind engine)")
    p.add_argument("--slo-ms", type=float, default=500.0)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-s", type=float, default=0.1, help="how often in-flight counts are sampled")
    p.add_argument("--json", default=None)
    return p


def simulated(args: argparse.Namespace, rate: float, workdir: Path) -> list[dict[str, Any]]:
    """The simulator's prediction for exactly these requests (mock beds: the
    mock's token ids are its bytes, and the simulator models the same cache
    and prefill lane), one row per policy."""
    from backends.base import ChatMessage
    from backends.mock import encode_text, render_chat
    from sim.cli import main as simulate
    from sim.trace import TraceRecord, write_trace

    conversations, plan = workload(args, rate)
    records = []
    for p in plan:
        chat = [ChatMessage(role=m["role"], content=m["content"]) for m in messages(conversations[p.conversation], p.turn)]
        records.append(TraceRecord(t=p.at, output_tokens=args.max_tokens, prompt_token_ids=encode_text(render_chat(chat)),
                                   group=conversations[p.conversation].group, conversation=p.conversation, turn=p.turn))
    trace, out = workdir / f"trace_{rate:g}.jsonl", workdir / f"sim_{rate:g}.json"
    write_trace(trace, records, {"workload": "bench cache", "seed": args.seed})
    argv = ["--trace", str(trace), "--backends", str(args.backends), "--block-size", "16",
            "--cache-blocks", str(args.cache_blocks), "--ttft-ms", f"{args.ttft_ms:g}",
            "--prefill-ms-per-token", f"{args.prefill_ms_per_token:g}", "--tpot-ms", f"{args.tpot_ms:g}",
            "--batch-slope", "0", "--max-running", "0", "--backend-prefix", "backend-",
            "--json", str(out), "--quiet"]
    for policy in args.policy:
        argv += ["--policy", policy]
    simulate(argv)
    results: list[dict[str, Any]] = json.loads(out.read_text())["results"]
    return [{"policy": r["label"], "rate": rate, "hit_rate": r["hit_rate"], "ttft_p50_ms": r["ttft_ms"]["p50"],
             "ttft_p99_ms": r["ttft_ms"]["p99"], "answers_per_s": r["throughput"]["req_s"],
             "max_over_avg_load": r["load"]["served_max_over_mean"],
             "in_flight_max_over_avg": r["load"]["in_flight_max_over_mean"]} for r in results]


async def _run(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    logdir = Path(tempfile.mkdtemp(prefix="headrace-cache-bench-"))
    for rate in args.rate:
        if args.kind == "mock":
            doc["simulated"] += simulated(args, rate, logdir)
        for policy in args.policy:
            doc["rows"].append(await run_one(args, policy, rate, logdir))
            print(row_line(doc["rows"][-1]), file=sys.stderr)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options, with the defaults that depend on others filled in."""
    args = _parser().parse_args(argv)
    args.policy = args.policy or ["round_robin", "prefix_hash", "kv_aware"]
    args.rate = args.rate or [10.0, 20.0, 30.0]
    if args.model is None:  # an engine serves its file's model, not "mock" (every request got 404)
        args.model = "mock" if args.kind == "mock" else "auto"
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    cpu = cpu_info()
    doc: dict[str, Any] = {"cpu": {k: v for k, v in cpu.items() if k != "flags"}, "args": vars(args), "rows": [], "simulated": []}
    try:
        trio.run(_run, args, doc)
    finally:
        doc["at_slo"] = at_slo(doc["rows"], args.slo_ms)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path(args.json or f"bench/results/issue13/cache_{args.kind}_{stamp}.json")
        write_json(path, doc)
        print(format_report(doc))
        png = _plot(doc, path.with_suffix(".png"))
        print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

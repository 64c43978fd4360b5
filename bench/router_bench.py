"""``headrace bench router``: what the router costs per streamed request, on
this machine, beside what a bare hypercorn app costs for the same stream.

It starts its own bed on 127.0.0.1 (issue 12's), then measures::

    2 x headrace mock --tpot-ms 0 --max-tokens 20     (20 SSE chunks per answer)
    headrace serve --workers 1 --backend M1 --backend M2
    python bench/bare_app.py                           (stock hypercorn + trio, the same 20 chunks)
    vllm-router --worker-urls M1 M2                    (when installed)

    (a) closed loop, --concurrency connections for --duration s, HTTP/1.1 and h2c,
        through the router and against the bare app: req/s, and CPU ms per request
        of each server process (its own CPU time / requests answered), the mocks'
        and the client's beside it
    (b) open loop (Poisson, bench/loadgen.py, the lean HTTP/2 client), h2c: the highest rate with e2e
        p99 < --p99-ms and no errors, through the router and straight to one
        mock; then both at half the router's rate, --half-rounds times (which
        goes first alternating): the TTFT the router adds, median over the rounds,
        and the router's CPU share (a core's fraction) at each rate
    (c) vllm-router through the same closed loop, quoted as ratios

Prints a table, writes JSON (and a PNG of p99 against offered rate) under
``bench/results/``, always (a run stopped early writes what it has). Every
phase is bounded: --duration per closed-loop run, --open-steps rates of
--open-duration s per target. Client: wrk and h2load when installed (they
cost the client a few us a request), else the Python client, which on two
cores competes with the servers for CPU (then req/s is a floor).
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio

from backends.errors import BackendUnavailable, ClientError
from bench.cli import LAG_WARN_MS, add_output_args, finish, run_reported
from bench.client import RequestSpec
from bench.drivers import check_client, run_closed
from bench.loadgen import LoadConfig, run_rate
from bench.procs import Server, cpu_info, start_server
from bench.report import compare, summarize_run
from bench.schedule import make_prompt

__all__ = ["format_report", "main", "search_max_rate"]

HTTPS = {"1.1": "1.1", "2": "h2c"}
# Started as a file: ``python -m bench.bare_app`` would import the bench
# package, and through it frontend/serving.py's patches of hypercorn.
BARE_APP = Path(__file__).with_name("bare_app.py")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="headrace bench router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=32, help="closed-loop connections")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per closed-loop run")
    p.add_argument("--http", nargs="+", choices=("1.1", "2"), default=["1.1", "2"])
    p.add_argument("--client", choices=("auto", "native", "python"), default="auto",
                   help="native: wrk (HTTP/1.1) and h2load (h2c); auto: native when installed")
    p.add_argument("--open-duration", type=float, default=5.0, help="seconds per open-loop rate")
    p.add_argument("--open-start", type=float, default=100.0, help="first open-loop rate, req/s")
    p.add_argument("--open-steps", type=int, default=9, help="rates tried per target, at most (9 take a search from 100 req/s to within 15%% of a limit near 1,000)")
    p.add_argument("--p99-ms", type=float, default=500.0, help="open-loop e2e p99 limit")
    p.add_argument("--half-rounds", type=int, default=3,
                   help="router/direct pairs at half the router's highest rate (alternating which goes "
                        "first); the added TTFT is the median over them")
    p.add_argument("--added-at", type=float, metavar="RPS",
                   help="judge the added TTFT at this rate instead of half the router's highest (which "
                        "moves between runs with the search: a fixed rate compares runs and builds)")
    p.add_argument("--added-at-share", type=float, metavar="SHARE",
                   help="judge the added TTFT at the rate where the router's CPU share was SHARE (0-1, "
                        "e.g. 0.5: half a core busy), interpolated over the search's runs: a rate that "
                        "moves with the box's speed, which --added-at's does not")
    p.add_argument("--no-open-loop", action="store_true")
    p.add_argument("--max-outstanding", type=int, default=512)
    p.add_argument("--open-connections", type=int, default=1,
                   help="the open loop's HTTP/2 connections, its requests taken in turn (one multiplexes "
                        "them all: with --workers N, one worker would see them all)")
    p.add_argument("--workers", type=int, default=1, help="router processes (headrace serve --workers)")
    p.add_argument("--router-src", type=Path, metavar="DIR",
                   help="run the router from this source checkout (e.g. a git worktree of an older "
                        "commit) for a before/after comparison in one run of the same bed")
    p.add_argument("--serve-args", default="", metavar="ARGS",
                   help="more `headrace serve` arguments for the router, e.g. '--set server.h2_ingress=\"lean\"'")
    p.add_argument("--tpot-ms", type=float, default=0.0, help="the mocks' time per token")
    p.add_argument("--max-tokens", type=int, default=20, help="chunks per answer")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-router", default="auto",
                   help="path of vllm-router, 'auto' (PATH, $PEERS_DIR/*/bin) or 'none'")
    add_output_args(p)
    p.add_argument("--report", metavar="JSON", help="print the table of a saved run; run nothing")
    return p


def _check(args: argparse.Namespace) -> None:
    bad = [args.concurrency < 1, args.duration <= 0, args.open_duration <= 0,
           args.open_start <= 0, args.open_steps < 1, args.max_tokens < 1, args.workers < 1,
           args.half_rounds < 1, args.added_at is not None and args.added_at <= 0,
           args.open_connections < 1]
    if args.added_at_share is not None and not 0 < args.added_at_share < 1:
        raise ClientError("--added-at-share must be between 0 and 1")
    if args.added_at is not None and args.added_at_share is not None:
        raise ClientError("--added-at and --added-at-share: one or the other")
    if any(bad):
        raise ClientError("--concurrency, --duration, --open-*, --max-tokens, --workers, "
                          "--half-rounds, --added-at and --open-connections must be positive")
    check_client(args.client)


# ---------------------------------------------------------------- the bed


class Bed:
    def __init__(self) -> None:
        self.mocks: list[Server] = []
        self.router: Server | None = None
        self.bare: Server | None = None


def _python(*args: str) -> list[str]:
    return [sys.executable, "-m", *args]


def _source(path: Path | None) -> dict[str, str] | None:
    """Where the router ran from, and its commit (None: this checkout)."""
    if path is None:
        return None
    done = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False)
    return {"path": str(path), "commit": done.stdout.strip()}


def serve_has_workers(cwd: Path | None = None) -> bool:
    """Whether ``headrace serve`` takes ``--workers`` (older builds do not)."""
    done = subprocess.run(_python("router.cli", "serve", "--help"), capture_output=True,
                          text=True, check=False, timeout=60, cwd=cwd)
    return "--workers" in done.stdout


async def _ready(url: str, path: str, patience: float = 30.0) -> None:
    async with httpx.AsyncClient(base_url=url, trust_env=False) as client:
        with trio.move_on_after(patience):
            while True:
                try:
                    if (await client.get(path)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await trio.sleep(0.1)
    raise BackendUnavailable(f"{url}{path} did not answer 200 within {patience:g} s")


def mock_argv(tpot_ms: float, max_tokens: int) -> list[str]:
    """One ``headrace mock`` of the router's bed: ``max_tokens`` SSE chunks an
    answer, ``tpot_ms`` apart, on a free port."""
    return _python("router.cli", "mock", "--port", "0", "--tpot-ms", f"{tpot_ms:g}", "--max-tokens", str(max_tokens))


def backend_args(servers: Sequence[Server]) -> list[str]:
    """``--backend URL`` for each of ``servers``."""
    return [a for server in servers for a in ("--backend", server.url)]


def serve_argv(mocks: Sequence[Server], workers: int | None = 1) -> list[str]:
    """``headrace serve`` in front of ``mocks`` on a free port, quiet; ``workers``
    None leaves the flag out (builds older than ``--workers``)."""
    workers_args = ["--workers", str(workers)] if workers is not None else []
    return _python("router.cli", "serve", "--port", "0", "--log-level", "WARNING", *workers_args) + backend_args(mocks)


async def start_bed(args: argparse.Namespace, logdir: Path, stack: AsyncExitStack, *,
                    bare: bool = True, serve_args: Sequence[str] = ()) -> Bed:
    """The mocks first (the router needs their URLs), then the router (with
    ``serve_args`` appended) and the bare app (``bare``), side by side."""
    bed = Bed()
    mock = mock_argv(args.tpot_ms, args.max_tokens)
    bed.mocks = await _start_all(stack, logdir, [("mock0", mock), ("mock1", mock)])
    workers = args.workers if serve_has_workers(args.router_src) else None
    serve = serve_argv(bed.mocks, workers) + list(serve_args)
    wanted = [("router", serve)] + ([("bare", [sys.executable, str(BARE_APP), "--port", "0"])] if bare else [])
    started = await _start_all(stack, logdir, wanted, cwd={"router": args.router_src})
    bed.router, bed.bare = started[0], (started[1] if bare else None)
    await _ready(bed.router.url, "/ready")
    return bed


async def _start_all(stack: AsyncExitStack, logdir: Path,
                     wanted: list[tuple[str, list[str]]],
                     cwd: dict[str, Path | None] | None = None) -> list[Server]:
    started: dict[str, Server] = {}

    async def one(name: str, argv: list[str]) -> None:
        started[name] = await _started(stack, name, argv, logdir, (cwd or {}).get(name))

    async with trio.open_nursery() as nursery:
        for name, argv in wanted:
            nursery.start_soon(one, name, argv)
    return [started[name] for name, _ in wanted]


async def _started(stack: AsyncExitStack, name: str, argv: list[str], logdir: Path,
                   cwd: Path | None = None) -> Server:
    return _stopped_on_exit(stack, await start_server(name, argv, logdir, cwd=cwd))


def _stopped_on_exit(stack: AsyncExitStack, server: Server) -> Server:
    """``server``, stopped (shielded from cancellation) when ``stack`` closes."""

    async def stop() -> None:
        with trio.CancelScope(shield=True):
            await server.stop()

    stack.push_async_callback(stop)
    return server


# ---------------------------------------------------------------- (a) closed loop


def _per_request(seconds: float, ok: int) -> float | None:
    return seconds * 1000 / ok if ok else None


async def closed_loop(args: argparse.Namespace, name: str, target: Server, http: str,
                      mocks: list[Server], files: Path) -> dict[str, Any]:
    """One closed-loop run at ``target``; CPU of every process around it."""
    spec = RequestSpec(model="mock", max_tokens=args.max_tokens, timeout=30.0)
    prompt = make_prompt(args.seed, 0, args.prompt_tokens)
    before = [target.cpu_seconds(), *(m.cpu_seconds() for m in mocks)]
    run = await run_closed(target.url, http, client=args.client, spec=spec, prompt=prompt,
                           body_file=files / "body.json", concurrency=args.concurrency,
                           duration=args.duration, label=f"{name} {HTTPS[http]}")
    after = [target.cpu_seconds(), *(m.cpu_seconds() for m in mocks)]
    ok = run["ok"]
    return {
        "target": name, "http": http, "concurrency": args.concurrency,
        "duration_s": args.duration, **run,
        "req_s": ok / run["wall_s"] if run["wall_s"] else 0.0,
        "cpu_ms_per_request": _per_request(after[0] - before[0], ok),
        "mock_cpu_ms_per_request": (_per_request(sum(after[1:]) - sum(before[1:]), ok)
                                    if mocks else None),
        "client_cpu_ms_per_request": _per_request(run["client_cpu_s"], ok),
    }


def cpu_ratios(rows: list[dict[str, Any]], over: str = "bare") -> dict[str, float]:
    """Router CPU per request over ``over``'s, per HTTP version."""
    return _ratios(rows, "cpu_ms_per_request", over)


def _ratios(rows: list[dict[str, Any]], key: str, over: str) -> dict[str, float]:
    """The router's ``key`` over ``over``'s, per HTTP version both ran."""
    out: dict[str, float] = {}
    for http in ("1.1", "2"):
        by = {r["target"]: r for r in rows if r["http"] == http}
        a, b = by.get("router"), by.get(over)
        if a and b and a[key] is not None and b[key]:
            out[http] = a[key] / b[key]
    return out


# ---------------------------------------------------------------- (b) open loop


def passes(summary: dict[str, Any], p99_ms: float) -> bool:
    p99 = summary["e2e_ms"]["p99"]
    return summary["counts"]["errors"] == 0 and p99 is not None and p99 < p99_ms


def next_rate(rate: float, ok: bool, best: float | None, worst: float | None) -> float | None:
    """Double until a rate fails, then bisect; None once within 15%."""
    if best is not None and worst is not None and worst / best < 1.15:
        return None
    if ok:
        return rate * 2 if worst is None else (rate + worst) / 2
    return (best + rate) / 2 if best is not None else rate / 2


async def search_max_rate(url: str, label: str, spec: RequestSpec, *, start: float,
                          steps: int, duration: float, p99_ms: float, seed: int,
                          prompt_tokens: int, max_outstanding: int,
                          runs: list[dict[str, Any]],
                          server: Server | None = None, connections: int = 1) -> float | None:
    """The highest rate tried that passes (appending each run's summary to ``runs``,
    with the ``server``'s CPU share when given: see :func:`timed_run`)."""
    best: float | None = None
    worst: float | None = None
    rate: float | None = start
    for _ in range(steps):
        if rate is None:
            break
        rate = float(f"{rate:.3g}")
        config = LoadConfig(rate=rate, duration=duration, seed=seed, prompt_tokens=prompt_tokens,
                            max_outstanding=max_outstanding)
        summary = await timed_run(url, spec, config, label, f"{label} {rate:g} rps", server, connections)
        runs.append(summary)
        ok = passes(summary, p99_ms)
        if ok:
            best = rate if best is None else max(best, rate)
        else:
            worst = rate if worst is None else min(worst, rate)
        rate = next_rate(rate, ok, best, worst)
    return best


async def timed_run(url: str, spec: RequestSpec, config: LoadConfig, label: str, title: str,
                    server: Server | None, connections: int = 1) -> dict[str, Any]:
    """One open-loop run's summary; with ``server``, its CPU seconds over the
    run's wall time (``server_cpu_share``: 1.0 is one core busy throughout)
    and a request (``server_cpu_ms_per_request``).

    Half the highest rate is not half the router's load: a request costs it
    more CPU at the lower rate (the same work, each request waking the
    process alone), so the share at the judged rate says how close to busy
    it ran there (bench/README.md, stop 45)."""
    before = server.cpu_seconds() if server is not None else 0.0
    run = await run_rate(url, "2", spec, config, label=title, lean=True, connections=connections)
    summary = summarize_run(run, label=label)
    if server is not None:
        cpu = server.cpu_seconds() - before
        summary["server_cpu_share"] = cpu / run.wall if run.wall > 0 else None
        summary["server_cpu_ms_per_request"] = _per_request(cpu, summary["counts"]["ok"])
    return summary


def cpu_shares(loop: dict[str, Any]) -> dict[str, float | None]:
    """The router's CPU share at its highest passing rate and, the median over
    the rounds, at the judged rate (None where not measured)."""
    best = loop.get("router_max_rate")
    at_max = [r.get("server_cpu_share") for r in loop["runs"] if r["label"] == "router" and r["rate"] == best]
    judged = [s for r in loop.get("at_half_rounds", []) if (s := r["router"].get("server_cpu_share")) is not None]
    return {"at_max": at_max[0] if at_max else None,
            "at_judged": statistics.median(judged) if judged else None}


async def open_loop(args: argparse.Namespace, bed: Bed, out: dict[str, Any]) -> None:
    assert bed.router is not None
    spec = RequestSpec(model="mock", max_tokens=args.max_tokens, timeout=30.0)
    common = {"start": args.open_start, "steps": args.open_steps, "duration": args.open_duration,
              "p99_ms": args.p99_ms, "seed": args.seed, "prompt_tokens": args.prompt_tokens,
              "max_outstanding": args.max_outstanding, "connections": args.open_connections}
    out.update(p99_limit_ms=args.p99_ms, http="2", connections=args.open_connections, runs=[])
    for name, url, server in (("router", bed.router.url, bed.router), ("direct", bed.mocks[0].url, None)):
        out[f"{name}_max_rate"] = await search_max_rate(url, name, spec, runs=out["runs"],
                                                        server=server, **common)
    tried = [r["rate"] for r in out["runs"] if r["label"] == "router"]
    at_share = None
    if args.added_at_share is not None:
        at_share = rate_at_share(out["runs"], args.added_at_share, out["router_max_rate"])
    half = judged_rate(args.added_at or at_share, out["router_max_rate"], tried)
    out["added_at"] = ("fixed" if args.added_at else f"share {args.added_at_share:g}" if at_share
                       else "half the router's highest rate")
    targets = [("router", bed.router.url), ("direct", bed.mocks[0].url)]
    rounds = []
    for i in range(args.half_rounds):
        # One schedule a round, both targets; which goes first alternates, so
        # that the box's drift between two runs favours neither side.
        config = LoadConfig(rate=half, duration=args.open_duration, seed=args.seed + 1 + i,
                            prompt_tokens=args.prompt_tokens, max_outstanding=args.max_outstanding)
        pair = {}
        for name, url in (targets if i % 2 == 0 else targets[::-1]):
            pair[name] = await timed_run(url, spec, config, name,
                                         f"{name} {half:g} rps (half, round {i + 1}/{args.half_rounds})",
                                         bed.router if name == "router" else None, args.open_connections)
        rounds.append({"rate": half, "router": pair["router"], "direct": pair["direct"],
                       "first": "router" if i % 2 == 0 else "direct",
                       "added": compare(pair["router"], pair["direct"])})
    out["at_half"] = rounds[0]  # the first round, as runs before --half-rounds reported it
    out["at_half_rounds"] = rounds
    out["added_ttft_median_ms"] = added_medians(rounds)
    out["router_cpu_share"] = cpu_shares(out)
    out["client_bound"] = client_bound(out)


def judged_rate(fixed: float | None, router_max: float | None, tried: list[float]) -> float:
    """The rate the added TTFT is judged at: ``fixed`` (``--added-at``) when
    given, else half the router's highest passing rate (half the lowest
    tried when none passed)."""
    if fixed:
        return fixed
    return 0.5 * (router_max or min(tried))


def rate_at_share(runs: list[dict[str, Any]], share: float, router_max: float | None) -> float | None:
    """The rate at which the router's CPU share was ``share``: interpolated
    between the passing router runs around it (rounded to 3 figures), scaled
    down from the lowest when all were busier; None when none passed, or
    all passing runs were below ``share`` (the router never got that busy
    within the p99 limit)."""
    if router_max is None:
        return None
    points = sorted((r["rate"], r["server_cpu_share"]) for r in runs
                    if r["label"] == "router" and r["rate"] <= router_max and r.get("server_cpu_share"))
    if not points:
        return None
    low_rate, low_share = points[0]
    if share <= low_share:
        return float(f"{low_rate * share / low_share:.3g}")
    for (r1, s1), (r2, s2) in itertools.pairwise(points):
        if s1 <= share <= s2:
            return float(f"{r1 + (r2 - r1) * (share - s1) / (s2 - s1) if s2 > s1 else r1:.3g}")
    return None


def added_medians(rounds: list[dict[str, Any]]) -> dict[str, float | None]:
    """The router's added TTFT, p50 and p99, each the median over ``rounds``
    (one run of the router at a high rate differs from the next by more than
    the target: a p99 is judged over several)."""
    out: dict[str, float | None] = {}
    for q in ("p50", "p99"):
        deltas = [r["added"]["ttft_ms"][q]["delta"] for r in rounds]
        known = [d for d in deltas if d is not None]
        out[q] = statistics.median(known) if known else None
    return out


def client_bound(loop: dict[str, Any]) -> str | None:
    """Why the open-loop numbers may be the client's limit, not the servers'
    (the lean Python client costs ~0.35 ms of CPU a streamed request), or None."""
    direct, router = loop.get("direct_max_rate"), loop.get("router_max_rate")
    failed = [r for r in loop["runs"] if r["label"] == "direct" and not passes(r, loop["p99_limit_ms"])]
    lag = max((r["lag_ms"]["p99"] or 0.0 for r in failed), default=0.0)
    if direct is not None and router is not None and direct <= router * 1.1:
        return (f"direct to one mock tops out at {direct:g} req/s, no more than through the "
                f"router: the client (sharing the cores) is the bottleneck")
    if lag > LAG_WARN_MS:
        return f"the client sent p99 {lag:.0f} ms late where direct runs failed"
    return None


# ---------------------------------------------------------------- (c) vllm-router


def find_vllm_router(choice: str) -> str | None:
    if choice == "none":
        return None
    if choice != "auto":
        return choice if Path(choice).exists() else None
    found = shutil.which("vllm-router")
    if found:
        return found
    peers = Path(os.environ.get("PEERS_DIR", "/work/peers"))
    candidates = sorted(peers.glob("*/bin/vllm-router")) if peers.is_dir() else []
    return str(candidates[0]) if candidates else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def vllm_router(args: argparse.Namespace, bed: Bed, logdir: Path, stack: AsyncExitStack,
                      rows: list[dict[str, Any]]) -> dict[str, Any]:
    path = find_vllm_router(args.vllm_router)
    if path is None:
        return {"skipped": "vllm-router is not installed (pip install vllm-router, in a "
                           "virtualenv of its own: see /work/shared/reference/peers.md)"}
    port = _free_port()
    argv = [path, "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
            *(m.url for m in bed.mocks), "--policy", "round_robin", "--log-level", "warning"]
    log = logdir / "vllm-router.log"
    with log.open("wb") as sink:
        process = await trio.lowlevel.open_process(argv, stdout=sink, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL,
                                                   start_new_session=True)
    peer = _stopped_on_exit(stack, Server("vllm-router", process, f"http://127.0.0.1:{port}", log))
    await _ready(peer.url, "/v1/models", patience=60.0)
    for http in args.http:
        rows.append(await closed_loop(args, "vllm-router", peer, http, bed.mocks, logdir))
    return {"path": path, "router_over_vllm_router": cpu_ratios(rows, over="vllm-router"),
            "req_s_ratio": _ratios(rows, "req_s", "vllm-router")}


# ---------------------------------------------------------------- report


def _fmt(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def format_report(doc: dict[str, Any]) -> str:
    cpu = doc["cpu"]
    lines = [f"CPU: {cpu['model']}, {cpu['cores']} cores ({' '.join(cpu['features']) or '-'})",
             f"bed: 2 x headrace mock --tpot-ms {doc['config']['tpot_ms']:g} --max-tokens "
             f"{doc['config']['max_tokens']}; router workers {doc['config']['workers']}", ""]
    rows = doc.get("closed_loop", [])
    if rows:
        lines.append(f"closed loop: {rows[0]['concurrency']} connections, "
                     f"{rows[0]['duration_s']:g} s a run")
        head = (f"{'target':<12} {'http':<5} {'client':<7} {'req/s':>8} {'ok':>7} "
                f"{'CPU ms/req':>10} {'mocks ms/req':>12} {'client ms/req':>13}  errors")
        lines += [head, "-" * len(head)]
        for r in rows:
            errors = ", ".join(f"{k}={v}" for k, v in r["errors"].items()) or "none"
            lines.append(
                f"{r['target']:<12} {HTTPS[r['http']]:<5} {r['client']:<7} {r['req_s']:>8.1f} "
                f"{r['ok']:>7} {_fmt(r['cpu_ms_per_request'], '10.3f'):>10} "
                f"{_fmt(r['mock_cpu_ms_per_request'], '12.3f'):>12} "
                f"{_fmt(r['client_cpu_ms_per_request'], '13.3f'):>13}  {errors}")
        ratios = doc.get("cpu_ratio_router_over_bare", {})
        if ratios:
            lines.append("router CPU per request / bare hypercorn app's: " + ", ".join(
                f"{HTTPS[h]} {v:.2f}x" for h, v in ratios.items()))
        lines.append("")
    lines += _format_open(doc.get("open_loop"))
    peer = doc.get("vllm_router") or {}
    if "skipped" in peer:
        lines.append(f"vllm-router: skipped: {peer['skipped']}")
    elif peer:
        cpu_r = ", ".join(f"{HTTPS[h]} {v:.2f}x" for h, v in peer["router_over_vllm_router"].items())
        req_r = ", ".join(f"{HTTPS[h]} {v:.2f}x" for h, v in peer["req_s_ratio"].items())
        lines.append(f"vllm-router: router CPU per request / vllm-router's: {cpu_r or '-'}; "
                     f"router req/s / vllm-router's: {req_r or '-'}")
    if doc.get("interrupted"):
        lines.append(f"stopped early: {doc['interrupted']}")
    return "\n".join(lines)


def _format_open(loop: dict[str, Any] | None) -> list[str]:
    if not loop or "runs" not in loop:
        return []
    conns = loop.get("connections", 1)
    over = f", {conns} connections" if conns > 1 else ""
    lines = [f"open loop (Poisson, h2c{over}): highest rate with e2e p99 < {loop['p99_limit_ms']:g} ms "
             "and no errors"]
    for name in ("router", "direct"):
        tried = ", ".join(
            f"{r['rate']:g}: {_fmt(r['e2e_ms']['p99'], '.0f')} ms"
            + (f" {r['counts']['errors']} err" if r["counts"]["errors"] else "")
            for r in loop["runs"] if r["label"] == name)
        best = loop.get(f"{name}_max_rate")
        lines.append(f"  {name:<7} {_fmt(best, 'g') if best else 'none':>8} req/s   "
                     f"(tried rps: e2e p99  {tried})")
    rounds = loop.get("at_half_rounds") or ([loop["at_half"]] if loop.get("at_half") else [])
    if rounds:
        median = loop.get("added_ttft_median_ms") or added_medians(rounds)
        each = ", ".join(f"{_fmt(r['added']['ttft_ms']['p50']['delta'], '+.2f')} / "
                         f"{_fmt(r['added']['ttft_ms']['p99']['delta'], '+.2f')}" for r in rounds)
        how = str(loop.get("added_at", ""))
        at = (" (fixed: --added-at)" if how == "fixed" else
              f" (the router at CPU {how} in the search: --added-at-share)" if how.startswith("share") else "")
        lines.append(f"  router added TTFT at {rounds[0]['rate']:g} req/s{at}, median of {len(rounds)} "
                     f"round(s): p50 {_fmt(median['p50'], '+.2f')} ms, p99 {_fmt(median['p99'], '+.2f')} ms "
                     f"(each round p50 / p99: {each})")
    share = loop.get("router_cpu_share") or {}
    if share.get("at_judged") is not None:
        lines.append(f"  router CPU share (1.0: a core busy): {_fmt(share.get('at_max'), '.2f')} at its "
                     f"highest rate, {_fmt(share['at_judged'], '.2f')} at {rounds[0]['rate']:g} req/s")
    if loop.get("client_bound"):
        lines.append(f"  warning: {loop['client_bound']}")
    return [*lines, ""]


def _plot(doc: dict[str, Any], path: Path) -> Path:
    from bench.plot import plot_rate_p99

    return plot_rate_p99(doc["open_loop"]["runs"], path, limit_ms=doc["open_loop"]["p99_limit_ms"])


# ---------------------------------------------------------------- main


async def run(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    """Every phase, each filling ``doc`` as it finishes."""
    with tempfile.TemporaryDirectory(prefix="headrace-bench-router-") as tmp:
        logdir = Path(tmp)
        async with AsyncExitStack() as stack:
            print("starting 2 mocks, the router and the bare app...", file=sys.stderr)
            bed = await start_bed(args, logdir, stack, serve_args=shlex.split(args.serve_args))
            assert bed.router is not None and bed.bare is not None
            doc["servers"] = {s.name: s.url for s in (*bed.mocks, bed.router, bed.bare)}
            rows: list[dict[str, Any]] = doc.setdefault("closed_loop", [])
            for http in args.http:
                rows.append(await closed_loop(args, "router", bed.router, http, bed.mocks, logdir))
                rows.append(await closed_loop(args, "bare", bed.bare, http, [], logdir))
            doc["cpu_ratio_router_over_bare"] = cpu_ratios(rows)
            if not args.no_open_loop:
                await open_loop(args, bed, doc.setdefault("open_loop", {}))
            doc["vllm_router"] = await vllm_router(args, bed, logdir, stack, rows)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.report:
        print(format_report(msgspec.json.decode(Path(args.report).read_bytes())))
        return 0
    try:
        _check(args)
    except ClientError as exc:
        print(f"headrace bench router: error: {exc.message}", file=sys.stderr)
        return 2
    doc: dict[str, Any] = {
        "kind": "router", "cpu": cpu_info(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "config": {"concurrency": args.concurrency, "duration_s": args.duration,
                   "http": args.http, "client": args.client, "open_duration_s": args.open_duration,
                   "p99_limit_ms": args.p99_ms, "tpot_ms": args.tpot_ms,
                   "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens,
                   "workers": args.workers, "router_src": _source(args.router_src),
                   "serve_args": args.serve_args},
    }
    return run_reported(run, args, doc, _finish, name="headrace bench router")


def _finish(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    print(format_report(doc))
    finish(args, "router", doc, _plot, plot=bool(doc.get("open_loop", {}).get("runs")))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

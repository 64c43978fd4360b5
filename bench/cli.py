"""``headrace bench``: open-loop load against a router or any OpenAI server.

Subcommands: ``headrace bench engine`` (closed-loop throughput at fixed
concurrency), ``headrace bench router`` (the router's CPU per request and
rate limits on a bed of mocks it starts), ``headrace bench roofline`` (memory-bandwidth decode floor),
``headrace bench kernels`` (the engine's linear kernels by row count),
``headrace bench chaos`` (stream migration while backends are killed at random),
``headrace bench ab`` (two router builds under the same load at the same time),
``headrace bench overload`` (admission, priority and tenant fairness at twice the fleet's capacity),
``headrace bench budget`` (the CPU per request an added-TTFT target leaves the router, against a null relay),
``headrace bench instructions`` (the router's instructions per request, counted by valgrind: no drift),
``headrace bench baseline`` (Hugging Face transformers generate()). Without a
subcommand it runs the load generator; see ``headrace bench --help``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from backends.errors import ClientError, HeadraceError
from bench.client import RequestResult, RequestSpec, leaf
from bench.connect import FALLBACK_MODEL, HttpVersion, Target, discover
from bench.loadgen import LoadConfig, RunResult, run_rate
from bench.report import compare, default_path, format_compare, format_table, summarize_run
from bench.report import write_json as write_report

__all__ = ["Partial", "add_common_arguments", "describe_stop", "is_interrupt", "main", "pick_model", "run_load",
           "run_reported"]

RESULTS_DIR = "bench/results"


def add_common_arguments(p: argparse.ArgumentParser, *, target: bool = True) -> None:
    """Options shared by the load and engine benchmarks (``target=False``:
    the benchmark starts its own servers)."""
    if target:
        p.add_argument("--target", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--prompt-tokens", type=int, default=32, help="approximate prompt length")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--http", choices=("auto", "2", "1.1"), default="auto",
                   help="auto: h2 (prior knowledge on http://, ALPN on https://), "
                        "falling back to HTTP/1.1")
    p.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    p.add_argument("--seed", type=int, default=0, help="seeds arrivals and prompts")
    add_output_args(p)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="headrace bench",
        description="Open-loop Poisson load generator. Other modes: "
                    "'headrace bench engine|router|spec|roofline|baseline|kernels|chaos|ab|budget|instructions --help'.")
    add_common_arguments(p)
    p.add_argument("--rps", type=float, nargs="+", default=[5.0],
                   help="offered load(s) in requests/s; several give a load curve")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="SSE streaming (default on; needed for TTFT and ITL)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask for exactly max_tokens (vLLM/headrace extension)")
    p.add_argument("--max-outstanding", type=int, default=512,
                   help="arrivals beyond this many in flight are dropped (counted as errors)")
    p.add_argument("--client", choices=("httpx", "lean"), default="httpx",
                   help="lean: the router's own HTTP/2 client (h2 targets only; ~4x less client "
                        "CPU a request, so a two-core box measures the server, not the client)")
    p.add_argument("--compare-direct", metavar="URL",
                   help="also run the same schedule straight at this backend")
    return p


def pick_model(requested: str | None, target: Target) -> str:
    if requested:
        return requested
    if target.models:
        return target.models[0]
    print(f"headrace bench: {target.url} lists no models; using {FALLBACK_MODEL!r}",
          file=sys.stderr)
    return FALLBACK_MODEL


def _check(args: argparse.Namespace) -> None:
    if args.prompt_tokens < 1 or args.max_tokens < 1:
        raise ClientError("--prompt-tokens and --max-tokens must be >= 1")
    if args.timeout <= 0:
        raise ClientError("--timeout must be > 0")


def _spec(args: argparse.Namespace, model: str) -> RequestSpec:
    return RequestSpec(model=model, endpoint=args.endpoint, max_tokens=args.max_tokens,
                       stream=args.stream, temperature=args.temperature,
                       ignore_eos=args.ignore_eos, timeout=args.timeout)


class Partial:
    """A load report as it grows, so that ``headrace bench`` writes what it has
    even when the run ends early (Ctrl-C, a crash in the middle of a rate)."""

    def __init__(self) -> None:
        self.document: dict[str, Any] = {}
        self._current: tuple[str, LoadConfig, list[RequestResult], float] | None = None

    def begin(self, label: str, config: LoadConfig) -> list[RequestResult]:
        """A rate starts: the list its results will be appended to."""
        results: list[RequestResult] = []
        self._current = (label, config, results, time.monotonic())
        return results

    def end(self, run: RunResult, label: str) -> dict[str, Any]:
        self._current = None
        summary = summarize_run(run, label=label)
        self.document["runs"].append(summary)
        return summary

    def salvage(self, exc: BaseException) -> dict[str, Any] | None:
        """The report of an interrupted run (None when no rate had started):
        the finished rates, the one in progress marked ``partial``, and why."""
        if not self.document.get("runs") and self._current is None:
            return None
        if self._current is not None:
            label, config, results, started = self._current
            run = RunResult(config=config, wall=time.monotonic() - started,
                            results=sorted(results, key=lambda r: r.index))
            self.end(run, label)["partial"] = True
        self.document["interrupted"] = describe_stop(exc)
        return self.document


async def run_load(args: argparse.Namespace, partial: Partial | None = None) -> dict[str, Any]:
    """Every rate at the target (and at ``--compare-direct``); the JSON document,
    built in ``partial`` as the rates finish."""
    _check(args)
    partial = partial if partial is not None else Partial()
    http: HttpVersion = args.http
    target = await discover(args.target, http, args.api_key)
    direct = await discover(args.compare_direct, http, args.api_key) if args.compare_direct else None
    spec = _spec(args, pick_model(args.model, target))
    comparisons: list[dict[str, Any]] = []
    partial.document.update({
        "kind": "load",
        "target": {"url": target.url, "http": target.http_version},
        "direct": {"url": direct.url, "http": direct.http_version} if direct else None,
        "request": {"model": spec.model, "endpoint": spec.endpoint, "stream": spec.stream,
                    "max_tokens": spec.max_tokens, "prompt_tokens": args.prompt_tokens,
                    "ignore_eos": spec.ignore_eos, "max_outstanding": args.max_outstanding},
        "runs": [],
        "router_added_latency": comparisons,
    })
    for rate in args.rps:
        config = LoadConfig(rate=rate, duration=args.duration, seed=args.seed,
                            prompt_tokens=args.prompt_tokens, max_outstanding=args.max_outstanding)
        label = "routed" if direct else "target"
        run = await run_rate(target.url, target.http, spec, config, api_key=args.api_key,
                             label=f"{label} {rate:g} rps", results=partial.begin(label, config),
                             lean=args.client == "lean")
        routed = partial.end(run, label)
        if direct is not None:
            run = await run_rate(direct.url, direct.http, spec, config, api_key=args.api_key,
                                 label=f"direct {rate:g} rps",
                                 results=partial.begin("direct", config),
                                 lean=args.client == "lean")
            comparisons.append(compare(routed, partial.end(run, "direct")))
    return partial.document


def add_output_args(p: argparse.ArgumentParser) -> None:
    """``--json``, ``--plot``, ``--no-plot`` and ``--results-dir``, as :func:`finish` reads them."""
    p.add_argument("--json", dest="json_path", help="JSON report path")
    p.add_argument("--plot", dest="plot_path", help="PNG plot path")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--results-dir", default=RESULTS_DIR,
                   help="where default JSON/PNG paths go (default: %(default)s)")


def finish(args: argparse.Namespace, kind: str, document: dict[str, Any], plotter: Any, *,
           plot: bool = True) -> None:
    """Write the JSON report and (with ``plot``, unless ``--no-plot``) the PNG; say where."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    json_path = args.json_path or default_path(args.results_dir, kind, stamp, "json")
    print(f"wrote {write_report(json_path, document)}", file=sys.stderr)
    if plot and not args.no_plot:
        png = args.plot_path or default_path(args.results_dir, kind, stamp, "png")
        print(f"wrote {plotter(document, Path(png))}", file=sys.stderr)


def _plot_load(document: dict[str, Any], path: Path) -> Path:
    from bench.plot import plot_load

    return plot_load(document["runs"], path)


LAG_WARN_MS = 20.0


def warn_if_behind(runs: list[dict[str, Any]]) -> None:
    """Say so when the client itself sent late: its own delay is in the latencies."""
    for run in runs:
        lag = run["lag_ms"]["p99"]
        if lag is not None and lag > LAG_WARN_MS:
            print(f"headrace bench: warning: {run['label']} at {run['rate']:g} rps sent p99 "
                  f"{lag:.0f} ms late; the client is a bottleneck (fewer rps or more cores)",
                  file=sys.stderr)


def _load_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    partial = Partial()
    try:
        document = trio.run(run_load, args, partial)
    except BaseException as exc:
        salvaged = partial.salvage(exc)
        if salvaged is None:
            raise
        _print_load(salvaged)
        print(f"headrace bench: stopped early ({salvaged['interrupted']}); "
              "the report holds what finished", file=sys.stderr)
        finish(args, "load", salvaged, _plot_load)
        if is_interrupt(exc):
            return 130
        raise
    _print_load(document)
    finish(args, "load", document, _plot_load)
    return 0


def describe_stop(exc: BaseException) -> str:
    """Why a run stopped early, for the report's ``interrupted``: the
    innermost error, or, when a group holds several (two requests hit by one
    Ctrl-C), the first of them and how many there were."""
    leaves = _leaves(exc)
    inner = leaf(exc) if len(leaves) == 1 else leaves[0]
    more = f" (and {len(leaves) - 1} more)" if len(leaves) > 1 else ""
    return f"{type(inner).__name__}: {inner}{more}"[:300]


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [e for sub in exc.exceptions for e in _leaves(sub)]
    return [exc]


def is_interrupt(exc: BaseException) -> bool:
    """Ctrl-C, possibly inside trio's exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        return all(is_interrupt(e) for e in exc.exceptions)
    return isinstance(exc, KeyboardInterrupt)


def run_reported(run: Callable[[argparse.Namespace, dict[str, Any]], Awaitable[None]], args: argparse.Namespace,
                 doc: dict[str, Any], finish: Callable[[argparse.Namespace, dict[str, Any]], None],
                 name: str | None = None) -> int:
    """``trio.run(run, args, doc)``, then ``finish(args, doc)`` (the report)
    whatever stopped it, with ``interrupted`` set when something did: 130
    after Ctrl-C; 1 for a :class:`HeadraceError` when ``name`` is given (the
    message printed under it); anything else re-raised. 0 when it ran through."""
    try:
        trio.run(run, args, doc)
    except BaseException as exc:  # the report is written whatever happened
        doc["interrupted"] = describe_stop(exc)
        finish(args, doc)
        if is_interrupt(exc):
            return 130
        if name is not None and isinstance(inner := leaf(exc), HeadraceError):
            print(f"{name}: error: {inner.message}", file=sys.stderr)
            return 1
        raise
    finish(args, doc)
    return 0


def _print_load(document: dict[str, Any]) -> None:
    warn_if_behind(document["runs"])
    print(format_table(document["runs"]))
    if document["router_added_latency"]:
        print()
        print(format_compare(document["router_added_latency"]))


def _sub(name: str) -> Any:
    if name == "engine":
        from bench import engine_bench
        return engine_bench.main
    if name == "spec":
        from bench import spec_bench
        return spec_bench.main
    if name == "roofline":
        from bench import roofline
        return roofline.main
    if name == "kernels":
        from bench import kernels
        return kernels.main
    if name == "router":
        from bench import router_bench
        return router_bench.main
    if name == "policies":
        from bench import policy_bench
        return policy_bench.main
    if name == "cache":
        from bench import cache_bench
        return cache_bench.main
    if name == "chaos":
        from bench import chaos_bench
        return chaos_bench.main
    if name == "ab":
        from bench import ab
        return ab.main
    if name == "overload":
        from bench import overload_bench
        return overload_bench.main
    if name == "budget":
        from bench import relay_budget
        return relay_budget.main
    if name == "instructions":
        from bench import instructions
        return instructions.main
    from bench import transformers_baseline
    return transformers_baseline.main


def main(argv: list[str]) -> int:
    try:
        if argv and argv[0] in {"engine", "spec", "roofline", "baseline", "kernels", "router", "policies",
                                "cache", "chaos", "overload", "ab", "budget", "instructions"}:
            result: int = _sub(argv[0])(argv[1:])
            return result
        return _load_main(argv)
    except HeadraceError as exc:
        print(f"headrace bench: error: {exc.message}", file=sys.stderr)
        return 2 if isinstance(exc, ClientError) else 1

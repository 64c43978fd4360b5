"""``headrace bench engine``: throughput of one server at fixed concurrency.

Closed loop on purpose (unlike the load generator): ``c`` streams each send a
request, wait for its end, send the next, for ``--duration`` seconds per
level. That holds the batch the server sees at about ``c`` and so measures
what batching buys: aggregate output tokens/s, per-stream decode tokens/s
(1 / time per output token) and TTFT at each concurrency. Any OpenAI-compatible
server works; ``--ignore-eos`` (on by default) makes every request generate
exactly ``--max-tokens`` so levels are comparable. ``--transformers-baseline``
also runs :mod:`bench.transformers_baseline` in the same process and quotes
ratios against it (start the server with the same model and dtype);
``--roofline DTYPE`` measures the memory bandwidth here too (:mod:`bench.roofline`)
and quotes the single-stream decode rate as a fraction of the decode ceiling for
weights read at that dtype (``bf16-packed`` for ``headrace engine`` in bfloat16).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import trio

from backends.errors import ClientError, HeadraceError
from bench.cli import add_common_arguments, finish, pick_model
from bench.client import RequestResult, RequestSpec, send_request
from bench.connect import discover, make_client
from bench.loadgen import Sender
from bench.procs import cpu_info
from bench.progress import ProgressBar, run_progress
from bench.schedule import WORKLOADS, workload_prompt
from bench.stats import summarize

__all__ = ["format_levels", "main", "roofline_fraction", "run_closed_loop", "summarize_level"]


class _Loop:
    def __init__(self) -> None:
        self.next_index = 0
        self.results: list[RequestResult] = []
        self.tokens = 0

    def take(self) -> int:
        self.next_index += 1
        return self.next_index - 1


async def _stream_worker(send: Sender, loop: _Loop, deadline: float, run_start: float,
                         prompt: Callable[[int], str]) -> None:
    while True:  # at least one request per stream, then until the deadline
        index = loop.take()
        result = await send(index, prompt(index), trio.current_time(), run_start)
        loop.results.append(result)
        loop.tokens += result.output_tokens if result.ok else 0
        if trio.current_time() >= deadline:
            return


async def run_closed_loop(concurrency: int, duration: float, send: Sender, *, seed: int = 0,
                          prompt_tokens: int = 32, workload: str = "random",
                          progress: ProgressBar | None = None) -> tuple[float, list[RequestResult]]:
    """``concurrency`` back-to-back streams for ``duration`` s: (wall s, results)."""

    def prompt(index: int) -> str:
        return workload_prompt(workload, seed, index, prompt_tokens)

    if concurrency < 1 or duration <= 0:
        raise ClientError("concurrency must be >= 1 and duration > 0")
    loop = _Loop()
    start = trio.current_time()

    def status(now: float) -> tuple[float, str]:
        return (min(1.0, (now - start) / duration),
                f"{now - start:5.1f}s done {len(loop.results)} tokens {loop.tokens}")

    async with trio.open_nursery() as outer:
        if progress is not None:
            outer.start_soon(run_progress, progress, status)
        async with trio.open_nursery() as streams:
            for _ in range(concurrency):
                streams.start_soon(_stream_worker, send, loop, start + duration, start, prompt)
        outer.cancel_scope.cancel()
    wall = trio.current_time() - start
    if progress is not None:
        progress.close(f"{wall:5.1f}s done {len(loop.results)} tokens {loop.tokens}")
    return wall, sorted(loop.results, key=lambda r: r.index)


def summarize_level(concurrency: int, wall: float, results: list[RequestResult]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)

    def ms(values: list[float]) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.to_builtins(summarize(values, scale=1000.0))
        return out

    return {
        "concurrency": concurrency, "wall_s": wall, "requests": len(results), "ok": len(ok),
        "errors": dict(sorted(Counter(r.error for r in results if r.error).items())),
        "output_tokens": tokens, "aggregate_tok_s": tokens / max(wall, 1e-9),
        "per_stream_tok_s": msgspec.to_builtins(
            summarize([1.0 / t for r in ok if (t := r.tpot)])),
        "ttft_ms": ms([r.ttft for r in ok if r.ttft is not None]),
        "e2e_ms": ms([r.e2e for r in ok if r.e2e is not None]),
    }


def format_levels(levels: list[dict[str, Any]]) -> str:
    head = (f"{'conc':>5} {'req':>5} {'err':>4} {'agg tok/s':>10} {'stream p50':>11} "
            f"{'stream min':>10} {'ttft p50':>9} {'ttft p99':>9}")
    lines = [head, "-" * len(head)]
    for lv in levels:
        ps, tt = lv["per_stream_tok_s"], lv["ttft_ms"]
        lines.append(
            f"{lv['concurrency']:>5} {lv['requests']:>5} {lv['requests'] - lv['ok']:>4} "
            f"{lv['aggregate_tok_s']:>10.1f} {ps['p50'] or 0:>11.1f} "
            f"{ps['min'] or 0:>10.1f} {tt['p50'] or 0:>9.1f} {tt['p99'] or 0:>9.1f}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="headrace bench engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p)
    p.set_defaults(max_tokens=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--duration", type=float, default=20.0, help="seconds per concurrency level")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--warmup", type=int, default=1, help="untimed requests before the levels")
    p.add_argument("--transformers-baseline", action="store_true",
                   help="also time transformers generate() here and quote ratios")
    p.add_argument("--baseline-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--workload", choices=WORKLOADS, default="random",
                   help="prompts: random words, tasks that repeat their input, or open chat")
    p.add_argument("--roofline", choices=("fp32", "bf16", "bf16-packed"),
                   help="also measure memory bandwidth here and quote the single-stream "
                        "decode rate (c=1) as a fraction of the decode ceiling for the "
                        "model's weights at this dtype (what the server reads per step)")
    p.add_argument("--roofline-gguf", type=Path, default=None,
                   help="model file for --roofline (default: the packaged SmolLM2)")
    p.add_argument("--bandwidth-mib", type=int, default=512,
                   help="size of the tensor --roofline copies to measure bandwidth")
    p.add_argument("--server", default=None,
                   help="the server's command line, recorded in the JSON for the tables "
                        "(bench/tables.py), e.g. 'headrace engine --dtype bfloat16'")
    return p


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    target = await discover(args.target, args.http, args.api_key)
    spec = RequestSpec(model=pick_model(args.model, target), endpoint=args.endpoint,
                       max_tokens=args.max_tokens, stream=True, temperature=args.temperature,
                       ignore_eos=args.ignore_eos, timeout=args.timeout)
    levels = []
    async with make_client(target.url, target.http, max_connections=max(args.concurrency),
                           api_key=args.api_key, timeout=args.timeout) as client:
        async def send(index: int, prompt: str, planned: float, run_start: float) -> RequestResult:
            return await send_request(client, spec, prompt, index=index, start=planned,
                                      run_start=run_start)

        for i in range(args.warmup):
            warm = await send(-1 - i, workload_prompt(args.workload, args.seed, -1 - i, args.prompt_tokens),
                              trio.current_time(), trio.current_time())
            if not warm.ok:
                raise ClientError(f"warm-up request failed: {warm.error}: {warm.detail}")
        for c in args.concurrency:
            wall, results = await run_closed_loop(
                c, args.duration, send, seed=args.seed, prompt_tokens=args.prompt_tokens,
                workload=args.workload, progress=ProgressBar(f"engine c={c}"))
            levels.append(summarize_level(c, wall, results))
    return {"kind": "engine", "target": {"url": target.url, "http": target.http_version},
            "request": {"model": spec.model, "endpoint": spec.endpoint,
                        "max_tokens": spec.max_tokens, "prompt_tokens": args.prompt_tokens,
                        "workload": args.workload,
                        "ignore_eos": spec.ignore_eos},
            "levels": levels}


def baseline_ratios(levels: list[dict[str, Any]], baseline: dict[str, Any]) -> list[dict[str, Any]]:
    """Engine aggregate tok/s at each concurrency over two transformers yardsticks:

    - ``sequential``: a server that runs ``generate()`` for one request at a time
      delivers its batch-1 tok/s whatever the concurrency;
    - ``batched``: ``generate()`` on a static batch as large as the concurrency (an
      upper bound for a batching server built on it), where that batch was measured.
    """
    by_batch = {r["batch"]: r["tok_s"] for r in baseline["results"]}
    ratios = []
    for lv in levels:
        c, tok_s = lv["concurrency"], lv["aggregate_tok_s"]
        row: dict[str, Any] = {"concurrency": c, "engine_tok_s": tok_s}
        if 1 in by_batch:
            row["sequential_tok_s"] = by_batch[1]
            row["vs_sequential"] = tok_s / by_batch[1]
        if c in by_batch:
            row["batched_tok_s"] = by_batch[c]
            row["vs_batched"] = tok_s / by_batch[c]
        if len(row) > 2:
            ratios.append(row)
    return ratios


def roofline_fraction(levels: list[dict[str, Any]], ceiling: dict[str, Any]) -> dict[str, Any]:
    """The single-stream decode rate (per-stream p50 at concurrency 1: one token per
    decode step, the rate the memory floor bounds) against a roofline result of
    :func:`bench.roofline.measure_ceiling`."""
    single = next((lv for lv in levels if lv["concurrency"] == 1), None)
    rate = single["per_stream_tok_s"]["p50"] if single else None
    out = dict(ceiling)
    out["measured_tok_s"] = rate
    out["achieved_fraction"] = rate / ceiling["ceiling_tok_s"] if rate else None
    if not rate:
        out["note"] = "no concurrency-1 level to compare"
    return out


def format_ratios(ratios: list[dict[str, Any]]) -> str:
    lines = [f"{'conc':>5} {'engine tok/s':>13} {'vs transformers 1-at-a-time':>28} "
             f"{'vs transformers batch=conc':>27}"]
    for r in ratios:
        seq = (f"{r['vs_sequential']:.2f}x ({r['sequential_tok_s']:.1f})"
               if "vs_sequential" in r else "-")
        bat = f"{r['vs_batched']:.2f}x ({r['batched_tok_s']:.1f})" if "vs_batched" in r else "-"
        lines.append(f"{r['concurrency']:>5} {r['engine_tok_s']:>13.1f} {seq:>28} {bat:>27}")
    return "\n".join(lines)


def _plot(document: dict[str, Any], path: Path) -> Path:
    from bench.plot import plot_engine

    return plot_engine(document["levels"], path)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        return _main(args, argv)
    except HeadraceError as exc:
        print(f"headrace bench engine: error: {exc.message}", file=sys.stderr)
        return 2 if isinstance(exc, ClientError) else 1


def _main(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    if any(c < 1 for c in args.concurrency) or args.duration <= 0:
        raise ClientError("--concurrency values must be >= 1 and --duration > 0")
    document = trio.run(_run, args)
    # what bench/tables.py quotes beside the numbers: the machine and the commands
    document["cpu"] = {k: v for k, v in cpu_info().items() if k != "flags"}
    document["command"] = shlex.join(["headrace", "bench", "engine", *(argv or [])])
    document["server"] = args.server
    print(format_levels(document["levels"]))
    if args.transformers_baseline:
        from bench.transformers_baseline import format_results, run_baseline

        batches = tuple(sorted({c for c in args.concurrency if c in (1, 16)} or {1}))
        baseline = run_baseline(dtype=args.baseline_dtype, batches=batches,
                                max_new_tokens=args.max_tokens, prompt_tokens=args.prompt_tokens)
        document["transformers_baseline"] = baseline
        document["ratios"] = baseline_ratios(document["levels"], baseline)
        print(format_results(baseline))
        print(format_ratios(document["ratios"]))
    if args.roofline:
        from bench import roofline

        measured = roofline.measure_ceiling(args.roofline, gguf=args.roofline_gguf,
                                            size_mib=args.bandwidth_mib)
        document["roofline"] = roofline_fraction(document["levels"], measured)
        print(roofline.format_report(document["roofline"]))
    finish(args, "engine", document, _plot)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

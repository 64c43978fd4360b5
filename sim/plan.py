"""``headrace plan``: how many replicas a model needs for a target p99.

    headrace plan --rps 40 --p99-ms 12000 --prompt-tokens 512 --output-tokens 256 --service-time 2.0 --concurrency 8
    headrace plan --rps 40 --p99-ms 12000 --prompt-tokens 512 --output-tokens 256 --measure http://engine:8200

The service rate per replica is measured (``--measure URL``: closed-loop
clients at ``--concurrency`` through the benchmark client,
bench/service_rate.py) or given (``--service-rate``, ``--service-time``, or
per-stream ``--prefill-tps`` and ``--decode-tps`` with the prompt and output
lengths). The model is M/M/c (policies/erlang.py, the same code the router's
admission and ``headrace_desired_replicas`` use)::

    a replica = K servers (its concurrent streams), each at μ = 1 / service time
    n replicas: c = n K servers, λ = --rps, a = λ / μ, rho = a / c
    P(T > t) = (1 - C) e^{-μt} + C P(Exp(cμ - λ) + Exp(μ) > t),   C = Erlang C(c, a)
    replicas needed = the fewest n with the p99 of T at most --p99-ms

Prints one row per replica count and writes a plot of p99 against replicas
(``--plot``; bench/plot.py's style: matplotlib's Figure, no pyplot).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import msgspec

from policies.erlang import erlang_c, mean_wait, response_quantile, servers_needed

__all__ = ["Plan", "Row", "main", "plan", "plot_plan"]

ASSUMPTIONS = """\
model assumptions (M/M/c, Erlang C):
  arrivals are Poisson at --rps; a replica serves --concurrency streams at once, each
  taking an exponentially distributed time of mean S (one server per stream), whatever
  how many of its streams are busy; one FIFO queue in front of all replicas (the router's
  admission queue), unbounded, nobody gives up or is shed; every replica equal.
  The p99 is of the response time T = wait + service (arrival to last token).
  Real generation times vary less than exponential ones, so the p99 is on the safe
  side for fixed prompt and output lengths (--service fixed: the wait's p99 plus the
  mean service time); per-stream speed that falls as a replica fills is what
  --measure at the planned --concurrency captures."""


class Row(msgspec.Struct, frozen=True, kw_only=True):
    replicas: int
    servers: int
    utilisation: float
    p_wait: float  # Erlang C
    mean_wait: float  # seconds
    p99: float  # seconds (inf: unstable)
    meets: bool


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    rps: float
    p99_target: float  # seconds
    prompt_tokens: int
    output_tokens: int
    concurrency: int
    service_time: float  # seconds per request at that concurrency
    service_distribution: str  # "exponential" (M/M/c) or "fixed" (the M/M/c wait plus a constant)
    service_rate: float  # completions per second per replica
    source: str  # where the service rate came from
    replicas: int | None  # None: no count meets the target
    utilisation: float | None  # at ``replicas``
    rows: list[Row]


def plan(*, rps: float, p99: float, concurrency: int, service_time: float, prompt_tokens: int = 0,
         output_tokens: int = 0, source: str = "given", fixed: bool = False, extra_rows: int = 3) -> Plan:  # fmt: skip
    """The M/M/c plan: the replicas needed and a row per count around it."""
    mu = 1.0 / service_time
    needed = servers_needed(p99, rps, mu, per_replica=concurrency, fixed=fixed)
    first = max(1, math.floor(rps / (mu * concurrency)) + 1)
    last = max(first, needed or first) + extra_rows
    rows = []
    for n in range(max(1, first - 1), last + 1):
        c = n * concurrency
        q = response_quantile(0.99, c, rps, mu, fixed=fixed)
        rows.append(Row(replicas=n, servers=c, utilisation=rps / (mu * c), p_wait=erlang_c(c, rps / mu),
                        mean_wait=mean_wait(c, rps, mu), p99=q, meets=q <= p99))  # fmt: skip
    util = rps / (mu * needed * concurrency) if needed else None
    return Plan(rps=rps, p99_target=p99, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                concurrency=concurrency, service_time=service_time,
                service_distribution="fixed" if fixed else "exponential", service_rate=concurrency * mu, source=source,
                replicas=needed, utilisation=util, rows=rows)  # fmt: skip


def format_plan(p: Plan) -> str:
    lines = [
        f"target p99 {p.p99_target * 1000:.0f} ms at {p.rps:g} req/s; prompt {p.prompt_tokens} / output {p.output_tokens} tokens",
        f"service: {p.service_time * 1000:.0f} ms a request at {p.concurrency} streams per replica = "
        f"{p.service_rate:.3g} req/s per replica ({p.source}); service time {p.service_distribution}",
        "",
        f"{'replicas':>8} {'streams':>7} {'util':>6} {'P(wait)':>8} {'mean wait ms':>12} {'p99 ms':>10}  meets",
    ]
    for r in p.rows:
        p99 = "inf" if math.isinf(r.p99) else f"{r.p99 * 1000:.0f}"
        wait = "inf" if math.isinf(r.mean_wait) else f"{r.mean_wait * 1000:.1f}"
        util = f"{r.utilisation:.1%}" if r.utilisation < 1 else ">=100%"
        lines.append(f"{r.replicas:>8} {r.servers:>7} {util:>6} {r.p_wait:>8.3f} {wait:>12} {p99:>10}  {'yes' if r.meets else 'no'}")
    lines.append("")
    if p.replicas is None:
        floor = (1.0 if p.service_distribution == "fixed" else -math.log(0.01)) * p.service_time * 1000
        lines.append(f"no replica count meets the target: the service time alone has a p99 of {floor:.0f} ms "
                     "in this model; cut the service time (fewer streams per replica, shorter outputs)")  # fmt: skip
    else:
        lines.append(f"replicas needed: {p.replicas} (utilisation {p.utilisation:.1%})")
    return "\n".join(lines)


def plot_plan(p: Plan, path: str | Path) -> Path:
    """p99 (ms) against replicas, with the target as a line."""
    from bench.plot import _figure, _save

    fig, axes = _figure(1, f"p99 against replicas at {p.rps:g} req/s (M/M/c, {p.concurrency} streams each)")
    ax = axes[0]
    pts = [(r.replicas, r.p99 * 1000) for r in p.rows if not math.isinf(r.p99)]
    if pts:
        xs, ys = zip(*pts, strict=True)
        ax.plot(xs, ys, "-o", label="modelled p99")
    ax.axhline(p.p99_target * 1000, color="C3", linestyle="--", label="target")
    if p.replicas is not None:
        ax.axvline(p.replicas, color="C2", linestyle=":", label=f"needed: {p.replicas}")
    ax.set_xlabel("replicas")
    ax.set_ylabel("p99 response time (ms)")
    ax.set_yscale("log")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, path)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="headrace plan",
        description="Replicas needed for a target p99, by M/M/c (Erlang C) on a measured or given service rate per replica.",
        epilog=ASSUMPTIONS, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--rps", type=float, required=True, help="arrival rate to plan for, requests per second")
    p.add_argument("--p99-ms", type=float, required=True, help="target p99 of a request's latency (arrival to last token), ms")
    p.add_argument("--prompt-tokens", type=int, required=True)
    p.add_argument("--output-tokens", type=int, required=True)
    p.add_argument("--concurrency", type=int, default=8, help="streams a replica serves at once (its slots; default 8)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--measure", metavar="URL", help="measure a live backend's service rate first (bench/service_rate.py)")
    src.add_argument("--service-rate", type=float, help="completions per second one replica gives at --concurrency")
    src.add_argument("--service-time", type=float, help="seconds one request takes at --concurrency")
    src.add_argument("--decode-tps", type=float, help="per-stream decode tokens/s at --concurrency (with --prefill-tps)")
    p.add_argument("--prefill-tps", type=float, help="per-stream prefill tokens/s (default: prefill is free)")
    p.add_argument("--service", choices=["exponential", "fixed"], default="exponential",
                   help="the service time's law in the response time: exponential (M/M/c, whose p99 is 4.6x "
                        "the mean) or fixed (the M/M/c wait plus exactly the mean: closer for fixed prompt "
                        "and output lengths)")  # fmt: skip
    p.add_argument("--duration", type=float, default=20.0, help="--measure: seconds of closed-loop load")
    p.add_argument("--model", help="--measure: model name (default: the first the backend lists)")
    p.add_argument("--api-key", help="--measure: bearer key")
    p.add_argument("--plot", default="plan.png", help="PNG of p99 against replicas (default plan.png; '' for none)")
    p.add_argument("--json", help="write the plan as JSON")
    return p


class _InputError(Exception):
    pass


def _service(args: argparse.Namespace) -> tuple[float, str]:
    """(seconds per request at --concurrency, where it came from)."""
    if args.service_rate is not None:
        if args.service_rate <= 0:
            raise _InputError("--service-rate must be > 0")
        return args.concurrency / args.service_rate, f"given: {args.service_rate:g} req/s per replica"
    if args.service_time is not None:
        if args.service_time <= 0:
            raise _InputError("--service-time must be > 0")
        return args.service_time, "given"
    if args.decode_tps is not None:
        if args.decode_tps <= 0 or (args.prefill_tps is not None and args.prefill_tps <= 0):
            raise _InputError("--decode-tps and --prefill-tps must be > 0")
        prefill = args.prompt_tokens / args.prefill_tps if args.prefill_tps else 0.0
        return prefill + args.output_tokens / args.decode_tps, "from per-stream token rates"
    return _measure(args)


def _measure(args: argparse.Namespace) -> tuple[float, str]:
    import trio

    from backends.errors import HeadraceError
    from bench.service_rate import measure_service

    try:
        m = trio.run(lambda: measure_service(args.measure, prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                                             concurrency=args.concurrency, duration=args.duration, model=args.model,
                                             api_key=args.api_key))  # fmt: skip
    except HeadraceError as exc:
        raise _InputError(f"--measure {args.measure}: {exc.message}") from None
    print(f"measured {m.url} ({m.model}): {m.completed} requests in {m.duration:.1f} s at {m.concurrency} streams, "
          f"{m.errors} errors; {m.throughput:.3g} req/s, mean {m.service_time * 1000:.0f} ms, "
          f"p99 {(m.p99 or 0) * 1000:.0f} ms, {m.output_tokens:.0f} tokens out", file=sys.stderr)  # fmt: skip
    return m.service_time, f"measured at {m.url}"


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.rps <= 0 or args.p99_ms <= 0 or args.concurrency < 1 or args.prompt_tokens < 0 or args.output_tokens < 1:
            raise _InputError("--rps, --p99-ms, --output-tokens and --concurrency must be positive")
        service_time, source = _service(args)
    except _InputError as exc:
        print(f"headrace plan: {exc}", file=sys.stderr)
        return 2
    result = plan(rps=args.rps, p99=args.p99_ms / 1000, concurrency=args.concurrency, service_time=service_time,
                  prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens, source=source,
                  fixed=args.service == "fixed")  # fmt: skip
    print(format_plan(result))
    if args.json:
        Path(args.json).write_bytes(msgspec.json.format(msgspec.json.encode(_finite(result))))
    if args.plot:
        print(f"plot: {plot_plan(result, args.plot)}", file=sys.stderr)
    return 0 if result.replicas is not None else 1


def _finite(p: Plan) -> Any:
    """JSON has no infinity: unstable rows' p99 and mean wait become null."""
    data = msgspec.to_builtins(p)
    for row in data["rows"]:
        for key in ("p99", "mean_wait"):
            if math.isinf(row[key]):
                row[key] = None
    return data

"""Turning raw request results into the numbers a reader wants.

One summary per run (one offered rate at one target): TTFT, inter-token
latency, time per output token and end-to-end latency as p50/p95/p99 in
milliseconds, throughput, and errors by kind. ``compare`` puts a router run
beside a direct run of the same schedule and states the router's added
latency as deltas and ratios. Everything here is plain data in, plain data out.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from backends.errors import HeadraceError
from bench.loadgen import RunResult
from bench.stats import summarize

__all__ = [
    "compare",
    "dash",
    "default_path",
    "format_compare",
    "format_table",
    "report_tool",
    "summarize_run",
    "write_json",
]

METRICS = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")


def dash(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    """``value`` formatted for a table, or ``-`` where there is none."""
    return "-" if value is None else f"{format(value, spec)}{suffix}"


def summarize_run(run: RunResult, *, label: str) -> dict[str, Any]:
    ok = [r for r in run.results if r.ok]
    errors = Counter(r.error for r in run.results if r.error is not None)
    wall = max(run.wall, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)

    def ms(values: list[float]) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.to_builtins(summarize(values, scale=1000.0))
        return out

    return {
        "label": label,
        "rate": run.config.rate,
        "duration_s": run.config.duration,
        "seed": run.config.seed,
        "wall_s": run.wall,
        "counts": {"scheduled": len(run.results), "ok": len(ok),
                   "errors": sum(errors.values())},
        "errors": dict(sorted(errors.items())),
        "throughput": {"req_s": len(ok) / wall, "output_tok_s": out_tokens / wall,
                       "offered_req_s": len(run.results) / run.config.duration},
        "ttft_ms": ms([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": ms([gap for r in ok for gap in r.itl]),
        "tpot_ms": ms([t for r in ok if (t := r.tpot) is not None]),
        "e2e_ms": ms([r.e2e for r in ok if r.e2e is not None]),
        "lag_ms": ms([r.lag for r in run.results if r.error != "dropped"]),
        "output_tokens": out_tokens,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare(routed: dict[str, Any], direct: dict[str, Any]) -> dict[str, Any]:
    """The router's added latency: ``routed - direct`` and ``routed / direct``."""
    out: dict[str, Any] = {"rate": routed["rate"]}
    for metric in METRICS:
        rows = {}
        for q in ("p50", "p99"):
            a, b = routed[metric][q], direct[metric][q]
            rows[q] = {"routed": a, "direct": b,
                       "delta": a - b if a is not None and b is not None else None,
                       "ratio": _ratio(a, b)}
        out[metric] = rows
    return out


def _fmt(value: float | None, spec: str = "8.1f") -> str:
    return format(value, spec) if value is not None else format("-", ">" + spec.split(".")[0])


def format_table(summaries: Sequence[dict[str, Any]]) -> str:
    """One row per run: latencies (ms), throughput, errors."""
    head = (f"{'target':<8} {'rps':>6} {'ok':>6} {'err':>5} "
            + " ".join(f"{m[:-3] + ' ' + q:>9}" for m in ("ttft_ms", "itl_ms", "e2e_ms")
                       for q in ("p50", "p95", "p99"))
            + f" {'req/s':>7} {'tok/s':>8}  errors")
    lines = [head, "-" * len(head)]
    for s in summaries:
        lat = " ".join(f"{_fmt(s[m][q], '9.1f')}" for m in ("ttft_ms", "itl_ms", "e2e_ms")
                       for q in ("p50", "p95", "p99"))
        errs = ", ".join(f"{k}={v}" for k, v in s["errors"].items()) or "none"
        lines.append(f"{s['label']:<8} {s['rate']:>6g} {s['counts']['ok']:>6} "
                     f"{s['counts']['errors']:>5} {lat} {s['throughput']['req_s']:>7.2f} "
                     f"{s['throughput']['output_tok_s']:>8.1f}  {errs}")
    return "\n".join(lines)


def format_compare(comparisons: Sequence[dict[str, Any]]) -> str:
    """Router added latency per rate: delta ms (ratio) at p50 and p99."""
    head = f"{'rps':>6} " + " ".join(f"{m[:-3] + ' ' + q + ' +ms (x)':>22}"
                                     for m in ("ttft_ms", "e2e_ms") for q in ("p50", "p99"))
    lines = ["router added latency (routed - direct)", head, "-" * len(head)]
    for c in comparisons:
        cells = []
        for m in ("ttft_ms", "e2e_ms"):
            for q in ("p50", "p99"):
                d, r = c[m][q]["delta"], c[m][q]["ratio"]
                cells.append(f"{_fmt(d, '+9.2f')} ({_fmt(r, '5.2f')}x)".rjust(22))
        lines.append(f"{c['rate']:>6g} " + " ".join(cells))
    return "\n".join(lines)


def default_path(results_dir: str | os.PathLike[str], kind: str, stamp: str, suffix: str) -> Path:
    return Path(results_dir) / f"{kind}-{stamp}.{suffix}"


def write_json(path: str | os.PathLike[str], document: dict[str, Any]) -> Path:
    """Write ``document`` as indented JSON, creating parent folders."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(msgspec.json.format(msgspec.json.encode(document), indent=2) + b"\n")
    return target



def report_tool(
    name: str,
    compute: Callable[[], dict[str, Any]],
    render: Callable[[dict[str, Any]], str],
    json_path: str | os.PathLike[str] | None,
) -> int:
    """The shape of every one-shot ``headrace bench NAME`` tool: compute, print the
    table, write the JSON; a :class:`HeadraceError` is one line on stderr and exit 2."""
    try:
        document = compute()
    except HeadraceError as exc:
        print(f"headrace bench {name}: error: {exc.message}", file=sys.stderr)
        return 2
    print(render(document))
    if json_path:
        write_json(json_path, document)
    return 0

"""The simulator's numbers per policy: one dict each (the JSON), a table, a plot.

- hit rate: cached prompt tokens / prompt tokens, over all requests;
- TTFT: p50/p95/p99 in ms (``bench.stats``, linear interpolation);
- throughput: output tokens and completed requests per second of the
  makespan (first arrival to last token); under an open-loop arrival rate the
  system keeps up with, req/s is the offered rate, and it falls below it only
  when the backends cannot keep up;
- load: max over backends / mean, of the requests each served and of its
  time-averaged in-flight count (1.0 is perfect balance).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from bench.stats import summarize
from sim.model import SimResult

__all__ = ["format_table", "plot_summaries", "summarize_result"]


def _max_over_mean(values: Sequence[float]) -> float | None:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else None


def summarize_result(label: str, result: SimResult) -> dict[str, Any]:
    span = result.makespan_s
    served = [b.served for b in result.backends]
    in_flight = [b.in_flight_mean for b in result.backends]
    return {
        "label": label,
        "requests": result.requests,
        "completed": result.completed,
        "refused": result.refused,
        "hit_rate": result.cached_tokens / result.prompt_tokens if result.prompt_tokens else 0.0,
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "ttft_ms": msgspec.to_builtins(summarize(result.ttft_s, scale=1000.0)),
        "throughput": {
            "output_tok_s": result.output_tokens / span if span else 0.0,
            "req_s": result.completed / span if span else 0.0,
        },
        "makespan_s": span,
        "load": {
            "served_max_over_mean": _max_over_mean(served),
            "in_flight_max_over_mean": _max_over_mean(in_flight),
        },
        "backends": msgspec.to_builtins(result.backends),
        "kv_events": result.kv_events,
        "kv_resyncs": result.kv_resyncs,
        "sim_wall_s": result.wall_s,
    }


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


_COLUMNS = ("policy", "hit rate", "TTFT p50 ms", "TTFT p99 ms", "out tok/s", "req/s",
            "served max/avg", "in-flight max/avg", "sim s")


def format_table(summaries: Sequence[dict[str, Any]]) -> str:
    rows = [_COLUMNS] + [
        (s["label"], f"{s['hit_rate']:.1%}", _f(s["ttft_ms"]["p50"], ".1f"),
         _f(s["ttft_ms"]["p99"], ".1f"), f"{s['throughput']['output_tok_s']:.0f}",
         f"{s['throughput']['req_s']:.1f}", _f(s["load"]["served_max_over_mean"], ".2f"),
         _f(s["load"]["in_flight_max_over_mean"], ".2f"), f"{s['sim_wall_s']:.1f}")
        for s in summaries
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot_summaries(summaries: Sequence[dict[str, Any]], path: str | os.PathLike[str], *,
                   title: str = "routing policies, simulated") -> Path:
    """Four bar panels, one bar (group) per policy: hit rate, TTFT p50/p99,
    output tokens/s, load max/avg. matplotlib is imported only here."""
    from bench.plot import _figure, _save  # the benchmarks' figure and file conventions

    fig, axes = _figure(4, title)
    labels = [s["label"] for s in summaries]
    xs = list(range(len(labels)))
    panels: list[tuple[str, list[tuple[str, list[float]]]]] = [
        ("prefix-cache hit rate", [("hit rate", [s["hit_rate"] for s in summaries])]),
        ("time to first token (ms)", [(q, [s["ttft_ms"][q] or 0.0 for s in summaries])
                                      for q in ("p50", "p99")]),
        ("output tokens/s", [("tok/s", [s["throughput"]["output_tok_s"] for s in summaries])]),
        ("load max/avg", [(k, [s["load"][f"{k}_max_over_mean"] or 0.0 for s in summaries])
                          for k in ("served", "in_flight")]),
    ]
    for ax, (name, series) in zip(axes, panels, strict=True):
        width = 0.8 / len(series)
        for j, (label, values) in enumerate(series):
            ax.bar([x + (j - (len(series) - 1) / 2) * width for x in xs], values, width, label=label)
        ax.set_title(name)
        ax.set_xticks(xs, labels, rotation=20, ha="right")
        ax.grid(True, axis="y", alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize="small")
    return _save(fig, path)

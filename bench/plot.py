"""PNG plots of benchmark results (matplotlib, imported only when plotting).

Uses ``matplotlib.figure.Figure`` directly rather than pyplot: no global
figure state, no GUI backend, safe to call from any thread or test.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_engine", "plot_load", "plot_rate_p99"]

_PANELS = (("ttft_ms", "time to first token"), ("itl_ms", "inter-token latency"),
           ("e2e_ms", "end-to-end latency"))
_STYLES = {"p50": "-", "p95": "--", "p99": ":"}


def _figure(ncols: int, title: str) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.0 * ncols, 4.0), layout="constrained")
    fig.suptitle(title)
    return fig, fig.subplots(1, ncols, squeeze=False)[0]


def _save(fig: Any, path: str | os.PathLike[str]) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, format="png", dpi=100)
    return target


def plot_load(summaries: Sequence[dict[str, Any]], path: str | os.PathLike[str], *,
              title: str = "latency against offered load") -> Path:
    """Latency percentiles (ms) against offered req/s, one line per target and
    percentile; ``summaries`` are :func:`bench.report.summarize_run` outputs."""
    fig, axes = _figure(len(_PANELS), title)
    labels = sorted({s["label"] for s in summaries})
    for ax, (metric, name) in zip(axes, _PANELS, strict=True):
        for i, label in enumerate(labels):
            runs = sorted((s for s in summaries if s["label"] == label), key=lambda s: s["rate"])
            for q, style in _STYLES.items():
                pts = [(s["rate"], s[metric][q]) for s in runs if s[metric][q] is not None]
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    ax.plot(xs, ys, style, marker="o", color=f"C{i}", label=f"{label} {q}")
        _rate_axes(ax, name)
    return _save(fig, path)


def plot_engine(levels: Sequence[dict[str, Any]], path: str | os.PathLike[str], *,
                title: str = "engine throughput against concurrency") -> Path:
    """Aggregate and per-stream tokens/s, and TTFT, against concurrency."""
    fig, axes = _figure(2, title)
    xs = [lv["concurrency"] for lv in levels]
    axes[0].plot(xs, [lv["aggregate_tok_s"] for lv in levels], "-o", label="aggregate")
    axes[0].plot(xs, [lv["per_stream_tok_s"]["p50"] or 0.0 for lv in levels], "--o",
                 label="per stream (p50)")
    axes[0].set_ylabel("output tokens/s")
    axes[0].set_title("throughput")
    for q, style in _STYLES.items():
        axes[1].plot(xs, [lv["ttft_ms"][q] or 0.0 for lv in levels], style, marker="o", label=q)
    axes[1].set_ylabel("ms")
    axes[1].set_title("time to first token")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
        ax.set_xlabel("concurrency")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    return _save(fig, path)


def plot_rate_p99(summaries: Sequence[dict[str, Any]], path: str | os.PathLike[str], *,
                  limit_ms: float | None = None,
                  title: str = "p99 latency against offered load") -> Path:
    """End-to-end and first-token p99 (ms) against offered req/s, one line per
    target (e.g. router and direct), with the p99 limit drawn across."""
    fig, axes = _figure(2, title)
    labels = sorted({s["label"] for s in summaries})
    for ax, (metric, name) in zip(axes, (("e2e_ms", "end-to-end p99"),
                                         ("ttft_ms", "time to first token p99")), strict=True):
        for i, label in enumerate(labels):
            runs = sorted((s for s in summaries if s["label"] == label), key=lambda s: s["rate"])
            pts = [(s["rate"], s[metric]["p99"]) for s in runs if s[metric]["p99"] is not None]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, "-o", color=f"C{i}", label=label)
            bad = [(s["rate"], s[metric]["p99"] or 0.0) for s in runs if s["counts"]["errors"]]
            if bad:
                xs, ys = zip(*bad, strict=True)
                ax.plot(xs, ys, "x", color=f"C{i}", markersize=10, label=f"{label}: errors")
        if limit_ms is not None and metric == "e2e_ms":
            ax.axhline(limit_ms, color="grey", linestyle="--", label=f"{limit_ms:g} ms")
        ax.set_yscale("log")
        _rate_axes(ax, name)
    return _save(fig, path)


def _rate_axes(ax: Any, title: str) -> None:
    """Titles, labels, grid and legend of a panel of ms against offered req/s."""
    ax.set_title(title)
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel("ms")
    ax.grid(True, alpha=0.3)
    if ax.get_lines():
        ax.legend(fontsize="small")

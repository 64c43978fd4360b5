"""``headrace bench spec``: tokens/s with and without speculative decoding.

Starts ``headrace engine`` twice on the same model (``--speculative off``, then
the method under test), and for each runs the closed-loop engine benchmark on
two workloads: prompts whose answers repeat their input (copy, extraction,
code edit, summarise-with-quotes over readable texts: where prompt lookup finds
drafts) and open-ended chat (where it finds few). Prints tokens/s per cell and
the ratio speculative / plain, measured in one run. Greedy by default, so both
servers produce the same tokens and only speed differs; the chat endpoint by
default, since the prompts are instructions to an instruct model.

Two throughputs per cell. ``tok/s``: output tokens / wall time of the level, the
engine benchmark's number. ``busy tok/s``: concurrency x output tokens / the
summed request latencies, i.e. tokens per second while every stream is busy.
They differ by the level's ragged end: streams stop taking requests at the
deadline and the wall clock runs until the last one finishes, and at high
concurrency with long requests (16 streams of 128 tokens on a CPU: about one
request per stream in 12 s) that tail is much of the level and falls
differently for the two engines (speculation makes request times uneven).
Use a long ``--duration`` to make the two agree.

Requests stop at EOS by default (``--ignore-eos`` to generate ``--max-tokens``
always). Past EOS the model starts a chat turn of its own, so with
``--ignore-eos`` a third of the 'repeat' tokens are open-ended text; and requests
of one fixed length that start together run in lockstep in the plain engine
(prefills batched, equal contexts), which speculation, by finishing some sooner,
breaks: worth ~5 % at 16 streams on the chat workload, measured in-process.
"""

from __future__ import annotations

import argparse
import copy
import shlex
import sys
from pathlib import Path
from typing import Any

import trio

from backends.errors import ClientError, HeadraceError
from bench.cli import add_common_arguments, finish
from bench.engine_bench import _run as run_levels
from router.replicas import EngineReplica

__all__ = ["busy_tok_s", "format_cells", "main"]

WORKLOADS = ("repeat", "chat")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="headrace bench spec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p, target=False)
    p.set_defaults(max_tokens=128, temperature=0.0, endpoint="chat")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--duration", type=float, default=20.0, help="seconds per cell")
    p.add_argument("--method", choices=("ngram", "draft"), default="ngram")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="K for the speculative engine (default: the engine's, 15 for ngram)")
    p.add_argument("--engine-args", default="--threads 2",
                   help="extra arguments for both engines, e.g. '--dtype bfloat16 --draft-layers 8'")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=False,
                   help="generate --max-tokens every time (default: stop at EOS, so the repeat "
                        "workload measures the copy and not the chat turn the model invents after "
                        "it, and same-length requests do not march in lockstep)")
    p.add_argument("--warmup", type=int, default=1)
    return p


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    k_flags = ([] if args.num_speculative_tokens is None
               else ["--num-speculative-tokens", str(args.num_speculative_tokens)])
    modes = {"off": ["--speculative", "off"], args.method: ["--speculative", args.method, *k_flags]}
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for mode, flags in modes.items():
        replica = EngineReplica(f"engine-{mode}", [*flags, *shlex.split(args.engine_args)])
        async with trio.open_nursery() as nursery:
            url = await nursery.start(replica.run)
            results[mode] = {}
            for workload in WORKLOADS:
                level_args = copy.copy(args)
                level_args.target, level_args.workload = url, workload
                document = await run_levels(level_args)
                results[mode][workload] = document["levels"]
            nursery.cancel_scope.cancel()
    return {"kind": "spec", "method": args.method, "k": args.num_speculative_tokens or "default",
            "engine_args": args.engine_args, "max_tokens": args.max_tokens,
            "endpoint": args.endpoint, "ignore_eos": args.ignore_eos, "duration": args.duration,
            "cells": _cells(results, args.method)}


def busy_tok_s(level: dict[str, Any]) -> float | None:
    """Concurrency x output tokens / summed request latencies: a closed loop's
    tokens per second while all its streams are busy (no ragged end)."""
    e2e = level.get("e2e_ms") or {}
    if not e2e.get("n") or not e2e.get("mean"):
        return None
    busy_s = e2e["mean"] * e2e["n"] / 1000.0
    return float(level["concurrency"] * level["output_tokens"] / busy_s)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _cells(results: dict[str, dict[str, list[dict[str, Any]]]], method: str) -> list[dict[str, Any]]:
    cells = []
    for workload in WORKLOADS:
        plain = {lv["concurrency"]: lv for lv in results["off"][workload]}
        for lv in results[method][workload]:
            base = plain[lv["concurrency"]]
            cells.append({"workload": workload, "concurrency": lv["concurrency"],
                          "plain_tok_s": base["aggregate_tok_s"], "spec_tok_s": lv["aggregate_tok_s"],
                          "ratio": _ratio(lv["aggregate_tok_s"], base["aggregate_tok_s"]),
                          "plain_busy_tok_s": busy_tok_s(base), "spec_busy_tok_s": busy_tok_s(lv),
                          "busy_ratio": _ratio(busy_tok_s(lv), busy_tok_s(base)),
                          "errors": lv["requests"] - lv["ok"] + base["requests"] - base["ok"]})
    return cells


def format_cells(cells: list[dict[str, Any]]) -> str:
    head = (f"{'workload':<9} {'conc':>5} {'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>7} "
            f"{'busy plain':>11} {'busy spec':>10} {'ratio':>7} {'err':>4}")
    lines = [head, "-" * len(head)]

    def num(v: float | None, width: int, fmt: str = ".1f", unit: str = "") -> str:
        return f"{format(v, fmt) + unit if v is not None else '-':>{width}}"

    for c in cells:
        lines.append(f"{c['workload']:<9} {c['concurrency']:>5} {num(c['plain_tok_s'], 12)} "
                     f"{num(c['spec_tok_s'], 11)} {num(c['ratio'], 7, '.2f', 'x')} "
                     f"{num(c.get('plain_busy_tok_s'), 11)} {num(c.get('spec_busy_tok_s'), 10)} "
                     f"{num(c.get('busy_ratio'), 7, '.2f', 'x')} {c['errors']:>4}")
    return "\n".join(lines)


def _plot(document: dict[str, Any], path: Path) -> Path:
    """Grouped bars: plain vs speculative tokens/s per (workload, concurrency)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = document["cells"]
    labels = [f"{c['workload']}\nc={c['concurrency']}" for c in cells]
    xs = range(len(cells))
    fig, ax = plt.subplots(figsize=(1.6 * len(cells) + 2, 4))
    ax.bar([x - 0.2 for x in xs], [c["plain_tok_s"] for c in cells], 0.4, label="plain")
    ax.bar([x + 0.2 for x in xs], [c["spec_tok_s"] for c in cells], 0.4,
           label=f"{document['method']} (k={document['k']})")
    for x, c in zip(xs, cells, strict=True):
        if c["ratio"] is not None:
            ax.annotate(f"{c['ratio']:.2f}x", (x + 0.2, c["spec_tok_s"]), ha="center", va="bottom")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("aggregate output tokens/s")
    ax.set_title("speculative decoding: tokens/s, one run")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        if any(c < 1 for c in args.concurrency) or args.duration <= 0:
            raise ClientError("--concurrency values must be >= 1 and --duration > 0")
        document = trio.run(_measure, args)
    except HeadraceError as exc:
        print(f"headrace bench spec: error: {exc.message}", file=sys.stderr)
        return 2 if isinstance(exc, ClientError) else 1
    print(format_cells(document["cells"]))
    finish(args, "spec", document, _plot)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

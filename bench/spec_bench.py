"""``headrace bench spec``: tokens/s with and without speculative decoding.

Starts ``headrace engine`` twice on the same model (``--speculative off``, then
the method under test), and for each runs the closed-loop engine benchmark on
two workloads: prompts whose answers repeat their input (copy, extraction,
code edit, summarise-with-quotes: where prompt lookup finds drafts) and
open-ended chat (where it finds few). Prints tokens/s per cell and the ratio
speculative / plain, measured in one run. Greedy by default, so both servers
produce the same tokens and only speed differs.
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

__all__ = ["format_cells", "main"]

WORKLOADS = ("repeat", "chat")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="headrace bench spec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p, target=False)
    p.set_defaults(max_tokens=128, temperature=0.0)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--duration", type=float, default=20.0, help="seconds per cell")
    p.add_argument("--method", choices=("ngram", "draft"), default="ngram")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--engine-args", default="--threads 2",
                   help="extra arguments for both engines, e.g. '--dtype bfloat16 --draft-layers 8'")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--warmup", type=int, default=1)
    return p


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    modes = {"off": ["--speculative", "off"],
             args.method: ["--speculative", args.method,
                           "--num-speculative-tokens", str(args.num_speculative_tokens)]}
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
    return {"kind": "spec", "method": args.method, "k": args.num_speculative_tokens,
            "engine_args": args.engine_args, "max_tokens": args.max_tokens,
            "cells": _cells(results, args.method)}


def _cells(results: dict[str, dict[str, list[dict[str, Any]]]], method: str) -> list[dict[str, Any]]:
    cells = []
    for workload in WORKLOADS:
        plain = {lv["concurrency"]: lv for lv in results["off"][workload]}
        for lv in results[method][workload]:
            base = plain[lv["concurrency"]]["aggregate_tok_s"]
            cells.append({"workload": workload, "concurrency": lv["concurrency"],
                          "plain_tok_s": base, "spec_tok_s": lv["aggregate_tok_s"],
                          "ratio": lv["aggregate_tok_s"] / base if base else None,
                          "errors": lv["requests"] - lv["ok"] + (plain[lv["concurrency"]]["requests"]
                                                                 - plain[lv["concurrency"]]["ok"])})
    return cells


def format_cells(cells: list[dict[str, Any]]) -> str:
    head = f"{'workload':<9} {'conc':>5} {'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>7} {'err':>4}"
    lines = [head, "-" * len(head)]
    for c in cells:
        ratio = f"{c['ratio']:.2f}x" if c["ratio"] is not None else "-"
        lines.append(f"{c['workload']:<9} {c['concurrency']:>5} {c['plain_tok_s']:>12.1f} "
                     f"{c['spec_tok_s']:>11.1f} {ratio:>7} {c['errors']:>4}")
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

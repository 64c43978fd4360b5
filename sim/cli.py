"""``headrace simulate``: routing policies against modelled backends, in virtual time.

    headrace simulate --workload shared_prefix --policy round_robin --policy prefix_hash \\
        --backends 8 --requests 20000 --json sim.json --plot sim.png
    headrace simulate --workload shared_prefix --requests 5000 --write-trace shared.jsonl
    headrace simulate --trace shared.jsonl --policy 'prefix_hash:load_factor=1.25'

``--policy NAME[:key=value,...]`` names any installed routing policy
(``headrace policies``) with its options (values read as JSON where they
parse, else as strings), built through ``policies.registry.create_policy``
as the router builds it; give it several times to compare. Every policy sees
the same requests. The model and its parameters: ``sim.model``; the
workload: ``sim.workloads``; the trace format: ``sim.trace``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from policies.registry import PolicyError, create_policy
from sim.model import ModelConfig, SimError, simulate
from sim.report import format_table, plot_summaries, summarize_result
from sim.trace import TraceError, TraceRecord, prepare, read_trace, write_trace
from sim.workloads import WORKLOADS, SharedPrefix

__all__ = ["main", "parse_policy"]


def parse_policy(spec: str) -> tuple[str, dict[str, Any]]:
    """``name`` or ``name:key=value,key=value`` -> (name, options)."""
    name, _, tail = spec.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, tail.split(",")):
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise ValueError(f"bad policy option {item!r} in {spec!r}: use key=value")
        try:
            options[key.strip()] = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            options[key.strip()] = raw
    return name.strip(), options


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="headrace simulate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", choices=sorted(WORKLOADS), default="shared_prefix")
    src.add_argument("--trace", metavar="FILE", help="a JSONL trace (sim.trace)")
    p.add_argument("--policy", action="append", default=[], metavar="NAME[:k=v,...]")
    p.add_argument("--requests", type=int, help="requests to generate (default 10000), or the "
                   "first N of the trace (default all)")
    p.add_argument("--seed", type=int, default=0)
    w = p.add_argument_group("workload (shared_prefix)")
    default = SharedPrefix()
    w.add_argument("--rate", type=float, default=default.rate, help="requests/s, Poisson")
    w.add_argument("--groups", type=int, default=default.groups)
    w.add_argument("--tenants", type=int, default=default.tenants)
    w.add_argument("--skew", type=float, default=default.skew, help="group popularity 1/(g+1)^skew")
    w.add_argument("--think-s", type=float, default=default.think_s)
    m = p.add_argument_group("model (per backend)")
    cfg = ModelConfig()
    m.add_argument("--backends", type=int, default=cfg.backends)
    m.add_argument("--block-size", type=int, default=cfg.block_size)
    m.add_argument("--cache-blocks", type=int, default=cfg.cache_blocks)
    m.add_argument("--ttft-ms", type=float, default=cfg.ttft_s * 1000, help="fixed, before the prefill lane")
    m.add_argument("--prefill-ms-per-token", type=float, default=cfg.prefill_s_per_token * 1000)
    m.add_argument("--tpot-ms", type=float, default=cfg.decode_step_s * 1000,
                   help="decode step at batch size 1")
    m.add_argument("--batch-slope", type=float, default=cfg.batch_slope,
                   help="step time grows by this fraction per extra running sequence")
    m.add_argument("--max-running", type=int, default=cfg.max_running, help="0: no limit")
    m.add_argument("--no-kv-events", action="store_true", help="policies get no KV events")
    m.add_argument("--backend-prefix", default=cfg.name_prefix,
                   help="backends are named PREFIX0, PREFIX1, ... (the router's: backend-); ring placement follows names")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="OUT")
    o.add_argument("--plot", metavar="OUT.png")
    o.add_argument("--write-trace", metavar="FILE",
                   help="write the requests as a trace (and stop, unless --policy is given)")
    o.add_argument("--quiet", action="store_true", help="no progress line")
    return p


def _model(args: argparse.Namespace) -> ModelConfig:
    return msgspec.convert({
        "backends": args.backends, "block_size": args.block_size, "cache_blocks": args.cache_blocks,
        "ttft_s": args.ttft_ms / 1000, "prefill_s_per_token": args.prefill_ms_per_token / 1000,
        "decode_step_s": args.tpot_ms / 1000, "batch_slope": args.batch_slope,
        "max_running": args.max_running, "kv_events": not args.no_kv_events,
        "name_prefix": args.backend_prefix,
    }, ModelConfig)


def _workload(args: argparse.Namespace) -> tuple[dict[str, Any], Callable[[], Iterator[TraceRecord]], int]:
    """A description of the requests (the trace header), a fresh iterator of
    them per call (each policy gets its own pass: memory follows the requests
    in flight, not the trace), and how many there are."""
    if args.trace:
        path = args.trace
        with open(path, "rb") as f:
            lines = sum(1 for line in f if line.strip() and b'"headrace_trace"' not in line)
        total = lines if args.requests is None else min(lines, args.requests)
        return {"trace": path}, lambda: read_trace(path, limit=args.requests), total
    kind, factory = WORKLOADS[args.workload]
    params = msgspec.convert({
        "requests": args.requests or 10_000, "rate": args.rate, "groups": args.groups,
        "tenants": args.tenants, "skew": args.skew, "think_s": args.think_s,
    }, kind)
    about = {"workload": args.workload, "seed": args.seed, "params": msgspec.to_builtins(params)}
    return about, lambda: factory(params, seed=args.seed), params.requests


class _Progress:
    def __init__(self, label: str, total: int | None, quiet: bool) -> None:
        from bench.progress import ProgressBar

        self.bar = None if quiet else ProgressBar(label)
        self.total, self.started = total, time.perf_counter()

    def __call__(self, n: int) -> None:
        if self.bar is not None:
            frac = n / self.total if self.total else 0.0
            self.bar.update(frac, f"{n} requests", time.perf_counter())

    def close(self, text: str) -> None:
        if self.bar is not None:
            self.bar.close(text)


def _run(args: argparse.Namespace) -> int:
    policies = [(spec, *parse_policy(spec)) for spec in args.policy]
    for _, name, options in policies:
        create_policy(name, options=options)  # fail before the work, naming the policy
    model = _model(args)
    about, records, total = _workload(args)
    if args.write_trace:
        count = write_trace(args.write_trace, records(), about)
        print(f"wrote {count} requests to {args.write_trace}", file=sys.stderr)
        if not policies:
            return 0
    if not policies:
        print("headrace simulate: give --policy (or --write-trace)", file=sys.stderr)
        return 2
    summaries = []
    for spec, name, options in policies:
        progress = _Progress(f"simulate {spec}", total, args.quiet)
        requests = prepare(records(), model.block_size)
        result = simulate(create_policy(name, options=options), requests, model, progress=progress)
        progress.close(f"{result.requests} requests in {result.wall_s:.1f} s")
        summaries.append(summarize_result(spec, result))
    print(_heading(about, model, summaries[0]["requests"]))
    print(format_table(summaries))
    if args.json:
        from bench.report import write_json

        write_json(args.json, {"requests": about, "model": msgspec.to_builtins(model),
                               "results": summaries})
    if args.plot:
        plot_summaries(summaries, args.plot)
    return 0


def _heading(about: dict[str, Any], model: ModelConfig, n: int) -> str:
    source = about.get("trace") or f"{about['workload']} (seed {about['seed']})"
    return (f"{n} requests from {source}; {model.backends} backends, blocks of {model.block_size}, "
            f"{model.cache_blocks} cached blocks each, prefill {model.prefill_s_per_token * 1000:g} "
            f"ms/token, decode step {model.decode_step_s * 1000:g} ms")


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except (PolicyError, TraceError, SimError, msgspec.ValidationError, ValueError, OSError) as exc:
        print(f"headrace simulate: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

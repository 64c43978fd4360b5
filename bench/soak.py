"""``python -m bench.soak``: the router under sustained load finishes with no
error anywhere (issue 12's zero-error target), on the bed of ``headrace bench
router``: two ``headrace mock --tpot-ms 0 --max-tokens 20`` and one router
process with its access log on.

1. A closed loop of ``--duration`` s per protocol (``--http``; wrk and h2load
   when installed, else the Python client): every request must get a 200 and
   a complete answer (wrk's Lua hook: ``data: [DONE]``, no in-band error;
   h2load: no failed, errored or reset stream, no non-2xx).
2. An open loop (Poisson, the lean h2c client) of ``--open-duration`` s at each
   of ``--fractions`` of the h2c closed loop's rate (the router's maximum on
   this bed): no error. A client that drops arrivals (``--max-outstanding``
   in flight) says the box was saturated: counted apart from the router's errors.
3. The router's log: every access line's status (``-``: the client left before
   an answer; expected only where a closed loop's time ran out mid-request)
   and no traceback.

Prints a table and writes JSON (``--json``, default bench/results/soak-*.json),
also when stopped early::

    python -m bench.soak                          # 10 min a protocol + 3 x 30 s: ~22 min
    python -m bench.soak --duration 60 --open-duration 10
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import msgspec
import trio

from bench.cli import RESULTS_DIR, run_reported
from bench.client import RequestSpec
from bench.loadgen import LoadConfig, run_rate
from bench.procs import Server, cpu_info
from bench.report import default_path, summarize_run, write_json
from bench.router_bench import HTTPS, closed_loop, start_bed

__all__ = ["access_statuses", "main"]

# hypercorn's access line: ... "POST /v1/completions 2" 200 ... ('-' where no response was sent)
_ACCESS = re.compile(r'"[A-Z]+ \S+ [\d.]+" (\S+) ')


def access_statuses(log: str) -> tuple[Counter[str], int]:
    """The statuses of the access lines in ``log``, and its tracebacks."""
    return Counter(m.group(1) for m in _ACCESS.finditer(log)), log.count("Traceback (most recent call last)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--duration", type=float, default=600.0, help="seconds of closed loop per protocol")
    p.add_argument("--http", nargs="+", choices=("1.1", "2"), default=["2", "1.1"])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--client", choices=("auto", "native", "python"), default="auto")
    p.add_argument("--open-duration", type=float, default=30.0, help="seconds per open-loop rate")
    p.add_argument("--fractions", type=float, nargs="*", default=[0.5, 0.8, 0.95],
                   help="open-loop rates, as fractions of the h2c closed loop's rate")
    p.add_argument("--max-outstanding", type=int, default=512)
    p.add_argument("--tpot-ms", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=20)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path")
    p.add_argument("--results-dir", default=RESULTS_DIR)
    return p


async def run(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory(prefix="headrace-soak-") as tmp:
        logdir = Path(tmp)
        async with AsyncExitStack() as stack:
            print("starting 2 mocks and the router (access log on)...", file=sys.stderr)
            # start_bed's options: the router's only; its own flags (no bare app, the access log)
            bed_args = argparse.Namespace(**vars(args), workers=1, router_src=None)
            bed = await start_bed(bed_args, logdir, stack, bare=False,
                                  serve_args=["--set", "server.access_log=true"])  # fmt: skip
            router: Server | None = bed.router
            assert router is not None
            doc["closed_loop"] = []
            try:
                for http in args.http:
                    doc["closed_loop"].append(await closed_loop(bed_args, "router", router, http, bed.mocks, logdir))
                h2c = [r for r in doc["closed_loop"] if r["http"] == "2"] or doc["closed_loop"]
                top = min(r["req_s"] for r in h2c)
                doc["open_loop"] = {"max_rate": top, "runs": []}
                spec = RequestSpec(model="mock", max_tokens=args.max_tokens, timeout=30.0)
                for i, fraction in enumerate(args.fractions):
                    rate = float(f"{fraction * top:.3g}")
                    config = LoadConfig(rate=rate, duration=args.open_duration, seed=args.seed + i,
                                        prompt_tokens=args.prompt_tokens, max_outstanding=args.max_outstanding)  # fmt: skip
                    result = await run_rate(router.url, "2", spec, config, label=f"open {rate:g} rps", lean=True)
                    doc["open_loop"]["runs"].append({"fraction": fraction, **summarize_run(result, label="router")})
            finally:
                await trio.sleep(0.5)  # the last access lines
                statuses, tracebacks = access_statuses(router.log.read_text(errors="replace"))
                doc["router_log"] = {"statuses": dict(statuses.most_common()), "tracebacks": tracebacks}


def verdict(doc: dict[str, Any]) -> dict[str, bool]:
    closed = doc.get("closed_loop", [])
    runs = doc.get("open_loop", {}).get("runs", [])
    log = doc.get("router_log", {"statuses": {}, "tracebacks": 1})
    served = {s: n for s, n in log["statuses"].items() if s != "-"}
    return {
        "closed loop: every answer complete, 200": bool(closed) and all(not r["errors"] for r in closed),
        "open loop: no error": bool(runs) and all(not r["errors"] for r in runs),
        "router log: only 200s, no traceback": all(s == "200" for s in served) and log["tracebacks"] == 0,
    }


def format_report(doc: dict[str, Any]) -> str:
    cpu = doc["cpu"]
    lines = [f"CPU: {cpu['model']}, {cpu['cores']} cores",
             f"bed: 2 x headrace mock --tpot-ms {doc['config']['tpot_ms']:g} --max-tokens {doc['config']['max_tokens']}; "
             "one router process, access log on", ""]  # fmt: skip
    lines.append(f"{'run':<34}{'requests':>10}{'ok':>10}{'req/s':>9}  errors")
    for r in doc.get("closed_loop", []):
        name = f"closed loop {HTTPS[r['http']]} {r['duration_s']:g} s (c{r['concurrency']})"
        lines.append(f"{name:<34}{r['requests']:>10}{r['ok']:>10}{r['req_s']:>9.1f}  {r['errors'] or 'none'}")
    for r in doc.get("open_loop", {}).get("runs", []):
        name = f"open loop {r['rate']:g} rps ({100 * r['fraction']:.0f} %)"
        c = r["counts"]
        tail = f"  TTFT p50 / p99 {r['ttft_ms']['p50'] or 0:.1f} / {r['ttft_ms']['p99'] or 0:.1f} ms"
        lines.append(f"{name:<34}{c['scheduled']:>10}{c['ok']:>10}{r['throughput']['req_s']:>9.1f}  "
                     f"{r['errors'] or 'none'}{tail}")  # fmt: skip
    if "router_log" in doc:
        log = doc["router_log"]
        lines += ["", f"router log: access statuses {log['statuses']} ('-': the client left before an answer), "
                      f"tracebacks {log['tracebacks']}"]  # fmt: skip
    if doc.get("interrupted"):
        lines.append(f"stopped early: {doc['interrupted']}")
    lines += ["", "targets: " + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in verdict(doc).items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.duration <= 0 or args.open_duration <= 0 or args.concurrency < 1 or not all(0 < f <= 1 for f in args.fractions):
        print("python -m bench.soak: error: durations > 0, --concurrency >= 1, fractions in (0, 1]", file=sys.stderr)
        return 2
    doc: dict[str, Any] = {"kind": "soak", "cpu": cpu_info(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                           "config": {k: getattr(args, k) for k in ("duration", "http", "concurrency", "client",
                                                                    "open_duration", "fractions", "tpot_ms",
                                                                    "max_tokens", "prompt_tokens")}}  # fmt: skip
    code = run_reported(run, args, doc, _finish)
    return code or (0 if all(verdict(doc).values()) else 1)


def _finish(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    doc["targets"] = verdict(doc)
    print(format_report(doc))
    path = args.json_path or default_path(args.results_dir, "soak", time.strftime("%Y%m%d-%H%M%S"), "json")
    print(f"wrote {write_json(path, msgspec.to_builtins(doc))}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())

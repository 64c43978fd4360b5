"""``headrace bench budget``: how much CPU a request may cost the router, on
this machine, for its added TTFT to stay within a target.

Issue 12 asks for at most +2 ms (p50) and +5 ms (p99) of TTFT at half the
router's highest rate. The router's added latency on a busy event loop
follows its CPU per request (every request's steps wait behind the others'),
so the question is what budget that target leaves. This measures it::

    2 x headrace mock --tpot-ms 0 --max-tokens 20
    for each X in --burn-ms:  python bench/null_relay.py --burn-ms X   (the least a relay does,
                                                                          + X ms of CPU a request)
    headrace serve --workers 1                                          (the router itself)

Each front in turn is driven open loop at ``--rps`` (Poisson, the lean
HTTP/2 client) for ``--duration`` s, then the first mock directly with the
same schedule right after; the added TTFT is the difference of the two runs'
percentiles, and the front's CPU per request its own CPU time over the
answered requests. With ``--rounds N`` every front runs N times (the order
reversed every other round, a new schedule each round) and each number is
its median over the rounds: on a shared box one run's p99 can be twice the
next one's. The relays give a curve of added TTFT against CPU per
request; the budget is where the curve crosses the target (interpolated
between the two relays around it), and the router's point shows how far
it is from it. Prints a table, writes JSON and a PNG under ``bench/results/``.

The relays spin their extra CPU on the path to the first byte, so in
principle the curve is the worst case for a given cost (a router whose work
partly follows its first byte could add less) and the budget a lower bound.
Measured here, the router's medians over three rounds (1.16 ms a request,
+9.9 ms at p99) lay on the relays' curve extended (~+9.6 ms at 1.16 ms):
its work costs the tail as if it were all before the first byte.

    headrace bench budget                            # --rps 550: half the router's rate here
    headrace bench budget --rounds 3                 # medians of 3 (~10 min)
    headrace bench budget --burn-ms 0,0.2,0.4 --no-router --rps 300
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from backends.errors import ClientError
from bench.cli import add_output_args, finish, run_reported
from bench.client import RequestSpec
from bench.loadgen import LoadConfig, run_rate
from bench.procs import Server, cpu_info
from bench.report import compare, dash, summarize_run
from bench.router_bench import _ready, _start_all, backend_args, mock_argv, serve_argv

__all__ = ["budget", "format_report", "main"]

RELAY = Path(__file__).with_name("null_relay.py")


def relay_argv(mocks: Sequence[Server]) -> list[str]:
    """bench/null_relay.py in front of ``mocks`` on a free port (run as a file: see its docstring)."""
    return [sys.executable, str(RELAY), "--port", "0", *backend_args(mocks)]


def _burns(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ClientError(f"--burn-ms takes numbers separated by commas, not {text!r}") from None
    if any(v < 0 for v in values):
        raise ClientError("--burn-ms values must be >= 0")
    return values


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="headrace bench budget", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rps", type=float, default=550.0, help="offered requests per second (default: "
                   "half the router's highest rate on the reference box)")
    p.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals per run")
    p.add_argument("--burn-ms", default="0,0.2,0.4,0.6", help="the relays' added CPU per request, ms")
    p.add_argument("--rounds", type=int, default=1, help="runs of every front; medians over them")
    p.add_argument("--no-router", action="store_true", help="the relays only")
    p.add_argument("--target-p99-ms", type=float, default=5.0, help="the added TTFT p99 judged")
    p.add_argument("--max-tokens", type=int, default=20)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    add_output_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.burns = _burns(args.burn_ms)
    if args.rps <= 0 or args.duration <= 0 or args.max_tokens < 1 or args.target_p99_ms <= 0 or args.rounds < 1:
        raise ClientError("--rps, --duration and --target-p99-ms must be > 0, --max-tokens and --rounds >= 1")
    if not args.burns and args.no_router:
        raise ClientError("nothing to measure: no --burn-ms and --no-router")
    doc: dict[str, Any] = {
        "kind": "budget", "cpu": cpu_info(),
        "config": {"rps": args.rps, "duration": args.duration, "rounds": args.rounds, "burn_ms": args.burns,
                   "router": not args.no_router, "target_p99_ms": args.target_p99_ms,
                   "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens, "seed": args.seed},
        "rows": [],
    }

    def report(args: argparse.Namespace, doc: dict[str, Any]) -> None:
        doc["fronts"] = medians(doc["rows"])
        doc["budget"] = budget(doc["fronts"], args.target_p99_ms)
        print(format_report(doc))
        finish(args, "budget", doc, plot, plot=bool(doc["rows"]))

    return run_reported(_run, args, doc, report, name="headrace bench budget")


async def _run(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    mock = mock_argv(0, args.max_tokens)
    with tempfile.TemporaryDirectory(prefix="headrace-budget-") as logdir:
        async with AsyncExitStack() as stack:
            mocks = await _start_all(stack, Path(logdir), [("mock0", mock), ("mock1", mock)])
            relay = relay_argv(mocks)
            fronts: list[tuple[str, float | None, list[str]]] = [
                ("relay", x, [*relay, "--burn-ms", f"{x:g}"]) for x in args.burns]
            if not args.no_router:
                fronts.append(("router", None, serve_argv(mocks)))
            for r in range(args.rounds):
                for i, (name, x, argv) in enumerate(fronts if r % 2 == 0 else fronts[::-1]):
                    row = await measure(args, name, x, argv, mocks[0], Path(logdir), i, r)
                    doc["rows"].append(row)


async def measure(args: argparse.Namespace, name: str, burn_ms: float | None, argv: list[str],
                  direct: Server, logdir: Path, i: int, r: int = 0) -> dict[str, Any]:
    """One front at ``--rps``, then the mock directly on the same schedule."""
    label = name if burn_ms is None else f"relay +{burn_ms:g} ms"
    spec = RequestSpec(model="mock", max_tokens=args.max_tokens, timeout=30.0)
    config = LoadConfig(rate=args.rps, duration=args.duration, seed=args.seed + r, prompt_tokens=args.prompt_tokens)
    async with AsyncExitStack() as stack:
        (front,) = await _start_all(stack, logdir, [(f"front{i}-{r}", argv)])
        if name == "router":
            await _ready(front.url, "/ready")
        before = front.cpu_seconds()
        routed = summarize_run(await run_rate(front.url, "2", spec, config, label=label, lean=True), label=label)
        cpu_s = front.cpu_seconds() - before
    straight = summarize_run(await run_rate(direct.url, "2", spec, config, label=f"direct (after {label})",
                                            lean=True), label="direct")
    ok = routed["counts"]["ok"]
    added = compare(routed, straight)["ttft_ms"]
    return {
        "front": name, "burn_ms": burn_ms, "label": label, "round": r,
        "cpu_ms_per_request": cpu_s * 1000 / ok if ok else None,
        "errors": routed["counts"]["errors"] + straight["counts"]["errors"],
        "added_ttft_p50": added["p50"]["delta"], "added_ttft_p99": added["p99"]["delta"],
        "routed": routed, "direct": straight,
    }


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per front, in the order first run: each number the median of
    its rounds' (those that have it), errors summed, each round's p99 kept."""
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        out.setdefault(row["label"], {"front": row["front"], "burn_ms": row["burn_ms"], "label": row["label"],
                                      "runs": []})["runs"].append(row)
    for front in out.values():
        runs = front.pop("runs")
        for key in ("cpu_ms_per_request", "added_ttft_p50", "added_ttft_p99"):
            known = [run[key] for run in runs if run[key] is not None]
            front[key] = statistics.median(known) if known else None
        front["errors"] = sum(run["errors"] for run in runs)
        front["rounds"] = len(runs)
        front["added_ttft_p99_by_round"] = [run["added_ttft_p99"] for run in runs]
    return list(out.values())


def budget(rows: list[dict[str, Any]], target_p99_ms: float) -> dict[str, Any]:
    """Where the relays' added TTFT p99 crosses ``target_p99_ms``, as CPU ms
    per request (linear between the two relays around the crossing), and the
    router's CPU per request beside it. ``cpu_ms_per_request`` is None when
    no relay was within the target; ``at_least`` is set when every relay was
    (the budget is then above the dearest one)."""
    points = sorted((r["cpu_ms_per_request"], r["added_ttft_p99"]) for r in rows
                    if r["front"] == "relay" and r["cpu_ms_per_request"] is not None
                    and r["added_ttft_p99"] is not None and not r["errors"])
    router = next((r for r in rows if r["front"] == "router"), None)
    out: dict[str, Any] = {"target_p99_ms": target_p99_ms, "cpu_ms_per_request": None, "at_least": False,
                           "router_cpu_ms_per_request": router["cpu_ms_per_request"] if router else None,
                           "router_added_ttft_p99": router["added_ttft_p99"] if router else None}
    within = [(c, p) for c, p in points if p <= target_p99_ms]
    if not within:
        return out
    # the dearest relay still within the target, and the cheapest one beyond it that costs more
    c0, p0 = max(within)
    beyond = [(c, p) for c, p in points if p > target_p99_ms and c > c0]
    if not beyond:
        out.update(cpu_ms_per_request=c0, at_least=True)
        return out
    c1, p1 = min(beyond)
    out["cpu_ms_per_request"] = c0 + (c1 - c0) * (target_p99_ms - p0) / (p1 - p0)
    return out


def format_report(doc: dict[str, Any]) -> str:
    cfg, cpu = doc["config"], doc["cpu"]
    lines = [f"CPU: {cpu.get('model')}, {cpu.get('cores')} cores ({' '.join(cpu.get('features') or []) or '-'})",
             f"bed: 2 x headrace mock --tpot-ms 0 --max-tokens {cfg['max_tokens']}; each front at "
             f"{cfg['rps']:g} req/s for {cfg['duration']:g} s, then the first mock directly", ""]
    head = (f"{'round':>5} {'front':<18} {'CPU ms/req':>10} {'added TTFT p50':>15} {'p99':>8} "
            f"{'routed p99':>11} {'direct p99':>11} {'errors':>7}")
    lines += [head, "-" * len(head)]
    for r in doc["rows"]:
        lines.append(f"{r.get('round', 0) + 1:>5} {r['label']:<18} {dash(r['cpu_ms_per_request'], '.3f'):>10} "
                     f"{dash(r['added_ttft_p50'], '+.2f'):>15} {dash(r['added_ttft_p99'], '+.2f'):>8} "
                     f"{dash(r['routed']['ttft_ms']['p99'], '.2f'):>11} "
                     f"{dash(r['direct']['ttft_ms']['p99'], '.2f'):>11} {r['errors']:>7}")
    fronts = doc.get("fronts") or medians(doc["rows"])
    if cfg.get("rounds", 1) > 1:
        head = f"{'median of rounds':<24} {'CPU ms/req':>10} {'added TTFT p50':>15} {'p99':>8}  p99 by round"
        lines += ["", head, "-" * (len(head) + 12)]
        for f in fronts:
            each = ", ".join(dash(v, "+.2f") for v in f["added_ttft_p99_by_round"])
            lines.append(f"{f['label']:<24} {dash(f['cpu_ms_per_request'], '.3f'):>10} "
                         f"{dash(f['added_ttft_p50'], '+.2f'):>15} {dash(f['added_ttft_p99'], '+.2f'):>8}  {each}")
    b = doc.get("budget") or budget(fronts, cfg["target_p99_ms"])
    lines.append("")
    if b["cpu_ms_per_request"] is None:
        lines.append(f"budget: no relay stayed within +{b['target_p99_ms']:g} ms at p99")
    else:
        more = "at least " if b["at_least"] else ""
        lines.append(f"budget for an added TTFT p99 <= {b['target_p99_ms']:g} ms: {more}"
                     f"{b['cpu_ms_per_request']:.3f} ms of CPU a request (a lower bound: the relays "
                     "spend it all before the first byte)")
    if b["router_cpu_ms_per_request"] is not None:
        lines.append(f"router: {b['router_cpu_ms_per_request']:.3f} ms a request, added TTFT p99 "
                     f"{dash(b['router_added_ttft_p99'], '+.2f')} ms")
    if doc.get("interrupted"):
        lines.append(f"(stopped early: {doc['interrupted']})")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str | Path) -> Path:
    from bench.plot import _figure, _save

    rounds = doc["config"].get("rounds", 1)
    fig, (ax,) = _figure(1, f"added TTFT against CPU per request, {doc['config']['rps']:g} req/s"
                            + (f" (medians of {rounds} rounds)" if rounds > 1 else ""))
    fronts = doc.get("fronts") or medians(doc["rows"])
    relays = sorted((f for f in fronts if f["front"] == "relay" and f["cpu_ms_per_request"] is not None),
                    key=lambda f: f["cpu_ms_per_request"])
    for q, style in (("p50", "o--"), ("p99", "o-")):
        ax.plot([f["cpu_ms_per_request"] for f in relays], [f[f"added_ttft_{q}"] for f in relays], style,
                label=f"null relay + burn, {q}")
    if rounds > 1:  # every run's p99, faint, for the spread
        runs = [r for r in doc["rows"] if r["cpu_ms_per_request"] is not None and r["added_ttft_p99"] is not None]
        ax.plot([r["cpu_ms_per_request"] for r in runs], [r["added_ttft_p99"] for r in runs], ".",
                color="grey", alpha=0.5, label="each run's p99")
    for f in fronts:
        if f["front"] == "router" and f["cpu_ms_per_request"] is not None:
            ax.plot([f["cpu_ms_per_request"]] * 2, [f["added_ttft_p50"], f["added_ttft_p99"]], "s",
                    color="crimson", label="headrace router (p50, p99)")
    ax.axhline(doc["config"]["target_p99_ms"], color="grey", linestyle=":", label="p99 target")
    ax.set_xlabel("front's CPU ms per request")
    ax.set_ylabel("added TTFT ms (front - direct)")
    ax.legend()
    return _save(fig, path)

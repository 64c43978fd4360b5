"""``headrace bench ab``: two router builds side by side, under the same load
at the same time, on one box.

    headrace bench ab --b /tmp/before                       # this checkout (A) against a worktree (B)
    headrace bench ab --b /tmp/before --tpot-ms 1 --rps 80  # tokens 1 ms apart: the per-token path
    git worktree add /tmp/before HEAD~3                     # how to get a B

On a shared box the CPU's speed drifts by 10-20% from one minute to the
next, so two builds measured one after the other differ by as much as the
change under test. Here each round starts, for each side, two ``headrace
mock`` and one ``headrace serve --workers 1`` run from that side's checkout,
then drives both routers at ``--rps`` (Poisson, the lean HTTP/2 client of
bench/loadgen.py) for ``--duration`` s, concurrently: whatever slows the
box slows both. The sides trade arrival schedules every round.

Per side and round: the router's CPU ms per answered request (its own CPU
time over the run), TTFT, inter-token gap and e2e percentiles, errors. The
summary gives each metric's median over the rounds and the B/A ratio of the
medians. Prints a table, writes JSON and a PNG (CPU per request and ITL p99
by round) under ``bench/results/``.

``--closed N`` loads each side with N connections back to back instead (the
closed loop of ``headrace bench router``: h2load or wrk when installed, over
``--http``), both sides at once: the router's CPU per request where many
requests are in flight, which an open loop at a modest rate does not reach.
Latencies are then not measured (the native clients report none).

    headrace bench ab --b /tmp/before --closed 16 --duration 10 --rounds 3
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import tempfile
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio

from backends.errors import ClientError
from bench.cli import add_output_args, finish, run_reported
from bench.client import RequestSpec
from bench.drivers import check_client, run_closed
from bench.loadgen import LoadConfig, run_rate
from bench.procs import cpu_info
from bench.report import dash, summarize_run
from bench.router_bench import _ready, _source, _start_all, mock_argv, serve_argv
from bench.schedule import make_prompt

__all__ = ["format_report", "main", "summarize"]

REPO = Path(__file__).resolve().parents[1]
SIDES = ("A", "B")
# (label, key in a side's row): the metrics of the table and the summary
METRICS = (
    ("router CPU ms / request", "cpu_ms_per_request"),
    ("TTFT p50 ms", "ttft_p50"), ("TTFT p99 ms", "ttft_p99"),
    ("ITL p50 ms", "itl_p50"), ("ITL p99 ms", "itl_p99"),
    ("e2e p99 ms", "e2e_p99"),
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="headrace bench ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", type=Path, default=None, metavar="DIR",
                   help="side A's source checkout (default: this one)")
    p.add_argument("--b", type=Path, required=True, metavar="DIR",
                   help="side B's source checkout, e.g. a git worktree of an older commit (or . with "
                        "--b-serve-args: this checkout, configured otherwise)")
    p.add_argument("--a-serve-args", default="", metavar="ARGS",
                   help="more `headrace serve` arguments for side A, e.g. '--set server.h2_ingress=\"lean\"'")
    p.add_argument("--b-serve-args", default="", metavar="ARGS", help="more `headrace serve` arguments for side B")
    p.add_argument("--rps", type=float, default=150.0, help="offered requests per second, to each side")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tpot-ms", type=float, default=0.0, help="the mocks' time per token")
    p.add_argument("--max-tokens", type=int, default=20, help="tokens (SSE chunks) per answer")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--closed", type=int, default=0, metavar="N",
                   help="closed loop: N connections a side back to back, instead of --rps")
    p.add_argument("--http", choices=("1.1", "2"), default="2", help="the closed loop's HTTP version")
    p.add_argument("--client", choices=("auto", "native", "python"), default="auto",
                   help="the closed loop's client: native (wrk, h2load), python, or native when installed")
    add_output_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if (args.rps <= 0 or args.duration <= 0 or args.rounds < 1 or args.max_tokens < 1 or args.tpot_ms < 0
            or args.closed < 0):
        raise ClientError("--rps and --duration > 0, --rounds and --max-tokens >= 1, --tpot-ms and --closed >= 0")
    if args.closed:
        check_client(args.client)
    doc: dict[str, Any] = {
        "kind": "ab", "cpu": cpu_info(),
        "config": {"rps": args.rps, "duration": args.duration, "rounds": args.rounds, "tpot_ms": args.tpot_ms,
                   "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens, "seed": args.seed,
                   "closed": args.closed, "http": args.http if args.closed else "2"},
        "sides": {"A": {**_side(args.a or REPO), "serve_args": args.a_serve_args},
                  "B": {**_side(args.b), "serve_args": args.b_serve_args}},
        "rounds": [],
    }

    def report(args: argparse.Namespace, doc: dict[str, Any]) -> None:
        doc["summary"] = summarize(doc["rounds"])
        print(format_report(doc))
        finish(args, "ab", doc, plot, plot=bool(doc["rounds"]))

    return run_reported(_run, args, doc, report, name="headrace bench ab")


async def _run(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory(prefix="headrace-ab-") as logdir:
        for i in range(args.rounds):
            doc["rounds"].append(await one_round(args, i, Path(logdir)))


async def one_round(args: argparse.Namespace, i: int, logdir: Path) -> dict[str, Any]:
    """Both sides' beds, loaded at once; a row per side."""
    mock = mock_argv(args.tpot_ms, args.max_tokens)
    spec = RequestSpec(model="mock", max_tokens=args.max_tokens, timeout=60.0)
    async with AsyncExitStack() as stack:
        routers = {}
        extra = {"A": shlex.split(args.a_serve_args), "B": shlex.split(args.b_serve_args)}
        for side, src in zip(SIDES, (args.a, args.b), strict=True):
            mocks = await _start_all(stack, logdir, [(f"{side}{i}-mock0", mock), (f"{side}{i}-mock1", mock)])
            (routers[side],) = await _start_all(stack, logdir, [(f"{side}{i}-router", serve_argv(mocks) + extra[side])],
                                                cwd={f"{side}{i}-router": src})
            await _ready(routers[side].url, "/ready")
        cpu = {side: r.cpu_seconds() for side, r in routers.items()}
        runs: dict[str, Any] = {}

        async def load(side: str, seed: int) -> None:
            config = LoadConfig(rate=args.rps, duration=args.duration, seed=seed, prompt_tokens=args.prompt_tokens)
            runs[side] = await run_rate(routers[side].url, "2", spec, config, label=f"round {i + 1} {side}", lean=True)

        async def closed(side: str, seed: int) -> None:
            runs[side] = await run_closed(routers[side].url, args.http, client=args.client, spec=spec,
                                          prompt=make_prompt(seed, 0, args.prompt_tokens),
                                          body_file=logdir / f"body-{side}{i}.json", concurrency=args.closed,
                                          duration=args.duration, label=f"round {i + 1} {side}")

        async with trio.open_nursery() as nursery:
            for k, side in enumerate(SIDES):
                nursery.start_soon(closed if args.closed else load, side, args.seed + (i + k) % 2)  # the sides trade schedules each round
        cpu = {side: r.cpu_seconds() - cpu[side] for side, r in routers.items()}
    if args.closed:
        return {side: _closed_row(runs[side], cpu[side]) for side in SIDES}
    return {side: _row(summarize_run(runs[side], label=side), cpu[side]) for side in SIDES}


def _side(path: Path) -> dict[str, str]:
    """A side's checkout: its path and commit, ``+changes`` when it has uncommitted ones."""
    side = _source(path) or {"path": str(path), "commit": ""}
    done = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
                          capture_output=True, text=True, check=False)
    if done.stdout.strip():
        side["commit"] += "+changes"
    return side


def _row(run: dict[str, Any], cpu_s: float) -> dict[str, Any]:
    ok = run["counts"]["ok"]
    return {
        "ok": ok, "errors": run["counts"]["errors"],
        "cpu_ms_per_request": cpu_s * 1000 / ok if ok else None,
        "ttft_p50": run["ttft_ms"].get("p50"), "ttft_p99": run["ttft_ms"].get("p99"),
        "itl_p50": run["itl_ms"].get("p50"), "itl_p99": run["itl_ms"].get("p99"),
        "e2e_p99": run["e2e_ms"].get("p99"),
        "run": run,
    }


def _closed_row(run: dict[str, Any], cpu_s: float) -> dict[str, Any]:
    """A closed-loop side: CPU per request and errors (the clients time nothing)."""
    ok = run["ok"]
    return {
        "ok": ok, "errors": sum(run["errors"].values()),
        "cpu_ms_per_request": cpu_s * 1000 / ok if ok else None,
        **{key: None for _, key in METRICS[1:]},
        "run": run,
    }


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each metric's median over the rounds, per side, and B / A."""
    out: dict[str, Any] = {}
    for _, key in METRICS:
        medians = {}
        for side in SIDES:
            values = [r[side][key] for r in rounds if r[side][key] is not None]
            medians[side] = statistics.median(values) if values else None
        a, b = medians["A"], medians["B"]
        out[key] = {**medians, "b_over_a": b / a if a and b is not None else None}
    out["errors"] = {side: sum(r[side]["errors"] for r in rounds) for side in SIDES}
    return out


def _name(side: dict[str, str] | None) -> str:
    return "?" if not side else side.get("commit") or side.get("path") or "?"


def format_report(doc: dict[str, Any]) -> str:
    cfg, sides = doc["config"], doc["sides"]
    lines = [f"CPU: {doc['cpu'].get('model')} ({doc['cpu'].get('cores')} cores)",
             f"A: {_name(sides['A'])}  B: {_name(sides['B'])}",
             f"each side: 2 mocks (--tpot-ms {cfg['tpot_ms']:g}, {cfg['max_tokens']} tokens), 1 router worker, "
             + (f"{cfg['closed']} connections back to back (HTTP/{cfg.get('http', '2')})" if cfg.get("closed")
                else f"{cfg['rps']:g} req/s")
             + f" for {cfg['duration']:g} s, both at once; {len(doc['rounds'])} round(s)", ""]
    head = f"{'metric':<26}" + "".join(f"{'r' + str(i + 1) + ' A':>10}{'B':>9}" for i in range(len(doc["rounds"])))
    lines += [head + f"{'median A':>11}{'median B':>10}{'B/A':>7}", "-" * (len(head) + 28)]
    summary = doc.get("summary") or summarize(doc["rounds"])
    for label, key in METRICS:
        cells = "".join(f"{dash(r['A'][key], '.2f'):>10}{dash(r['B'][key], '.2f'):>9}" for r in doc["rounds"])
        s = summary[key]
        lines.append(f"{label:<26}{cells}{dash(s['A'], '.2f'):>11}{dash(s['B'], '.2f'):>10}{dash(s['b_over_a'], '.2f'):>7}")
    lines.append(f"errors: A {summary['errors']['A']}, B {summary['errors']['B']}")
    if doc.get("interrupted"):
        lines.append(f"(stopped early: {doc['interrupted']})")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str | Path) -> Path:
    from bench.plot import _figure, _save

    fig, axes = _figure(2, f"headrace bench ab: A {_name(doc['sides']['A'])} vs B {_name(doc['sides']['B'])}")
    rounds = range(1, len(doc["rounds"]) + 1)
    for ax, (label, key) in zip(axes, (METRICS[0], METRICS[4]), strict=True):
        for side, marker in zip(SIDES, ("o", "s"), strict=True):
            ax.plot(list(rounds), [r[side][key] for r in doc["rounds"]], marker=marker, label=side)
        ax.set_xlabel("round")
        ax.set_ylabel(label)
        ax.set_xticks(list(rounds))
        ax.legend()
    return _save(fig, path)

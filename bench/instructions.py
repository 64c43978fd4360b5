"""``headrace bench instructions``: the router's instructions per streamed
request, counted by valgrind's callgrind, for this checkout and another.

    headrace bench instructions                      # this checkout
    headrace bench instructions --b /tmp/before      # against a worktree of an older commit
    git worktree add /tmp/before HEAD~3              # how to get a B
    headrace bench instructions --b-serve-args "--policy round_robin"   # what a feature costs
    headrace bench instructions --b-front null       # against the null relay (bench/null_relay.py)

CPU time per request drifts by 10-20% from one minute to the next on a
shared box: ``headrace bench ab`` loads both builds at once to cancel that
and still needs several rounds to tell 5% apart. Instructions executed do
not drift: two runs of one build agree within ~0.5% at the default 400
requests (a few percent over a few dozen, where one cyclic garbage
collection weighs more), so a change that saves 1% of the router's work
shows in one run. Instructions are not time
(cache misses, branch mispredictions and the kernel's side of a syscall
are not counted): this says whether a change does less work, and ``bench
ab`` or ``bench router`` whether it is faster. The counting slows the
router about 40 times; the load is a closed loop, so nothing queues.

Per side and round: two ``headrace mock`` (run natively) and one ``headrace
serve --workers 1`` from that side's checkout under ``valgrind
--tool=callgrind --instr-atstart=no``; ``--warmup`` s of load uncounted
(imports, caches, the first connections), then counting on
(``callgrind_control -i on``), ``--requests`` requests over
``--concurrency`` connections back to back (the lean HTTP/2 client, or
httpx over HTTP/1.1: a fixed count, so that no request is cut at the
window's edges), counting off and a dump. The instructions of the router's
main thread (the event loop: every request's work; its worker threads only
trim the heap and write batches) over that window, divided by the requests
it answered. Its background work in the window (health probes, timers) is
counted too, a fraction of a percent. Prints a table, writes JSON and a
PNG under ``bench/results/``. Needs valgrind (``apt-get install valgrind``).
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio

from backends.errors import BackendUnavailable, ClientError
from bench.ab import REPO, SIDES, _name, _side
from bench.cli import add_output_args, finish, run_reported
from bench.client import RequestResult, RequestSpec, send_request
from bench.drivers import closed_client
from bench.procs import cpu_info
from bench.progress import ProgressBar
from bench.relay_budget import relay_argv
from bench.report import dash
from bench.router_bench import _ready, _start_all, mock_argv, serve_argv
from bench.schedule import make_prompt

__all__ = ["available", "format_report", "main", "read_total", "summarize"]


def available() -> bool:
    """valgrind and callgrind_control on PATH."""
    return shutil.which("valgrind") is not None and shutil.which("callgrind_control") is not None


def valgrind_version() -> str:
    done = subprocess.run(["valgrind", "--version"], capture_output=True, text=True, check=False)
    return done.stdout.strip()


def read_total(text: bytes) -> int | None:
    """The instruction total of a callgrind dump (its ``totals:`` line, else
    ``summary:``), or None when it has neither (not written through yet)."""
    totals = dict(re.findall(rb"^(totals|summary):\s*(\d+)", text, re.MULTILINE))
    value = totals.get(b"totals", totals.get(b"summary"))
    return int(value) if value is not None else None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="headrace bench instructions", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", type=Path, default=None, metavar="DIR", help="side A's source checkout (default: this one)")
    p.add_argument("--b", type=Path, default=None, metavar="DIR",
                   help="side B's source checkout, e.g. a git worktree of an older commit (default: none, "
                        "or this one with --b-serve-args or --b-front)")
    p.add_argument("--serve-args", default="", metavar="ARGS",
                   help="more `headrace serve` arguments for both sides, e.g. \"--set retry.budget=0\"")
    p.add_argument("--b-serve-args", default="", metavar="ARGS", help="more `headrace serve` arguments for side B")
    p.add_argument("--b-front", choices=("router", "null"), default="router",
                   help="null: side B is bench/null_relay.py (the least a router on this stack does)")
    p.add_argument("--requests", type=int, default=400, help="requests counted per side and round")
    p.add_argument("--warmup", type=int, default=100, help="requests sent uncounted first")
    p.add_argument("--concurrency", type=int, default=4, help="connections back to back")
    p.add_argument("--rounds", type=int, default=1, help="rounds (each side once a round, A first)")
    p.add_argument("--tpot-ms", type=float, default=0.0, help="the mocks' time per token")
    p.add_argument("--max-tokens", type=int, default=20, help="tokens (SSE chunks) per answer")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--http", choices=("1.1", "2"), default="2")
    add_output_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.requests < 1 or args.warmup < 0 or args.concurrency < 1 or args.rounds < 1 or args.max_tokens < 1 \
            or args.tpot_ms < 0:
        raise ClientError("--requests, --concurrency, --rounds and --max-tokens >= 1, --warmup and --tpot-ms >= 0")
    if not available():
        raise ClientError("headrace bench instructions needs valgrind (apt-get install valgrind)")
    b = args.b if args.b is not None else REPO if args.b_serve_args or args.b_front != "router" else None
    sides = {"A": args.a or REPO, **({"B": b} if b is not None else {})}
    fronts = {"A": ("router", shlex.split(args.serve_args)),
              "B": (args.b_front, shlex.split(args.serve_args) + shlex.split(args.b_serve_args))}
    doc: dict[str, Any] = {
        "kind": "instructions", "cpu": cpu_info(), "valgrind": valgrind_version(),
        "config": {"requests": args.requests, "warmup": args.warmup, "concurrency": args.concurrency,
                   "rounds": args.rounds, "tpot_ms": args.tpot_ms, "max_tokens": args.max_tokens,
                   "prompt_tokens": args.prompt_tokens, "seed": args.seed, "http": args.http},
        "sides": {side: {**_side(path), "front": fronts[side][0], "serve_args": fronts[side][1]}
                  for side, path in sides.items()},
        "rounds": [],
    }

    def report(args: argparse.Namespace, doc: dict[str, Any]) -> None:
        doc["summary"] = summarize(doc["rounds"])
        print(format_report(doc))
        finish(args, "instructions", doc, plot, plot=bool(doc["rounds"]))

    async def run(args: argparse.Namespace, doc: dict[str, Any]) -> None:
        with tempfile.TemporaryDirectory(prefix="headrace-instructions-") as logdir:
            for i in range(args.rounds):
                row: dict[str, Any] = {}
                doc["rounds"].append(row)
                for side, path in sides.items():
                    row[side] = await measure(args, path, *fronts[side], Path(logdir), f"round {i + 1} {side}",
                                              f"{side}{i}")

    return run_reported(run, args, doc, report, name="headrace bench instructions")


async def measure(args: argparse.Namespace, src: Path, front: str, serve_args: list[str], logdir: Path, label: str,
                  tag: str) -> dict[str, Any]:
    """One side's bed, its router (or the null relay) counted over ``--requests`` requests."""
    out = logdir / f"{tag}.callgrind"
    valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
                f"--callgrind-out-file={out}"]
    spec = RequestSpec(model="mock", max_tokens=args.max_tokens, timeout=120.0)
    prompt = make_prompt(args.seed, 0, args.prompt_tokens)
    mock = mock_argv(args.tpot_ms, args.max_tokens)

    async def load(requests: int, what: str) -> dict[str, Any]:
        return await closed_count(router.url, args.http, spec, prompt, concurrency=args.concurrency,
                                  requests=requests, label=f"{label} {what}")

    print(f"{label}: starting the {front} under callgrind ({src} {' '.join(serve_args)})", file=sys.stderr)
    async with AsyncExitStack() as stack:
        mocks = await _start_all(stack, logdir, [(f"{tag}-mock0", mock), (f"{tag}-mock1", mock)])
        argv = relay_argv(mocks) if front == "null" else serve_argv(mocks) + serve_args
        (router,) = await _start_all(stack, logdir, [(f"{tag}-{front}", valgrind + argv)], cwd={f"{tag}-{front}": src})
        await _ready(router.url, "/v1/models" if front == "null" else "/ready", patience=120.0)
        if args.warmup > 0:
            await load(args.warmup, "warm-up")
        await _control(router.pid, "-i", "on")
        run = await load(args.requests, "counted")
        await _control(router.pid, "-i", "off")
        await _control(router.pid, "-d")
        total = await _dumped(out)
    ok = run["ok"]
    return {"ok": ok, "errors": sum(run["errors"].values()), "instructions": total,
            "per_request": total / ok if ok else None}


async def closed_count(url: str, http: str, spec: RequestSpec, prompt: str, *, concurrency: int, requests: int,
                       label: str) -> dict[str, Any]:
    """``requests`` requests over ``concurrency`` connections back to back."""
    client = closed_client(url, http, concurrency, spec.timeout)
    results: list[RequestResult] = []
    progress = ProgressBar(label)
    start = trio.current_time()
    sent = 0

    async def worker() -> None:
        nonlocal sent
        while sent < requests:
            sent += 1
            results.append(await send_request(client, spec, prompt, index=sent, start=trio.current_time(),
                                              run_start=start))
            progress.update(len(results) / requests, f"{len(results)}/{requests}", trio.current_time())

    async with client, trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    progress.close(f"{len(results)}/{requests} in {trio.current_time() - start:.1f}s")
    return {"ok": sum(r.ok for r in results), "errors": Counter(r.error for r in results if r.error)}


async def _control(pid: int, *command: str) -> None:
    done = await trio.run_process(["callgrind_control", *command, str(pid)], capture_stdout=True,
                                  capture_stderr=True, check=False)
    if done.returncode != 0:
        raise BackendUnavailable(f"callgrind_control {' '.join(command)} {pid} failed: "
                                 f"{(done.stdout + done.stderr).decode(errors='replace').strip()}")


async def _dumped(out: Path, patience: float = 60.0) -> int:
    """The main thread's total in the first dump (``OUT.<pid>.1-01``), once written through."""
    path = out.with_name(out.name + ".1-01")
    with trio.move_on_after(patience):
        while True:
            total = read_total(path.read_bytes()) if path.exists() else None
            if total is not None:
                return total
            await trio.sleep(0.1)
    raise BackendUnavailable(f"callgrind wrote no dump to {path} within {patience:g} s")


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per side: the median instructions per request over the rounds and their
    spread ((max - min) / median); B / A when there is a B."""
    out: dict[str, Any] = {}
    for side in SIDES:
        values = [r[side]["per_request"] for r in rounds if side in r and r[side]["per_request"] is not None]
        if values:
            median = statistics.median(values)
            out[side] = {"per_request": median, "spread": (max(values) - min(values)) / median,
                         "errors": sum(r[side]["errors"] for r in rounds if side in r)}
    if "A" in out and "B" in out:
        out["b_over_a"] = out["B"]["per_request"] / out["A"]["per_request"]
    return out


def format_report(doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    lines = [f"CPU: {doc['cpu'].get('model')} ({doc['cpu'].get('cores')} cores); {doc.get('valgrind', '')} callgrind",
             f"each side: 2 mocks (--tpot-ms {cfg['tpot_ms']:g}, {cfg['max_tokens']} tokens), 1 router worker, "
             f"its main thread counted over {cfg['requests']} requests on {cfg['concurrency']} connections "
             f"back to back (HTTP/{cfg['http']}) after {cfg['warmup']} uncounted; {len(doc['rounds'])} round(s)", ""]
    sides = [s for s in SIDES if s in doc["sides"]]
    head = f"{'side':<6}{'build':<22}" + "".join(f"{'r' + str(i + 1):>12}" for i in range(len(doc["rounds"])))
    lines += [head + f"{'median':>12}{'spread':>9}{'requests':>10}{'errors':>8}", "-" * (len(head) + 39)]
    summary = doc.get("summary") or summarize(doc["rounds"])
    for side in sides:
        rows = [r[side] for r in doc["rounds"] if side in r]
        cells = "".join(f"{_millions(r['per_request']):>12}" for r in rows)
        s = summary.get(side, {})
        spread = f"{100 * s['spread']:.2f}%" if s else "-"
        lines.append(f"{side:<6}{_build(doc['sides'][side])[:21]:<22}{cells}{_millions(s.get('per_request')):>12}"
                     f"{spread:>9}{sum(r['ok'] for r in rows):>10}{sum(r['errors'] for r in rows):>8}")
    lines.append("(instructions per request, millions)")
    lines += [f"{side}: {_build(doc['sides'][side])} {' '.join(doc['sides'][side].get('serve_args') or [])}".rstrip()
              for side in sides if doc["sides"][side].get("serve_args")]
    if "b_over_a" in summary:
        lines.append(f"B/A: {summary['b_over_a']:.4f}")
    if doc.get("interrupted"):
        lines.append(f"(stopped early: {doc['interrupted']})")
    return "\n".join(lines)


def _build(side: dict[str, Any]) -> str:
    return f"null relay {_name(side)}" if side.get("front") == "null" else _name(side)


def _millions(value: float | None) -> str:
    return dash(value / 1e6 if value is not None else None, ".3f")


def plot(doc: dict[str, Any], path: str | Path) -> Path:
    from bench.plot import _figure, _save

    fig, (ax,) = _figure(1, "headrace bench instructions:\nthe router's instructions per request")  # two lines: one was cut at the figure's width
    for side, marker in zip(SIDES, ("o", "s"), strict=True):
        points = [(i + 1, r[side]["per_request"] / 1e6) for i, r in enumerate(doc["rounds"])
                  if side in r and r[side]["per_request"] is not None]
        if points:
            ax.plot([x for x, _ in points], [y for _, y in points], marker=marker, linestyle="",
                    label=f"{side}: {_build(doc['sides'][side])}")
    ax.set_xlabel("round")
    ax.set_ylabel("instructions per request (millions)")
    ax.set_xticks(list(range(1, len(doc["rounds"]) + 1)))
    ax.legend()
    return _save(fig, path)

"""``python -m bench.engine_paths``: the engine's kernel paths side by side, before and
after a change, in one run.

For each checkout (``--checkout LABEL=DIR``: a ``git worktree`` of an older commit,
and ``.``) and each path (:data:`PATHS`: native bfloat16, native bfloat16 with the
AMX kernels off, the torch path in bfloat16 (``HEADRACE_NATIVE=0``), float32, each
with and without ``--no-batch-invariant`` where the checkout has that flag), it starts
``headrace engine`` on the default model from that checkout, reads its idle resident
memory, runs ``headrace bench engine`` at ``--concurrency`` levels (closed loop,
``--max-tokens`` greedy tokens per request), reads the resident memory again, and
stops it. Runs are interleaved checkout by checkout within a path, so the box's noise
falls on both sides of a pair alike: quote the ratios.

Prints a table, writes one bench-engine JSON per run (``bench.tables`` can quote them)
and a summary JSON with the CPU record.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import trio

from bench.procs import cpu_info, start_server

__all__ = ["PATHS", "KernelPath", "main"]


@dataclass(frozen=True)
class KernelPath:
    name: str
    env: dict[str, str]
    flags: tuple[str, ...]
    needs: str = ""  # a flag the checkout's `headrace engine --help` must list


PATHS: tuple[KernelPath, ...] = (
    KernelPath("native bf16", {}, ("--dtype", "bfloat16")),
    KernelPath("native bf16, no AMX", {"HEADRACE_NATIVE_AMX": "0"}, ("--dtype", "bfloat16")),
    KernelPath("torch bf16", {"HEADRACE_NATIVE": "0"}, ("--dtype", "bfloat16")),
    KernelPath("float32", {}, ("--dtype", "float32")),
    KernelPath("native bf16, --no-batch-invariant", {}, ("--dtype", "bfloat16", "--no-batch-invariant"),
          needs="--no-batch-invariant"),
    KernelPath("torch bf16, --no-batch-invariant", {"HEADRACE_NATIVE": "0"},
          ("--dtype", "bfloat16", "--no-batch-invariant"), needs="--no-batch-invariant"),
    KernelPath("float32, --no-batch-invariant", {}, ("--dtype", "float32", "--no-batch-invariant"),
          needs="--no-batch-invariant"),
)


def _rss(pid: int) -> int:
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return 0


def _commit(checkout: Path) -> str:
    """The checkout's commit, ``+dirty`` where its tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(checkout), *args], capture_output=True,
                              text=True, check=False).stdout.strip()
    return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "-uno") else "")


def _has_flag(python: str, checkout: Path, flag: str) -> bool:
    out = subprocess.run([python, "-m", "router.cli", "engine", "--help"], cwd=checkout,
                         capture_output=True, text=True, check=False)
    return flag in out.stdout


async def _one(label: str, checkout: Path, path: KernelPath, args: argparse.Namespace,
               outdir: Path) -> dict[str, object]:
    python = sys.executable
    server = await start_server(
        f"engine-{label}-{path.name}".replace(" ", "_").replace(",", ""),
        [python, "-m", "router.cli", "engine", "--port", "0", *path.flags,
         *(["--model", str(args.model)] if args.model else [])],
        outdir, patience=300.0, cwd=checkout, env={**path.env, "PYTHONPATH": str(checkout)})
    try:
        await trio.sleep(args.settle)
        idle = _rss(server.pid)
        slug = f"{label}_{path.name}".replace(" ", "_").replace(",", "").replace("--", "")
        out = outdir / f"engine_{slug}.json"
        cmd = [python, "-m", "bench.engine_bench", "--target", server.url,
               "--max-tokens", str(args.max_tokens), "--prompt-tokens", str(args.prompt_tokens),
               "--duration", str(args.duration), "--warmup", str(args.warmup),
               "--temperature", "0", "--endpoint", "chat", "--concurrency", *map(str, args.concurrency),
               "--json", str(out), "--no-plot",
               "--server", f"{' '.join(f'{k}={v}' for k, v in path.env.items())} "
                           f"headrace engine {' '.join(path.flags)} ({label})".strip()]
        done = await trio.run_process(cmd, capture_stdout=True, capture_stderr=True, check=False)
        loaded = _rss(server.pid)
        if done.returncode != 0:
            raise RuntimeError(f"bench failed for {label} / {path.name}:\n"
                               f"{done.stderr.decode(errors='replace')[-2000:]}")
        report = json.loads(out.read_text())
    finally:
        await server.stop()
    levels = {str(lv["concurrency"]): lv["aggregate_tok_s"] for lv in report["levels"]}
    return {"checkout": label, "path": path.name, "idle_rss": idle, "loaded_rss": loaded,
            "tok_s": levels, "json": str(out)}


def _table(rows: list[dict[str, object]], levels: list[int]) -> str:
    head = f"{'path':<36} {'checkout':<10} " + " ".join(f"{'c=' + str(c):>8}" for c in levels)
    lines = [head + f" {'idle RSS':>9} {'loaded':>8}"]
    for r in rows:
        tok = r["tok_s"]
        assert isinstance(tok, dict)
        cells = " ".join(f"{tok.get(str(c), float('nan')):>8.1f}" for c in levels)
        lines.append(f"{r['path']!s:<36} {r['checkout']!s:<10} {cells} "
                     f"{int(r['idle_rss']) / 1e9:>8.2f}G {int(r['loaded_rss']) / 1e9:>7.2f}G")  # type: ignore[call-overload]
    return "\n".join(lines)


async def _run(args: argparse.Namespace) -> int:
    checkouts, outdir = args.checkouts, args.outdir
    wanted = [p for p in PATHS if not args.path or p.name in args.path]
    plan = [(label, where, p) for p in wanted for label, where in checkouts
            if not p.needs or _has_flag(sys.executable, where, p.needs)]
    rows: list[dict[str, object]] = []
    started = time.monotonic()
    for i, (label, where, path) in enumerate(plan, 1):
        print(f"[{i}/{len(plan)} {time.monotonic() - started:5.0f} s] {path.name} / {label} ...",
              flush=True)
        row = await _one(label, where, path, args, outdir)
        tok = row["tok_s"]
        print(f"    tok/s {tok}, idle RSS {int(row['idle_rss']) / 1e9:.2f} GB, "  # type: ignore[call-overload]
              f"after load {int(row['loaded_rss']) / 1e9:.2f} GB", flush=True)  # type: ignore[call-overload]
        rows.append(row)
    print()
    print(_table(rows, args.concurrency))
    cpu = cpu_info()
    cpu.pop("flags", None)
    summary = {"kind": "engine_paths", "cpu": cpu, "command": " ".join(sys.argv),
               "rows": rows, "checkouts": {lb: str(w) for lb, w in checkouts},
               "commits": {lb: _commit(w) for lb, w in checkouts}}
    (outdir / "engine_paths.json").write_text(json.dumps(summary, indent=2))
    print(f"\nCPU: {cpu['model']} ({cpu['cores']} cores; {', '.join(cpu['features'])})")  # type: ignore[arg-type]
    print(f"wrote {outdir / 'engine_paths.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine_paths", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkout", action="append", default=[],
                   help="LABEL=DIR, a checkout to run `headrace engine` from (repeatable)")
    p.add_argument("--path", action="append", default=[], help="only these paths (names)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--duration", type=float, default=15.0)
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--settle", type=float, default=3.0, help="seconds idle before the RSS read")
    p.add_argument("--model", help="GGUF file or Hugging Face folder for every engine (default: the engine's)")
    p.add_argument("--results-dir", default="bench/results/issue19/paths")
    args = p.parse_args(argv)
    args.checkouts = []
    for spec in args.checkout or ["HEAD=."]:
        label, _, where = spec.partition("=")
        args.checkouts.append((label, Path(where or ".").resolve()))
    args.outdir = Path(args.results_dir)
    args.outdir.mkdir(parents=True, exist_ok=True)
    return trio.run(_run, args)


if __name__ == "__main__":
    raise SystemExit(main())

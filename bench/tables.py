"""``python -m bench.tables``: the benchmark tables of README.md and bench/README.md,
generated from the committed benchmark JSON so that they cannot drift from it.

Each table lives between two marker comments in a Markdown file::

    <!-- bench:engine -->
    ...generated, do not edit...
    <!-- /bench:engine -->

and is rendered from the JSON files :data:`TABLES` names (paths relative to the
repository root), each row with the machine that produced it (CPU model, cores and
the features a reader compares by, from ``bench.procs.cpu_info``) and the commands
(the bench's own, and the server's as given with ``--server``). A JSON without that
CPU record is an error, never a row of numbers of unknown origin.

``python -m bench.tables`` rewrites the marked tables in place; ``--check`` only
compares and exits 1 (naming the tables) where a file differs from what the JSON
gives. ``tests/bench/test_tables.py`` runs the check, so a stale table fails the tests.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TABLES", "Row", "Table", "TablesError", "main", "render", "rewrite"]

ROOT = Path(__file__).resolve().parent.parent


class TablesError(Exception):
    """A benchmark JSON or a marked file cannot give its table."""


@dataclass(frozen=True)
class Row:
    label: str
    path: str  # JSON, relative to the repository root


@dataclass(frozen=True)
class Table:
    name: str  # the marker: <!-- bench:NAME -->
    kind: str  # the JSON's "kind"
    rows: tuple[Row, ...]
    levels: tuple[int, ...]  # the concurrencies quoted


_ISSUE19 = "bench/results/issue19"

_PATHS = f"{_ISSUE19}/paths"
_BEFORE, _AFTER = "before issue 19 (7a39462)", "after (b899d86)"

TABLES: dict[str, Table] = {
    "engine": Table(
        name="engine",
        kind="engine",
        # `python -m bench.engine_paths --checkout before=WORKTREE --checkout after=.`: every
        # kernel path, the two builds interleaved path by path, one run on a quiet box
        rows=(
            Row(f"native bf16 (the default), {_BEFORE}", f"{_PATHS}/engine_before_native_bf16.json"),
            Row(f"native bf16 (the default), {_AFTER}", f"{_PATHS}/engine_after_native_bf16.json"),
            Row(f"native bf16 without AMX, {_BEFORE}", f"{_PATHS}/engine_before_native_bf16_no_AMX.json"),
            Row(f"native bf16 without AMX, {_AFTER}", f"{_PATHS}/engine_after_native_bf16_no_AMX.json"),
            Row(f"torch bf16, {_BEFORE}", f"{_PATHS}/engine_before_torch_bf16.json"),
            Row(f"torch bf16, {_AFTER}", f"{_PATHS}/engine_after_torch_bf16.json"),
            Row(f"float32, {_BEFORE}", f"{_PATHS}/engine_before_float32.json"),
            Row(f"float32, {_AFTER}", f"{_PATHS}/engine_after_float32.json"),
            Row(f"native bf16, --no-batch-invariant, {_AFTER}",
                f"{_PATHS}/engine_after_native_bf16_no-batch-invariant.json"),
            Row(f"torch bf16, --no-batch-invariant, {_AFTER}",
                f"{_PATHS}/engine_after_torch_bf16_no-batch-invariant.json"),
            Row(f"float32, --no-batch-invariant, {_AFTER}",
                f"{_PATHS}/engine_after_float32_no-batch-invariant.json"),
        ),
        levels=(1, 16),
    ),
}

# Where each table is written (a table may appear in several files).
FILES: dict[str, tuple[str, ...]] = {
    "README.md": ("engine",),
    "bench/README.md": ("engine",),
}

# Arguments of the recorded bench command that say where it ran or wrote, or that the
# server column shows.
_LOCAL_ARGS = {"--target", "--json", "--plot", "--results-dir", "--server"}
_LOCAL_FLAGS = {"--no-plot"}


def _load(root: Path, row: Row, kind: str) -> dict[str, Any]:
    path = root / row.path
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TablesError(f"{row.path}: cannot read the benchmark JSON: {exc}") from exc
    if doc.get("kind") != kind:
        raise TablesError(f"{row.path}: kind {doc.get('kind')!r}, expected {kind!r}")
    cpu = doc.get("cpu")
    if not isinstance(cpu, dict) or not cpu.get("model") or "features" not in cpu:
        raise TablesError(
            f"{row.path}: no CPU record (cpu.model and cpu.features): the table cannot say "
            "which machine produced these numbers; rerun the bench (it records them)"
        )
    if not doc.get("command"):
        raise TablesError(f"{row.path}: no bench command recorded")
    return doc  # type: ignore[no-any-return]


def _machine(cpu: dict[str, Any]) -> str:
    features = ", ".join(cpu["features"]) or "none of the notable ones"
    cores = f"{cpu['cores']} cores; " if cpu.get("cores") else ""
    return f"{cpu['model']} ({cores}{features})"


def _bench_command(command: str) -> str:
    words, out, skip = shlex.split(command), [], False
    for word in words:
        if skip:
            skip = False
        elif word in _LOCAL_ARGS:
            skip = True
        elif word.split("=", 1)[0] in _LOCAL_ARGS or word in _LOCAL_FLAGS:
            continue
        else:
            out.append(word)
    return shlex.join(out)


def _level(doc: dict[str, Any], c: int, path: str) -> dict[str, Any]:
    for lv in doc["levels"]:
        if lv["concurrency"] == c:
            return lv  # type: ignore[no-any-return]
    raise TablesError(f"{path}: no level at concurrency {c}")


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(table: Table, root: Path = ROOT) -> str:
    """The table's Markdown (without the markers)."""
    docs = [(row, _load(root, row, table.kind)) for row in table.rows]
    cs = " / ".join(map(str, table.levels))
    lines = [
        f"| {table.kind} | server | tok/s at c = {cs} | c=1 per stream p50 | "
        f"TTFT p50 at c = {cs} (ms) | errors | machine |",
        "|---|---|---|---|---|---|---|",
    ]
    machines: dict[str, int] = {}
    notes: list[str] = []
    for i, (row, doc) in enumerate(docs, 1):
        levels = [_level(doc, c, row.path) for c in table.levels]
        tok = " / ".join(_num(lv["aggregate_tok_s"]) for lv in levels)
        ttft = " / ".join(_num(lv["ttft_ms"].get("p50"), 0) for lv in levels)
        errors = sum(lv["requests"] - lv["ok"] for lv in levels)
        one = next((lv for lv in doc["levels"] if lv["concurrency"] == 1), None)
        stream = _num(one["per_stream_tok_s"].get("p50")) if one else "-"
        machine = _machine(doc["cpu"])
        m = machines.setdefault(machine, len(machines) + 1)
        server = f"`{doc['server']}`" if doc.get("server") else "-"
        lines.append(f"| {row.label} [{i}] | {server} | {tok} | {stream} | {ttft} | {errors} "
                     f"| M{m} |")
        req = doc.get("request", {})
        notes.append(
            f"[{i}] `{row.path}`: `{_bench_command(doc['command'])}` ({req.get('endpoint')}, "
            f"{req.get('workload')} prompts of ~{req.get('prompt_tokens')} tokens, "
            f"{req.get('max_tokens')} tokens per request)"
        )
    lines.append("")
    lines += [f"- M{m}: {machine}" for machine, m in machines.items()]
    lines += [f"- {note}" for note in notes]
    return "\n".join(lines)


def _marked(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- bench:{re.escape(name)} -->\n)(.*?)(<!-- /bench:{re.escape(name)} -->)",
                      re.S)


def rewrite(text: str, name: str, body: str, where: str = "") -> str:
    """``text`` with the table ``name``'s marked span replaced by ``body``."""
    pattern = _marked(name)
    if len(pattern.findall(text)) != 1:
        raise TablesError(f"{where}: expected one <!-- bench:{name} --> ... "
                          f"<!-- /bench:{name} --> span")
    generated = ("<!-- generated by `python -m bench.tables` from the JSON it names: "
                 "edit the JSON list in bench/tables.py, not this table -->\n")
    return pattern.sub(lambda m: m.group(1) + generated + body + "\n" + m.group(3), text)


def expected(root: Path = ROOT) -> dict[str, str]:
    """Each marked file's text as the committed JSON gives it."""
    bodies = {name: render(table, root) for name, table in TABLES.items()}
    out = {}
    for rel, names in FILES.items():
        text = (root / rel).read_text()
        for name in names:
            text = rewrite(text, name, bodies[name], rel)
        out[rel] = text
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tables", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare only; exit 1 where stale")
    args = p.parse_args(argv)
    try:
        files = expected()
    except TablesError as exc:
        print(f"bench.tables: error: {exc}", file=sys.stderr)
        return 2
    stale = [rel for rel, text in files.items() if (ROOT / rel).read_text() != text]
    if args.check:
        for rel in stale:
            print(f"bench.tables: {rel} differs from its JSON (run python -m bench.tables)",
                  file=sys.stderr)
        return 1 if stale else 0
    for rel in stale:
        (ROOT / rel).write_text(files[rel])
        print(f"rewrote {rel}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

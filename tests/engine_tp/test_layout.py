"""The tensor-parallel modules import in one direction: tp_worker.py (the processes)
imports tp.py (the sharding) and tp_comm.py (the collectives); tp.py imports only
tp_comm.py, and tp_comm.py neither of the others, so there is no import cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[2] / "backends" / "engine"
TP_MODULES = {"tp", "tp_comm", "tp_worker"}


def _engine_imports(name: str) -> set[str]:
    """The backends.engine modules that ``name``.py imports, anywhere in the file
    (lazy imports inside functions and TYPE_CHECKING blocks included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse((ENGINE / f"{name}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "backends.engine":
            found.update(f"backends.engine.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    prefix = "backends.engine."
    return {m.removeprefix(prefix) for m in found if m.startswith(prefix)}


@pytest.mark.parametrize(
    ("module", "allowed"),
    [("tp_comm", set()), ("tp", {"tp_comm"}), ("tp_worker", {"tp", "tp_comm"})],
)
def test_tp_modules_import_each_other_in_one_direction(module: str, allowed: set[str]) -> None:
    assert _engine_imports(module) & TP_MODULES == allowed

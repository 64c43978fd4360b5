"""The README tables are what the committed benchmark JSON gives (bench/tables.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import tables

ROOT = Path(tables.__file__).resolve().parent.parent


def test_committed_readmes_equal_what_the_committed_json_gives() -> None:
    for rel, text in tables.expected().items():
        assert (ROOT / rel).read_text() == text, (
            f"{rel}: a generated table differs from its JSON; run `python -m bench.tables`"
        )
    assert tables.main(["--check"]) == 0


def test_every_row_names_its_machine_and_commands() -> None:
    body = tables.render(tables.TABLES["engine"])
    for row in tables.TABLES["engine"].rows:
        doc = json.loads((ROOT / row.path).read_text())
        assert doc["cpu"]["model"] in body
        assert row.path in body
        for lv in doc["levels"]:
            if lv["concurrency"] in tables.TABLES["engine"].levels:
                assert f"{lv['aggregate_tok_s']:.1f}" in body
    assert "headrace bench engine" in body and "--target" not in body and "--json" not in body


def _copy(tmp_path: Path) -> Path:
    for rel in {*tables.FILES, *(r.path for t in tables.TABLES.values() for r in t.rows)}:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    return tmp_path


def test_a_json_without_cpu_info_fails_clearly(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    row = tables.TABLES["engine"].rows[0]
    doc = json.loads((root / row.path).read_text())
    del doc["cpu"]
    (root / row.path).write_text(json.dumps(doc))
    with pytest.raises(tables.TablesError, match=rf"{row.path}: no CPU record"):
        tables.render(tables.TABLES["engine"], root)


def test_an_edited_table_is_stale_and_rewrite_restores_it(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    readme = root / "README.md"
    good = readme.read_text()
    start = good.index("<!-- bench:engine -->")
    edited = good[:start] + good[start:].replace(" | ", " | 999 ", 1)
    readme.write_text(edited)
    assert tables.expected(root)["README.md"] == good
    body = tables.render(tables.TABLES["engine"], root)
    assert tables.rewrite(edited, "engine", body) == good
    with pytest.raises(tables.TablesError, match="expected one"):
        tables.rewrite("no markers here", "engine", body, "X.md")

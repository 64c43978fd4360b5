"""`headrace bench kernels` times every kernel at every row count it is asked for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.kernels import format_results, main, measure


def test_each_row_count_gets_a_time_per_kernel_and_a_ratio() -> None:
    doc = measure([1, 3], layers=2, repeats=1, shapes=((32, 64), (16, 32)))
    assert [r["rows"] for r in doc["results"]] == [1, 3]
    for r in doc["results"]:
        assert r["int4_ms"] > 0 and r["bf16_ms"] > 0 and r["fp32_ms"] > 0
        assert r["int4_speedup_vs_bf16"] == pytest.approx(r["bf16_ms"] / r["int4_ms"])
    table = format_results(doc)
    assert table.splitlines()[2].split()[0] == "1" and "x" in table


def test_cli_writes_json_and_rejects_bad_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "k.json"
    assert main(["--rows", "1", "--layers", "1", "--repeats", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["results"][0]["rows"] == 1
    assert main(["--rows", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err

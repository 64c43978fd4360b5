"""`headrace bench kernels` times every kernel at every row count it is asked for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.kernels import bf16_packed_supported, format_results, main, measure


def test_each_row_count_gets_a_time_per_kernel_and_a_ratio() -> None:
    """Every kernel this CPU has; oneDNN's bfloat16 one only where it has
    bfloat16 kernels (AVX-512 and up), a ``-`` in the table elsewhere."""
    doc = measure([1, 3], layers=2, repeats=1, shapes=((32, 64), (16, 32)))
    assert [r["rows"] for r in doc["results"]] == [1, 3]
    for r in doc["results"]:
        assert r["int4_ms"] > 0 and r["fp32_ms"] > 0
        if bf16_packed_supported():
            assert r["bf16_ms"] > 0
            assert r["int4_speedup_vs_bf16"] == pytest.approx(r["bf16_ms"] / r["int4_ms"])
        else:
            assert r["bf16_ms"] is None and r["int4_speedup_vs_bf16"] is None
    table = format_results(doc)
    assert table.splitlines()[2].split()[0] == "1"
    assert ("x" in table.splitlines()[2]) == bf16_packed_supported()


def test_the_table_marks_a_kernel_the_cpu_lacks() -> None:
    doc = {"layers": 1, "threads": 1, "results": [{"rows": 1, "int4_ms": 2.0, "bf16_ms": None, "fp32_ms": 3.0,
                                                   "int4_speedup_vs_bf16": None}]}  # fmt: skip
    lines = format_results(doc).splitlines()
    assert lines[2].split() == ["1", "2.0", "-", "3.0", "-"]
    assert "no oneDNN bfloat16 kernels" in lines[3]


def test_cli_writes_json_and_rejects_bad_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "k.json"
    assert main(["--rows", "1", "--layers", "1", "--repeats", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["results"][0]["rows"] == 1
    assert main(["--rows", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err

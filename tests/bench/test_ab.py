"""bench/ab.py: two router builds on their own beds, loaded at the same time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backends.errors import ClientError
from bench import ab

REPO = Path(__file__).resolve().parents[2]


def test_a_short_run_loads_both_sides_at_once_and_writes_the_table_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ab.json"
    argv = ["--b", str(REPO), "--rounds", "1", "--duration", "1", "--rps", "10", "--max-tokens", "3",
            "--json", str(out), "--plot", str(tmp_path / "ab.png")]
    assert ab.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["kind"] == "ab" and len(doc["rounds"]) == 1 and "interrupted" not in doc
    assert doc["sides"]["B"]["path"] == str(REPO) and doc["sides"]["A"]["commit"].startswith(doc["sides"]["B"]["commit"])
    for side in ("A", "B"):
        row = doc["rounds"][0][side]
        assert row["errors"] == 0 and row["ok"] == row["run"]["counts"]["scheduled"] > 0
        assert row["cpu_ms_per_request"] > 0 and row["ttft_p50"] > 0
        assert doc["summary"]["cpu_ms_per_request"][side] == row["cpu_ms_per_request"]  # one round: its median
    s = doc["summary"]["cpu_ms_per_request"]
    assert s["b_over_a"] == pytest.approx(s["B"] / s["A"])
    printed = capsys.readouterr()
    assert "router CPU ms / request" in printed.out
    assert f"wrote {out}" in printed.err and f"wrote {tmp_path / 'ab.png'}" in printed.err
    assert (tmp_path / "ab.png").stat().st_size > 0


def test_the_summary_takes_medians_over_rounds_and_the_ratio_of_medians() -> None:
    def side(cpu: float | None, errors: int = 0) -> dict[str, object]:
        return {"cpu_ms_per_request": cpu, "errors": errors, **{k: 1.0 for _, k in ab.METRICS[1:]}}

    rounds = [{"A": side(1.0), "B": side(2.0, 1)}, {"A": side(3.0), "B": side(1.0)}, {"A": side(2.0), "B": side(None)}]
    s = ab.summarize(rounds)
    assert s["cpu_ms_per_request"] == {"A": 2.0, "B": 1.5, "b_over_a": 0.75}
    assert s["errors"] == {"A": 0, "B": 1}


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ClientError):
        ab.main(["--b", str(REPO), "--rounds", "0"])
    with pytest.raises(SystemExit):
        ab.main([])  # --b is required


def test_a_closed_loop_round_loads_both_sides_at_once_and_reports_cpu_per_request(tmp_path: Path) -> None:
    out = tmp_path / "ab.json"
    argv = ["--b", str(REPO), "--rounds", "1", "--duration", "1", "--closed", "2", "--client", "python",
            "--max-tokens", "3", "--json", str(out), "--no-plot"]
    assert ab.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["closed"] == 2 and doc["config"]["http"] == "2"
    for side in ("A", "B"):
        row = doc["rounds"][0][side]
        assert row["ok"] > 0 and row["errors"] == 0 and row["cpu_ms_per_request"] > 0
        assert row["ttft_p50"] is None  # a closed loop times nothing
    assert doc["summary"]["ttft_p50"] == {"A": None, "B": None, "b_over_a": None}
    with pytest.raises(ClientError):
        ab.main(["--b", str(REPO), "--closed", "-1"])

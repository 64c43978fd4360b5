"""bench/instructions.py: the router's instructions per request, counted by
callgrind over a fixed number of requests, the same from run to run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import cli, instructions


def test_a_dumps_total_is_its_totals_line_else_its_summary() -> None:
    assert instructions.read_total(b"events: Ir\nsummary: 5\ntotals: 1234\n") == 1234
    assert instructions.read_total(b"events: Ir\nsummary: 77\nfn=(1)\n") == 77
    assert instructions.read_total(b"# callgrind format\nversion: 1\n") is None  # not written through yet


def _side(per_request: float | None, ok: int = 100, errors: int = 0) -> dict[str, object]:
    return {"ok": ok, "errors": errors, "instructions": None if per_request is None else per_request * ok,
            "per_request": per_request}


def _doc(rounds: list[dict[str, object]], sides: tuple[str, ...] = ("A", "B")) -> dict[str, object]:
    return {"cpu": {"model": "Test CPU", "cores": 2}, "valgrind": "valgrind-3.x",
            "config": {"requests": 100, "warmup": 10, "concurrency": 4, "tpot_ms": 0.0, "max_tokens": 20, "http": "2"},
            "sides": {s: {"path": f"/src/{s}", "commit": f"c0ffee{s}"} for s in sides}, "rounds": rounds}


def test_the_summary_is_each_sides_median_its_spread_and_b_over_a() -> None:
    rounds = [{"A": _side(4.0e6), "B": _side(3.8e6)}, {"A": _side(4.2e6), "B": _side(3.9e6, errors=1)},
              {"A": _side(4.1e6), "B": _side(None, ok=0)}]
    s = instructions.summarize(rounds)  # type: ignore[arg-type]
    assert s["A"]["per_request"] == pytest.approx(4.1e6) and s["A"]["spread"] == pytest.approx(0.2 / 4.1)
    assert s["B"]["per_request"] == pytest.approx(3.85e6) and s["B"]["errors"] == 1  # a side that answered nothing is no point
    assert s["b_over_a"] == pytest.approx(3.85 / 4.1)
    doc = _doc(rounds)
    doc["sides"]["B"]["serve_args"] = ["--policy", "round_robin"]  # type: ignore[index]
    text = instructions.format_report(doc)  # type: ignore[arg-type]
    assert "Test CPU" in text and "valgrind-3.x" in text
    assert "c0ffeeA" in text and "4.100" in text and "3.850" in text and "B/A: 0.9390" in text
    assert "B: c0ffeeB --policy round_robin" in text


def test_one_side_has_no_ratio() -> None:
    rounds = [{"A": _side(4.0e6)}]
    s = instructions.summarize(rounds)  # type: ignore[arg-type]
    assert "b_over_a" not in s and "B" not in s and s["A"]["spread"] == 0.0
    assert "B/A" not in instructions.format_report(_doc(rounds, ("A",)))  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [["--requests", "0"], ["--concurrency", "0"], ["--warmup", "-1"], ["--rounds", "0"]])
def test_bad_arguments_are_refused_before_anything_starts(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["instructions", *bad]) == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.skipif(not instructions.available(), reason="valgrind is not installed (apt-get install valgrind)")
def test_two_runs_of_one_build_count_the_same_and_the_null_relay_far_less(tmp_path: Path) -> None:
    """A real router under callgrind, 60 requests counted twice: every one
    answered, a plausible count (a streamed request is millions of
    instructions in CPython), and the two runs within 5% of each other
    (within ~0.5% at the default 400 requests; over a short window a cyclic
    garbage collection, or a probe, weighs a few percent); the null relay
    as side B does a fraction of the router's work."""
    out = tmp_path / "ins.json"
    code = cli.main(["instructions", "--requests", "60", "--warmup", "10", "--concurrency", "2", "--rounds", "2",
                     "--b-front", "null", "--json", str(out), "--plot", str(tmp_path / "ins.png")])
    assert code == 0
    doc = json.loads(out.read_text())
    assert (tmp_path / "ins.png").stat().st_size > 0
    assert doc["sides"]["A"]["front"] == "router" and doc["sides"]["B"]["front"] == "null"
    sides = [r[side] for r in doc["rounds"] for side in ("A", "B")]
    assert [s["ok"] for s in sides] == [60] * 4 and [s["errors"] for s in sides] == [0] * 4
    assert all(1e5 < s["per_request"] < 1e8 for s in sides), sides
    assert doc["summary"]["A"]["spread"] < 0.05, sides
    assert doc["summary"]["b_over_a"] < 0.5, doc["summary"]

"""`headrace bench spec`: workloads, the ratio table, and one real end-to-end
run against two tiny-model engines (speculation off and on)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.schedule import repeat_text, workload_prompt
from bench.spec_bench import _cells, busy_tok_s, format_cells, main
from bench.workload_texts import CODE_FILES, PASSAGES
from tests.engine import tiny


def test_workloads_are_reproducible_and_repeat_prompts_carry_text_to_copy() -> None:
    for workload in ("random", "repeat", "chat"):
        assert workload_prompt(workload, 1, 5, 40) == workload_prompt(workload, 1, 5, 40)
        assert workload_prompt(workload, 1, 5, 40) != workload_prompt(workload, 1, 6, 40)
    assert len(workload_prompt("chat", 0, 0, 90).split()) < 20
    prompts = [workload_prompt("repeat", 0, i, 120) for i in range(60)]
    assert len(set(prompts)) > 45  # mostly distinct: a shared prompt is a prefix-cache hit
    kinds = {p.split()[0] for p in prompts}
    assert kinds == {"Repeat", "Copy", "Quote", "Rename"}  # copy, extract, quote, code edit
    for p in prompts:
        if p.startswith("Rename"):
            assert any(f.text in p and any(f"`{old}`" in p and old in f.text for old, _ in f.renames)
                       for f in CODE_FILES)
        else:
            text = p.split("\n\n", 1)[1]
            assert 70 <= len(text.split()) <= 130  # about 120 tokens of whole sentences
            assert all(s in text for s in PASSAGES[_first(text)].sentences[:3])
        if p.startswith("Copy every sentence that mentions "):
            keyword = p.removeprefix("Copy every sentence that mentions ").split(" from the text")[0]
            assert keyword in p.split("\n\n", 1)[1]


def _first(text: str) -> int:
    return next(i for i, passage in enumerate(PASSAGES) if text.startswith(passage.sentences[0]))


def test_repeat_texts_grow_with_the_prompt_size_in_whole_sentences() -> None:
    short, long = repeat_text(0, 1, 20), repeat_text(0, 1, 160)
    assert long.startswith(short) and len(long.split()) > 3 * len(short.split())
    assert short.endswith(".") and long.endswith(".")


def test_cells_pair_each_level_with_its_plain_twin() -> None:
    level = lambda c, tok: {"concurrency": c, "aggregate_tok_s": tok, "requests": 3, "ok": 3}  # noqa: E731
    results = {
        "off": {"repeat": [level(1, 10.0), level(16, 80.0)], "chat": [level(1, 10.0), level(16, 80.0)]},
        "ngram": {"repeat": [level(1, 20.0), level(16, 80.0)], "chat": [level(1, 9.0), level(16, 84.0)]},
    }
    cells = _cells(results, "ngram")
    assert [(c["workload"], c["concurrency"], round(c["ratio"], 2)) for c in cells] == [
        ("repeat", 1, 2.0), ("repeat", 16, 1.0), ("chat", 1, 0.9), ("chat", 16, 1.05)]
    assert "2.00x" in format_cells(cells)


def test_busy_throughput_leaves_out_the_ragged_end_of_a_level() -> None:
    """16 streams, 32 requests of 128 tokens, each 10 s: 16 x 4096 / 320 s of busy
    streams, whatever the wall clock says."""
    level = {"concurrency": 16, "output_tokens": 4096, "aggregate_tok_s": 150.0, "requests": 32, "ok": 32,
             "e2e_ms": {"n": 32, "mean": 10_000.0}}
    assert busy_tok_s(level) == pytest.approx(204.8)
    assert busy_tok_s({**level, "e2e_ms": {"n": 0, "mean": None}}) is None
    results = {"off": {"repeat": [level], "chat": [level]},
               "ngram": {"repeat": [{**level, "e2e_ms": {"n": 32, "mean": 5_000.0}}], "chat": [level]}}
    cells = _cells(results, "ngram")
    assert cells[0]["busy_ratio"] == pytest.approx(2.0) and cells[0]["ratio"] == pytest.approx(1.0)
    assert "2.00x" in format_cells(cells)


@pytest.mark.slow
def test_a_short_run_against_two_tiny_engines_writes_the_table_json_and_png(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny.write_gguf(tiny.hf_model(), tmp_path / "tiny.gguf")
    out = tmp_path / "spec.json"
    code = main(["--concurrency", "1", "2", "--duration", "0.25", "--max-tokens", "8", "--prompt-tokens", "20",
                 "--engine-args", f"--model {model} --threads 1 --block-size 4",
                 "--json", str(out), "--plot", str(tmp_path / "spec.png")])
    assert code == 0
    document = json.loads(out.read_text())
    cells = document["cells"]
    assert [(c["workload"], c["concurrency"]) for c in cells] == [("repeat", 1), ("repeat", 2), ("chat", 1), ("chat", 2)]
    assert all(c["plain_tok_s"] > 0 and c["spec_tok_s"] > 0 and c["errors"] == 0 for c in cells)
    assert (tmp_path / "spec.png").stat().st_size > 0
    assert "ratio" in capsys.readouterr().out

"""The trace format (``sim.trace``) and ``headrace simulate`` (``sim.cli``):
a workload written as a trace reads back the same and simulates the same,
segment prompts hash like their text, bad traces are refused by line, and the
command prints its table, JSON and plot."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from backends.base import chain_hashes
from backends.mock import encode_text
from sim.cli import main, parse_policy
from sim.trace import PromptBuilder, TraceRecord, prepare, prompt_text, read_trace, write_trace
from sim.workloads import SharedPrefix, shared_prefix

SMALL = SharedPrefix(requests=300, rate=20.0, think_s=2.0)


def test_a_workload_written_as_a_trace_reads_back_record_for_record(tmp_path: Path) -> None:
    records = list(shared_prefix(SMALL, seed=3))
    assert write_trace(tmp_path / "t.jsonl", records, {"workload": "shared_prefix"}) == 300
    assert list(read_trace(tmp_path / "t.jsonl")) == records
    assert list(read_trace(tmp_path / "t.jsonl", limit=7)) == records[:7]
    assert [r.t for r in records] == sorted(r.t for r in records) and records[0].t >= 0


def test_conversations_grow_turn_by_turn_on_their_groups_system_prompt() -> None:
    records = list(shared_prefix(SMALL, seed=3))
    by_conv: dict[int | None, list[TraceRecord]] = {}
    for r in records:
        by_conv.setdefault(r.conversation, []).append(r)
    grown = next(turns for turns in by_conv.values() if len(turns) >= 3)
    for before, after in itertools.pairwise(grown):
        assert before.prompt is not None and after.prompt is not None
        assert after.prompt[: len(before.prompt)] == before.prompt
        assert after.prompt[len(before.prompt)] == (f"3.c{before.conversation}.a{before.turn}",
                                                     before.output_tokens)
    systems = {r.group: r.prompt[0] for r in records if r.prompt}
    assert len(systems) == 16 and all(1500 <= n <= 2000 for _, n in systems.values())


def test_segment_prompts_hash_exactly_like_the_mocks_bytes_of_their_text() -> None:
    """What a replay sends as text, the mock tokenizes into the ids the simulator hashed."""
    records = list(shared_prefix(SMALL, seed=3))[:60]
    for record, request in zip(records, prepare(records, 16), strict=True):
        ids = encode_text(prompt_text(record))
        assert request.route.prompt_tokens == len(ids)
        assert request.route.block_hashes == tuple(chain_hashes(ids, 16))
        assert request.route.prefix == prompt_text(record)[:256]
    # The memo is an optimisation only: a cold builder agrees.
    last = records[-1].prompt
    assert last is not None and PromptBuilder(16).hashes(last) == PromptBuilder(16, memo=1).hashes(last)


def test_a_bad_trace_is_refused_naming_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"t": 1.0, "prompt_token_ids": [1, 2], "output_tokens": 1}\n'
                    '{"t": 0.5, "prompt_token_ids": [1, 2], "output_tokens": 1}\n')
    assert main(["--trace", str(path), "--policy", "round_robin", "--quiet"]) == 2
    assert "bad.jsonl:2: arrival t=0.5 is before the previous one" in capsys.readouterr().err
    assert main(["--policy", "no_such_policy", "--quiet"]) == 2
    assert "unknown routing policy 'no_such_policy'" in capsys.readouterr().err


def test_policy_specs_carry_options() -> None:
    assert parse_policy("prefix_hash:load_factor=1.25,name=x") == (
        "prefix_hash", {"load_factor": 1.25, "name": "x"}
    )
    with pytest.raises(ValueError, match="use key=value"):
        parse_policy("prefix_hash:oops")


def test_the_command_prints_a_table_per_policy_and_writes_json_plot_and_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png, trace = tmp_path / "sim.json", tmp_path / "sim.png", tmp_path / "t.jsonl"
    argv = ["--policy", "round_robin", "--policy", "least_loaded", "--backends", "3",
            "--requests", "200", "--seed", "5", "--quiet", "--json", str(out), "--plot", str(png),
            "--write-trace", str(trace)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "hit rate" in table and "TTFT p99 ms" in table
    assert table.count("round_robin") == 1 and table.count("least_loaded") == 1
    document = json.loads(out.read_text())
    assert [r["label"] for r in document["results"]] == ["round_robin", "least_loaded"]
    assert document["results"][0]["completed"] == 200 and png.stat().st_size > 1000
    # Replaying the written trace gives the same numbers as the workload did.
    assert main(["--trace", str(trace), "--policy", "round_robin", "--backends", "3", "--quiet",
                 "--json", str(tmp_path / "again.json")]) == 0
    again = json.loads((tmp_path / "again.json").read_text())["results"][0]
    first = document["results"][0]
    assert {k: again[k] for k in ("hit_rate", "ttft_ms", "throughput")} == {
        k: first[k] for k in ("hit_rate", "ttft_ms", "throughput")
    }

"""bench cache: the workload is fixed by its seed, conversations grow turn by
turn, and the SLO table picks each policy's highest passing rate."""

from __future__ import annotations

from bench.cache_bench import Result, _parser, at_slo, messages, parse_args, summarize, workload


def test_the_workload_is_seeded_and_each_turn_resends_the_conversation_so_far() -> None:
    args = _parser().parse_args(["--duration", "5", "--groups", "3", "--turns", "3", "--system-tokens", "100", "120"])
    convs, plan = workload(args, rate=6.0)
    again, plan2 = workload(args, rate=6.0)
    assert plan == plan2 and [c.system for c in convs] == [c.system for c in again]
    assert [p.at for p in plan] == sorted(p.at for p in plan)
    assert {c.group for c in convs} <= {0, 1, 2} and all(100 <= len(c.system) <= 140 for c in convs)
    first, third = messages(convs[0], 0), messages(convs[0], 2)
    assert third[: len(first) - 1] == first[:-1]  # the system prompt, then the history grows
    assert [m["role"] for m in third] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert len({m["content"] for c in convs for m in messages(c, 0)[:1]}) <= 3  # one system prompt per group


def test_summaries_and_the_slo_pick() -> None:
    results = [Result(ttft=0.1, prompt_tokens=100, cached_tokens=80), Result(ttft=0.3, prompt_tokens=100, cached_tokens=0),
               Result(error="http_503")]
    s = summarize(results, 2.0, {"a": 2, "b": 1})
    assert s["hit_rate"] == 0.4 and s["errors"] == 1 and s["answers_per_s"] == 1.0
    assert s["max_over_avg_load"] == 2 / 1.5
    rows = [{"policy": "rr", "rate": 10, "errors": 0, "ttft_p99_ms": 100},
            {"policy": "rr", "rate": 20, "errors": 0, "ttft_p99_ms": 900},
            {"policy": "kv", "rate": 20, "errors": 0, "ttft_p99_ms": 200},
            {"policy": "kv", "rate": 30, "errors": 2, "ttft_p99_ms": 200}]
    assert {p: r["rate"] for p, r in at_slo(rows, 500).items()} == {"rr": 10, "kv": 20}


def test_the_model_asked_for_defaults_to_what_the_backend_kind_serves() -> None:
    assert parse_args([]).model == "mock"
    assert parse_args(["--kind", "engine"]).model == "auto"  # was "mock": every request to an engine failed
    assert parse_args(["--kind", "engine", "--model", "m"]).model == "m"
    assert parse_args([]).policy == ["round_robin", "prefix_hash", "kv_aware"]

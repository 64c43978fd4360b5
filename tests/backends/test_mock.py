"""The in-process mock: a pure function of (prompt ids, seed, position), with
stop handling, limits, statistics and faults. Time runs on a MockClock."""

from __future__ import annotations

from contextlib import aclosing

import pytest
import trio
import trio.testing

from backends.base import ChatMessage, GenerateRequest
from backends.errors import (
    BackendProtocolError,
    BackendUnavailable,
    BadRequest,
    ContextLengthExceeded,
    ModelNotFound,
    StreamBroken,
    UpstreamError,
    UpstreamRateLimited,
)
from backends.mock import (
    BYTE_IDS,
    Fault,
    MockBackend,
    MockConfig,
    decode_ids,
    encode_text,
    fault_applies,
    parse_fault,
    render_chat,
)
from tests.backends.conftest import collect, collect_until_error, ids_of, text_of


async def test_same_prompt_and_seed_give_the_same_stream_and_other_seeds_differ() -> None:
    a = await collect(MockBackend(), GenerateRequest(prompt="hello", max_tokens=12, seed=3))
    b = await collect(MockBackend(), GenerateRequest(prompt="hello", max_tokens=12, seed=3))
    c = await collect(MockBackend(), GenerateRequest(prompt="hello", max_tokens=12, seed=4))
    assert a == b
    assert ids_of(a) != ids_of(c)
    assert all(t >= BYTE_IDS for t in ids_of(a))
    assert text_of(a) == decode_ids(ids_of(a))


@pytest.mark.parametrize("k", [1, 5, 11])
async def test_resume_from_prompt_plus_emitted_ids_continues_exactly(k: int) -> None:
    full = await collect(MockBackend(), GenerateRequest(prompt="resume me", max_tokens=12, seed=9))
    prompt = full[0].prompt_token_ids
    assert prompt == encode_text("resume me")
    ids = ids_of(full)
    resumed = GenerateRequest(prompt_token_ids=prompt + ids[:k], max_tokens=12 - k, seed=9)
    tail = await collect(MockBackend(), resumed)
    assert ids_of(tail) == ids[k:]
    assert text_of(full[:k]) + text_of(tail) == text_of(full)
    assert tail[-1].finish_reason == "length"


async def test_resume_with_a_wrong_seed_or_dropped_token_is_detectably_different() -> None:
    full = ids_of(await collect(MockBackend(), GenerateRequest(prompt="x", max_tokens=10, seed=1)))
    prompt = encode_text("x")
    wrong_seed = await collect(
        MockBackend(), GenerateRequest(prompt_token_ids=prompt + full[:4], max_tokens=6, seed=2)
    )
    dropped = await collect(
        MockBackend(), GenerateRequest(prompt_token_ids=prompt + full[:3], max_tokens=6, seed=1)
    )
    assert ids_of(wrong_seed) != full[4:]
    assert ids_of(dropped) != full[4:]


async def test_first_event_carries_prompt_ids_and_a_drawn_seed_that_reproduces_the_stream() -> None:
    backend = MockBackend()
    first = await collect(backend, GenerateRequest(prompt="abc", max_tokens=6))
    seed = first[0].seed
    assert seed is not None and all(e.seed is None for e in first[1:])
    again = await collect(backend, GenerateRequest(prompt="abc", max_tokens=6, seed=seed))
    assert ids_of(again) == ids_of(first)
    assert [e.prompt_token_ids is not None for e in first] == [True] + [False] * 5


async def test_last_event_has_finish_reason_and_usage_and_every_event_one_token() -> None:
    events = await collect(MockBackend(), GenerateRequest(prompt="héllo", max_tokens=5, seed=0))
    assert [len(e.token_ids) for e in events] == [1] * 5
    assert [e.finish_reason for e in events] == [None] * 4 + ["length"]
    usage = events[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (6, 5)


async def test_chat_renders_messages_through_the_template() -> None:
    messages = [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content="hi"),
    ]
    events = await collect(MockBackend(), GenerateRequest(messages=messages, max_tokens=2, seed=0))
    assert render_chat(messages) == "<|system|>be brief\n<|user|>hi\n<|assistant|>"
    assert events[0].prompt_token_ids == encode_text(render_chat(messages))


async def test_stop_string_split_across_tokens_ends_the_text_before_it() -> None:
    full = await collect(MockBackend(), GenerateRequest(prompt="s", max_tokens=12, seed=5))
    words = [e.text for e in full]
    # A stop string made of the end of word 3 and the start of word 4.
    stop = words[3][-2:] + words[4][:2]
    assert stop not in "".join(words[:4])  # the test needs a stop that first appears across 3|4
    events = await collect(
        MockBackend(), GenerateRequest(prompt="s", max_tokens=12, seed=5, stop=[stop])
    )
    assert events[-1].finish_reason == "stop"
    assert ids_of(events) == ids_of(full)[:5]
    assert text_of(events) == "".join(words[:4])[:-2]


async def test_text_that_only_looks_like_a_stop_prefix_is_released() -> None:
    full = await collect(MockBackend(), GenerateRequest(prompt="s", max_tokens=6, seed=5))
    stop = full[2].text + "\u2603"  # starts like token 2 but never completes
    events = await collect(
        MockBackend(), GenerateRequest(prompt="s", max_tokens=6, seed=5, stop=[stop])
    )
    assert text_of(events) == text_of(full)
    assert events[-1].finish_reason == "length"


async def test_stop_token_id_stops_with_that_token_and_no_text_for_it() -> None:
    full = await collect(MockBackend(), GenerateRequest(prompt="t", max_tokens=10, seed=2))
    target = ids_of(full)[3]
    first = ids_of(full).index(target)
    events = await collect(
        MockBackend(), GenerateRequest(prompt="t", max_tokens=10, seed=2, stop_token_ids=[target])
    )
    assert ids_of(events) == ids_of(full)[: first + 1]
    assert events[-1].finish_reason == "stop" and events[-1].text == ""


async def test_logprobs_are_well_formed_with_top_n_sorted() -> None:
    events = await collect(
        MockBackend(), GenerateRequest(prompt="l", max_tokens=3, seed=0, logprobs=3)
    )
    for e in events:
        assert e.logprobs is not None and len(e.logprobs) == 1
        lp = e.logprobs[0]
        assert lp.token_id == e.token_ids[0] and lp.token == e.text and lp.logprob < 0
        assert len(lp.top) == 3 and lp.top[0].token_id == lp.token_id
        assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
    none = await collect(MockBackend(), GenerateRequest(prompt="l", max_tokens=1, seed=0))
    assert none[0].logprobs is None


async def test_output_cap_and_context_limit() -> None:
    backend = MockBackend(MockConfig(max_tokens=4, max_context=20))
    capped = await collect(backend, GenerateRequest(prompt="a", max_tokens=50 - 40))
    assert len(ids_of(capped)) == 4
    default = await collect(backend, GenerateRequest(prompt="a" * 17))
    assert len(ids_of(default)) == 3  # only 3 positions left in the context
    with pytest.raises(ContextLengthExceeded):
        await collect(backend, GenerateRequest(prompt="a" * 10, max_tokens=11))
    with pytest.raises(ContextLengthExceeded):
        await collect(backend, GenerateRequest(prompt="a" * 20))
    assert backend.info().max_context == 20


async def test_bad_requests_are_client_errors_and_counted_as_rejected() -> None:
    backend = MockBackend(MockConfig(models=("m1", "m2")))
    with pytest.raises(ModelNotFound):
        await collect(backend, GenerateRequest(prompt="a", model="nope"))
    with pytest.raises(BadRequest):
        await collect(backend, GenerateRequest(prompt_token_ids=[1, -2]))
    with pytest.raises(BadRequest):
        await collect(backend, GenerateRequest(prompt="a", max_tokens=0))
    assert backend.statistics().rejected == 3 and backend.statistics().started == 0
    assert backend.info().models == ("m1", "m2") and backend.info().token_ids


async def test_ttft_and_tpot_are_spent_on_the_trio_clock(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = MockBackend(MockConfig(ttft_s=0.5, tpot_s=0.1))
    start = trio.current_time()
    stamps = []
    async with aclosing(backend.stream(GenerateRequest(prompt="a", max_tokens=4))) as events:
        async for _ in events:
            stamps.append(trio.current_time() - start)
    assert stamps == pytest.approx([0.5, 0.6, 0.7, 0.8])


async def test_statistics_count_cancelled_and_completed_streams(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = MockBackend(MockConfig(tpot_s=1.0))
    await collect(backend, GenerateRequest(prompt="a", max_tokens=2))
    with trio.move_on_after(2.5):
        async with aclosing(backend.stream(GenerateRequest(prompt="a", max_tokens=100))) as events:
            async for _ in events:
                assert backend.statistics().in_flight == 1
    async with aclosing(backend.stream(GenerateRequest(prompt="a", max_tokens=100))) as events:
        async for _ in events:
            break
    stats = backend.statistics()
    assert (stats.started, stats.completed, stats.cancelled, stats.in_flight) == (3, 1, 2, 0)


async def test_consumer_that_stops_after_the_final_event_counts_as_completed() -> None:
    backend = MockBackend()
    async with aclosing(backend.stream(GenerateRequest(prompt="a", max_tokens=1))) as events:
        async for e in events:
            assert e.finish_reason == "length"
            break
    assert backend.statistics().completed == 1 and backend.statistics().cancelled == 0


# ---------------------------------------------------------------- faults


async def test_cut_fault_raises_stream_broken_after_n_tokens() -> None:
    backend = MockBackend(MockConfig(faults=[parse_fault("cut-after=3")]))
    events, exc = await collect_until_error(backend, GenerateRequest(prompt="a", max_tokens=10))
    assert isinstance(exc, StreamBroken) and len(events) == 3
    assert backend.statistics().failed == 1


async def test_stall_fault_sleeps_forever_after_n_tokens(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = MockBackend(MockConfig(faults=[parse_fault("stall-after=2")]))
    got = []
    with trio.move_on_after(3600) as scope:
        async with aclosing(backend.stream(GenerateRequest(prompt="a", max_tokens=10))) as events:
            async for e in events:
                got.append(e)
    assert scope.cancelled_caught and len(got) == 2
    assert backend.statistics().cancelled == 1


@pytest.mark.parametrize(
    ("spec", "error", "retry_after"),
    [
        ("status=503:retry-after=7", BackendUnavailable, 7.0),
        ("429:retry-after=2", UpstreamRateLimited, 2.0),
        ("status=500", UpstreamError, None),
    ],
)
async def test_status_faults_raise_before_any_token(
    spec: str, error: type[Exception], retry_after: float | None
) -> None:
    backend = MockBackend(MockConfig(faults=[parse_fault(spec)]))
    events, exc = await collect_until_error(backend, GenerateRequest(prompt="a"))
    assert events == [] and type(exc) is error
    assert exc.retry_after == retry_after  # type: ignore[attr-defined]


async def test_malformed_fault_in_process_is_a_protocol_error_after_n_tokens() -> None:
    malformed = MockBackend(MockConfig(faults=[parse_fault("malformed-after=1")]))
    events, exc = await collect_until_error(malformed, GenerateRequest(prompt="a", max_tokens=5))
    assert isinstance(exc, BackendProtocolError) and len(events) == 1


async def test_no_done_in_process_is_a_complete_answer_with_its_final_event() -> None:
    """In-process there is no ``[DONE]``: the stream is the healthy one."""
    request = GenerateRequest(prompt="a", max_tokens=3, seed=4)
    no_done = await collect(MockBackend(MockConfig(faults=[Fault(kind="no_done")])), request)
    assert no_done == await collect(MockBackend(), request)
    assert no_done[-1].finish_reason == "length" and no_done[-1].usage is not None


async def test_no_final_in_process_breaks_where_the_final_event_would_come() -> None:
    request = GenerateRequest(prompt="a", max_tokens=4, seed=4)
    healthy = await collect(MockBackend(), request)
    backend = MockBackend(MockConfig(faults=[parse_fault("no-final")]))
    events, exc = await collect_until_error(backend, request)
    assert isinstance(exc, StreamBroken)
    assert events == healthy[:-1] and all(e.finish_reason is None for e in events)
    assert backend.statistics().failed == 1


async def test_slow_first_token_fault_delays_only_the_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = MockBackend(MockConfig(tpot_s=0.01, faults=[parse_fault("slow-first-token=250")]))
    start = trio.current_time()
    stamps = []
    async with aclosing(backend.stream(GenerateRequest(prompt="a", max_tokens=2))) as events:
        async for _ in events:
            stamps.append(trio.current_time() - start)
    assert stamps == pytest.approx([0.25, 0.26])


async def test_fault_rate_hits_a_deterministic_fraction() -> None:
    hits = [fault_applies(11, i, 0.3) for i in range(1000)]
    assert hits == [fault_applies(11, i, 0.3) for i in range(1000)]
    assert 250 < sum(hits) < 350
    backend = MockBackend(MockConfig(faults=[parse_fault("status=500")], fault_rate=0.3, seed=11))
    outcomes = []
    for _ in range(20):
        try:
            await collect(backend, GenerateRequest(prompt="a", max_tokens=1))
            outcomes.append(False)
        except UpstreamError:
            outcomes.append(True)
    assert outcomes == hits[:20]


@pytest.mark.parametrize(
    ("spec", "fault"),
    [
        ("cut-after=4", Fault(kind="cut", after=4)),
        ("stall-after=0", Fault(kind="stall", after=0)),
        ("malformed-after=2", Fault(kind="malformed", after=2)),
        ("no-done", Fault(kind="no_done")),
        ("no-final", Fault(kind="no_final")),
        ("diverge", Fault(kind="diverge")),
        ("slow-first-token=1500", Fault(kind="slow_first_token", delay_s=1.5)),
        ("status=503", Fault(kind="status", status=503)),
        ("429", Fault(kind="status", status=429)),
        ("429:retry-after=3", Fault(kind="status", status=429, retry_after=3.0)),
    ],
)
def test_parse_fault_accepts_the_cli_spellings(spec: str, fault: Fault) -> None:
    assert parse_fault(spec) == fault


@pytest.mark.parametrize(
    "spec",
    [
        "", "cut-after", "cut-after=-1", "status=200", "explode", "429:retry=3", "no-done=1",
        "no-final=2", "diverge=1", "diverge:retry-after=1",
    ],
)
def test_parse_fault_rejects_nonsense_with_a_clear_message(spec: str) -> None:
    with pytest.raises(ValueError, match="bad fault"):
        parse_fault(spec)


async def test_greedy_requests_without_a_seed_are_deterministic() -> None:
    backend = MockBackend()
    runs = [
        await collect(backend, GenerateRequest(prompt="g", max_tokens=6, temperature=0))
        for _ in range(3)
    ]
    assert ids_of(runs[0]) == ids_of(runs[1]) == ids_of(runs[2])
    assert runs[0][0].seed == 0

"""The in-process mock honours the resume contract (``resumed_tokens``): a
request resumed at any k with ``prompt + the first k ids`` gives exactly the
uninterrupted run's events from token k on (stop strings held back across
the break, logprobs, the output cap, usage); and the two mock variants the
router's replay tests need: one without token ids, one that diverges."""

from __future__ import annotations

import msgspec
import pytest

from backends.base import Event, GenerateRequest
from backends.errors import BadRequest, StreamBroken
from backends.mock import Fault, MockBackend, MockConfig, encode_text, parse_fault
from tests.backends.conftest import collect, collect_until_error, ids_of, text_of


def _resumed(request: GenerateRequest, first: list[Event], k: int) -> GenerateRequest:
    """The router's continuation after ``k`` relayed tokens (router.migration.resume_request)."""
    prompt = first[0].prompt_token_ids
    assert prompt is not None
    return msgspec.structs.replace(
        request,
        prompt=None,
        prompt_token_ids=prompt + ids_of(first)[:k],
        resumed_tokens=k,
        max_tokens=None if request.max_tokens is None else request.max_tokens - k,
        seed=first[0].seed,
    )


def _without_head(event: Event) -> Event:
    """An event without what only a stream's first event carries."""
    return msgspec.structs.replace(event, prompt_token_ids=None, seed=None)


async def _check_every_k(backend: MockBackend, request: GenerateRequest) -> list[Event]:
    full = await collect(backend, request)
    assert full[-1].usage is not None
    for k in range(1, len(ids_of(full))):
        tail = await collect(backend, _resumed(request, full, k))
        assert tail[0].prompt_token_ids == full[0].prompt_token_ids, k
        assert tail[0].seed == full[0].seed, k
        assert [_without_head(e) for e in tail] == [_without_head(e) for e in full[k:]], k
        assert text_of(full[:k]) + text_of(tail) == text_of(full), k
    return full


@pytest.mark.parametrize("seed", range(8))
async def test_resumed_at_every_k_with_stop_strings_and_logprobs_is_the_uninterrupted_run(
    seed: int,
) -> None:
    base = GenerateRequest(prompt="resume me", max_tokens=14, seed=seed)
    words = [e.text for e in await collect(MockBackend(), base)]
    # One stop straddles tokens 6|7 (text is held back before it completes);
    # the other only ever looks like it begins (held back, then released).
    straddle = words[6][-2:] + words[7][:2]
    teaser = words[3] + "\u2603"
    request = msgspec.structs.replace(base, stop=[straddle, teaser], logprobs=2)
    full = await _check_every_k(MockBackend(), request)
    assert all(e.logprobs for e in full)
    # The test exercises the look-behind: some event's text was held back.
    assert any(e.text != w for e, w in zip(full, words, strict=False))
    if straddle not in "".join(words[:7]):  # else it stops earlier, still checked above
        assert full[-1].finish_reason == "stop" and len(full) == 8


async def test_a_stop_string_straddling_the_break_still_stops_and_releases_what_was_held() -> None:
    base = GenerateRequest(prompt="straddle", max_tokens=12, seed=5)
    words = [e.text for e in await collect(MockBackend(), base)]
    stop = words[3][-2:] + words[4][:2]
    assert stop not in "".join(words[:4])
    request = msgspec.structs.replace(base, stop=[stop])
    full = await collect(MockBackend(), request)
    tail = await collect(MockBackend(), _resumed(request, full, 4))  # break between 3 and 4
    assert tail[-1].finish_reason == "stop" and len(tail) == 1
    assert text_of(full[:4]) == "".join(words[:4])[:-2]  # the first backend held 2 chars back
    assert tail[0].text == "" and text_of(full[:4]) + text_of(tail) == "".join(words[:4])[:-2]
    # A naive resume (the earlier output as plain prompt) loses the look-behind.
    naive = msgspec.structs.replace(_resumed(request, full, 4), resumed_tokens=0)
    assert (await collect(MockBackend(), naive))[0].finish_reason is None


async def test_held_back_text_comes_out_of_the_resumed_stream() -> None:
    base = GenerateRequest(prompt="held", max_tokens=8, seed=2)
    words = [e.text for e in await collect(MockBackend(), base)]
    request = msgspec.structs.replace(base, stop=[words[2] + "\u2603"])
    full = await collect(MockBackend(), request)
    assert full[2].text == "" and full[3].text == words[2] + words[3]
    tail = await collect(MockBackend(), _resumed(request, full, 3))
    assert tail[0].text == words[2] + words[3]
    assert text_of(full[:3]) + text_of(tail) == "".join(words)


@pytest.mark.parametrize("max_tokens", [None, 9])
async def test_resumed_usage_counts_the_original_prompt_once_and_every_output_token(
    max_tokens: int | None,
) -> None:
    """The output cap (``MockConfig.max_tokens``) counts the earlier output too."""
    config = MockConfig(max_tokens=7)
    request = GenerateRequest(prompt="usage", max_tokens=max_tokens, seed=1)
    full = await _check_every_k(MockBackend(config), request)
    assert full[-1].usage is not None
    assert (full[-1].usage.prompt_tokens, full[-1].usage.completion_tokens) == (5, 7)
    naive = msgspec.structs.replace(_resumed(request, full, 3), resumed_tokens=0)
    usage = (await collect(MockBackend(config), naive))[-1].usage
    assert usage is not None and usage.prompt_tokens == 8  # what the contract fixes


async def test_the_context_limit_ends_a_resumed_run_where_the_uninterrupted_one_ends() -> None:
    await _check_every_k(MockBackend(MockConfig(max_context=12)), GenerateRequest(prompt="ctx", seed=3))


async def test_a_resumed_run_on_a_cache_replica_reports_cached_tokens_within_the_prompt() -> None:
    backend = MockBackend(MockConfig(block_size=4))
    request = GenerateRequest(prompt="a cached prompt", max_tokens=12, seed=7)
    full = await collect(backend, request)
    tail = await collect(backend, _resumed(request, full, 10))
    assert tail[-1].usage is not None
    assert tail[-1].usage.prompt_tokens == 15 and 0 < tail[-1].usage.cached_tokens <= 15


async def test_faults_count_the_tokens_this_stream_sent_not_the_resumed_ones() -> None:
    request = GenerateRequest(prompt="cut", max_tokens=10, seed=1)
    full = await collect(MockBackend(), request)
    broken = MockBackend(MockConfig(faults=[parse_fault("cut-after=2")]))
    events, exc = await collect_until_error(broken, _resumed(request, full, 5))
    assert isinstance(exc, StreamBroken) and ids_of(events) == ids_of(full)[5:7]
    no_final = MockBackend(MockConfig(faults=[Fault(kind="no_final")]))
    events, exc = await collect_until_error(no_final, _resumed(request, full, 5))
    assert isinstance(exc, StreamBroken) and ids_of(events) == ids_of(full)[5:9]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"prompt_token_ids": None, "prompt": "text"}, "token-id prompt"),
        ({"resumed_tokens": 99}, "between 0"),
        ({"resumed_tokens": -1}, "between 0"),
    ],
)
async def test_a_resumed_request_that_cannot_be_one_is_a_bad_request(
    change: dict[str, object], match: str
) -> None:
    request = GenerateRequest(prompt_token_ids=encode_text("abc"), resumed_tokens=2, max_tokens=3)
    backend = MockBackend()
    with pytest.raises(BadRequest, match=match):
        await collect(backend, msgspec.structs.replace(request, **change))
    assert backend.statistics().rejected == 1


async def test_resuming_output_that_already_stopped_or_reached_the_cap_is_a_bad_request() -> None:
    base = GenerateRequest(prompt="s", max_tokens=8, seed=5)
    full = await collect(MockBackend(), base)
    stopped = msgspec.structs.replace(_resumed(base, full, 4), stop=[full[1].text])
    with pytest.raises(BadRequest, match="ends the generation"):
        await collect(MockBackend(), stopped)
    capped = msgspec.structs.replace(_resumed(base, full, 4), max_tokens=None)
    with pytest.raises(BadRequest, match="output cap"):
        await collect(MockBackend(MockConfig(max_tokens=4)), capped)


async def test_the_mock_promises_exact_resume_unless_it_hides_ids_or_diverges() -> None:
    assert MockBackend().info().exact_resume and MockBackend().info().token_ids
    hidden = MockBackend(MockConfig(token_ids=False)).info()
    assert not hidden.token_ids and not hidden.exact_resume
    diverging = MockBackend(MockConfig(faults=[Fault(kind="diverge")])).info()
    assert diverging.token_ids and not diverging.exact_resume and not diverging.seeds


async def test_without_token_ids_events_carry_the_same_text_but_no_ids() -> None:
    request = GenerateRequest(prompt="plain", max_tokens=6, seed=2, stop=["zzz"])
    for plain in (request, msgspec.structs.replace(request, stop=[])):  # both of rest()'s paths
        hidden = await collect(MockBackend(MockConfig(token_ids=False)), plain)
        normal = await collect(MockBackend(), plain)
        assert text_of(hidden) == text_of(normal) and ids_of(hidden) == []
        assert all(e.prompt_token_ids is None and e.seed is None for e in hidden)
        assert hidden[-1].usage == normal[-1].usage


async def test_diverge_gives_identical_requests_different_text() -> None:
    backend = MockBackend(MockConfig(faults=[Fault(kind="diverge")]))
    request = GenerateRequest(prompt="same", max_tokens=8, seed=3)
    runs = [await collect(backend, request) for _ in range(3)]
    assert len({text_of(r) for r in runs}) == 3
    assert all(r[0].seed == 3 for r in runs)  # it claims the seed it was given
    healthy = [await collect(MockBackend(), request) for _ in range(2)]
    assert text_of(healthy[0]) == text_of(healthy[1])

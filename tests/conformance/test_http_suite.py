"""The HTTP suite passes a correct server and fails each broken clause.

The target is the reference server in this folder, served by hypercorn on
127.0.0.1:0 and spoken to over HTTP/1.1 and HTTP/2 (prior knowledge).
"""

from __future__ import annotations

import pytest

from conformance import check_http

from .reference_server import ReferenceServer
from .serving import serving

FAST = {"check_timeout": 20.0, "grace": 1.0}
# A passing run must not trip on a loaded CI machine: more grace before "leaked".
SLACK = {"check_timeout": 30.0, "grace": 5.0}


@pytest.mark.parametrize("http", ["1.1", "2"])
async def test_a_correct_server_passes_every_check(http: str) -> None:
    async with serving(ReferenceServer()) as url:
        report = await check_http(url, http=http, **SLACK)
    assert report.ok, report.format_table()
    # The reference server is a plain OpenAI server: it does not claim the resume
    # contract (resumed_tokens), so that check alone is skipped.
    assert report.counts() == {"pass": len(report.results) - 1, "fail": 0, "skip": 1}
    assert report.outcome("tokens.resume.contract") == "skip"
    assert report.capabilities == {"token_ids": True, "seeds": True, "ignore_eos": True, "exact_resume": False}


# flaw -> checks that must fail because of it
BROKEN = {
    "no_done": ["api.completions.stream", "api.chat.stream"],
    "unstable_ids": ["api.completions.stream", "api.chat.stream"],
    "no_role": ["api.chat.stream"],
    "error_status_500": ["errors.malformed_json"],
    "no_error_shape": ["errors.malformed_json", "errors.wrong_type", "errors.unknown_model",
                       "errors.context_length"],
    "stop_no_straddle": ["params.stop.split"],
    "bad_usage": ["params.max_tokens", "tokens.report"],
    "max_tokens_off_by_one": ["params.max_tokens"],
    "seed_ignored": ["params.seed", "tokens.resume.seeded"],
    "resume_drift": ["tokens.resume.seeded"],
    "leak_on_disconnect": ["load.cancellation"],
    "no_retry_after": ["load.overload"],
    "logprob_tokens_empty": ["params.logprobs", "params.logprobs.chat"],
    "logprob_tokens_collide": ["params.logprobs", "params.logprobs.chat"],
}
# checks the flaw must leave passing (the suite blames the right clause)
CONTROLS = {
    "stop_no_straddle": ["params.stop"],
    "resume_drift": ["tokens.resume.greedy"],
    "error_status_500": ["errors.wrong_type"],
}


@pytest.mark.parametrize("flaw", sorted(BROKEN))
async def test_a_broken_server_fails_the_check_for_its_flaw(flaw: str) -> None:
    must_fail, must_pass = BROKEN[flaw], CONTROLS.get(flaw, [])
    async with serving(ReferenceServer(frozenset({flaw}))) as url:
        report = await check_http(url, only=",".join(must_fail + must_pass), **FAST)
    outcomes = {r.name: r.outcome for r in report.results}
    assert outcomes == dict.fromkeys(must_fail, "fail") | dict.fromkeys(must_pass, "pass"), (
        report.format_table()
    )
    assert not report.ok


async def test_a_leaked_stream_is_reported_as_held_capacity() -> None:
    async with serving(ReferenceServer(frozenset({"leak_on_disconnect"}))) as url:
        report = await check_http(url, http="2", only="load.cancellation", **FAST)
    assert "still hold capacity" in report.failed[0].reason


async def test_token_checks_are_skipped_when_the_target_does_not_report_ids() -> None:
    async with serving(ReferenceServer(token_ids=False)) as url:
        report = await check_http(url, only="tokens,params.max_tokens", **FAST)
    assert report.capabilities["token_ids"] is False
    skipped = {r.name: r.reason for r in report.results if r.outcome == "skip"}
    assert set(skipped) == {"tokens.report", "tokens.prompt_ids", "tokens.resume.greedy",
                            "tokens.resume.seeded", "tokens.resume.contract"}
    assert all("does not claim" in why and "token_ids" in why for why in skipped.values()), skipped
    assert report.outcome("params.max_tokens") == "pass"


async def test_overload_is_skipped_when_a_burst_never_overloads_the_target() -> None:
    server = ReferenceServer(max_running=64, max_waiting=64)
    async with serving(server) as url:
        report = await check_http(url, only="load.overload", burst=8, **FAST)
    assert report.outcome("load.overload") == "skip"
    assert "never overloaded" in report.results[0].reason


async def test_a_withdrawn_capability_skips_its_checks() -> None:
    async with serving(ReferenceServer()) as url:
        report = await check_http(url, only="params.seed", without=["seeds"], **FAST)
    assert report.outcome("params.seed") == "skip"


async def test_a_target_without_models_listing_fails_api_models_when_given_a_model() -> None:
    async with serving(ReferenceServer(frozenset({"no_models"}))) as url:
        report = await check_http(url, model="ref-model", only="api.models,api.completions", **FAST)
    assert report.outcome("api.models") == "fail"
    assert report.outcome("api.completions") == "pass"

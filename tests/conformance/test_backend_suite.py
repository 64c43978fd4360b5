"""``check_backend`` passes a correct in-process Backend and fails broken ones."""

from __future__ import annotations

import pytest

from conformance import ConformanceFailure, check_backend

from .reference_backend import ReferenceBackend

FAST = {"check_timeout": 10.0, "grace": 1.0}


async def test_a_correct_backend_passes_and_kv_events_are_skipped_unclaimed() -> None:
    report = await check_backend(ReferenceBackend, **FAST)
    assert report.ok, report.format_table()
    assert [r.name for r in report.results if r.outcome == "skip"] == ["backend.kv_events"]
    report.raise_for_failures()


async def test_an_async_factory_is_accepted_and_every_backend_is_closed() -> None:
    made: list[ReferenceBackend] = []

    async def make() -> ReferenceBackend:
        made.append(ReferenceBackend())
        return made[-1]

    report = await check_backend(make, only="backend.events,backend.max_tokens", **FAST)
    assert report.ok, report.format_table()
    assert made and all(b.closed == 2 for b in made)


BROKEN = {
    "two_finals": ["backend.events"],
    "no_usage": ["backend.events"],
    "usage_off": ["backend.events"],
    "max_tokens_off_by_one": ["backend.max_tokens"],
    "raw_error": ["backend.errors.unknown_model"],
    "wedge_on_cancel": ["backend.cancel.aclose", "backend.cancel.scope"],
    "seed_ignored": ["backend.seed", "backend.resume.seeded"],
    "resume_drift": ["backend.resume.seeded"],
    "stop_no_straddle": ["backend.stop"],
}


@pytest.mark.parametrize("flaw", sorted(BROKEN))
async def test_a_broken_backend_fails_the_check_for_its_flaw(flaw: str) -> None:
    report = await check_backend(lambda: ReferenceBackend(frozenset({flaw})),
                                 only=",".join(BROKEN[flaw]), **FAST)
    assert {r.name: r.outcome for r in report.results} == dict.fromkeys(BROKEN[flaw], "fail")
    with pytest.raises(ConformanceFailure, match=BROKEN[flaw][0]):
        report.raise_for_failures()


async def test_a_raw_exception_is_named_in_the_failure() -> None:
    report = await check_backend(lambda: ReferenceBackend(frozenset({"raw_error"})),
                                 only="backend.errors", **FAST)
    assert "KeyError" in report.failed[0].reason
    assert report.outcome("backend.errors.context_length") == "pass"

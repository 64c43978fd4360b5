"""The shipped mock passes the suite: in-process (``check_backend(MockBackend)``)
and over HTTP (the ``headrace mock`` app, the shared OpenAI frontend), on
HTTP/1.1 and HTTP/2. A verified fake (CONVENTIONS 14, 15)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from backends.base import Backend
from backends.fakes import FlakyBackend, SlowBackend, StallingBackend
from backends.mock import MockBackend, MockConfig
from backends.mock_server import build_app
from conformance import check_backend, check_http
from tests.router.fakes import FakeBackend

from .serving import serving

FAST = {"check_timeout": 30.0, "grace": 5.0}


def _mock() -> MockBackend:
    # A small time per token, so a dropped stream is still running when the
    # cancellation check looks at it.
    return MockBackend(MockConfig(tpot_s=0.002))




async def test_the_mock_backend_passes_the_in_process_suite() -> None:
    report = await check_backend(_mock, **FAST)
    assert report.ok, report.format_table()


@pytest.mark.parametrize("http", ["1.1", "2"])
async def test_the_mock_server_passes_the_http_suite(http: str) -> None:
    async with serving(build_app(_mock())) as url:
        report = await check_http(url, http=http, **FAST)
    assert report.ok, report.format_table()
    assert report.capabilities["token_ids"] is True
    assert report.outcome("tokens.resume.contract") == "pass"  # the mock claims exact_resume


@pytest.mark.parametrize(
    "make",
    [
        lambda: SlowBackend(_mock(), ttft_s=0.01, tpot_s=0.001),
        lambda: FlakyBackend(_mock()),
        lambda: StallingBackend(_mock(), stall_every=0),
        lambda: FakeBackend(delay=0.001),
    ],
    ids=["slow", "flaky-at-rest", "stalling-at-rest", "router-tests-fake"],
)
async def test_the_test_fakes_pass_the_in_process_suite(make: Callable[[], Backend]) -> None:
    """Fakes are verified too (CONVENTIONS 14): with their faults off they are
    correct backends, so a test failure through them means the router."""
    report = await check_backend(make, **FAST)
    assert report.ok, report.format_table()

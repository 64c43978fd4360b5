"""Run the HTTP suite against a URL: probe, select, run, report."""

from __future__ import annotations

from collections.abc import Iterable

import httpx

from .checks import HTTP
from .registry import Check
from .report import Report
from .runner import DEFAULT_TIMEOUT, run_checks, select
from .target import CAPABILITIES, HttpTarget, open_client, probe

__all__ = ["CATEGORIES", "check_http", "http_checks"]

CATEGORIES = ("api", "params", "tokens", "errors", "load")


def http_checks() -> list[Check]:
    """Every HTTP check, in table order (by category, then registration)."""
    return sorted(HTTP.checks, key=lambda c: CATEGORIES.index(c.category))


async def check_http(
    base_url: str,
    *,
    api_key: str | None = None,
    model: str | None = None,
    only: str | None = None,
    http: str = "auto",
    check_timeout: float = DEFAULT_TIMEOUT,
    concurrency: int = 8,
    burst: int = 32,
    without: Iterable[str] = (),
    max_context: int | None = None,
    grace: float = 5.0,
) -> Report:
    """Check the OpenAI-compatible server at ``base_url``; never raises for a
    misbehaving target (that is what the report is for), but raises
    :class:`conformance.target.ProbeError` or ``httpx.HTTPError`` when the
    target cannot be reached or probed at all."""
    unknown = set(without) - set(CAPABILITIES)
    if unknown:
        raise ValueError(f"unknown capabilities {sorted(unknown)}; known: {', '.join(CAPABILITIES)}")
    def new_client() -> httpx.AsyncClient:
        return open_client(base_url, api_key=api_key, http=http, timeout=check_timeout)

    async with new_client() as client:
        target = HttpTarget(client=client, model=model or "", concurrency=concurrency,
                            burst=burst, grace=grace, new_client=new_client)
        target.caps.max_context = max_context
        await probe(target, frozenset(without))
        caps = target.caps.as_dict()
        results = await run_checks(select(http_checks(), only), target, caps, check_timeout=check_timeout)
    return Report(target=f"{base_url} (model {target.model})", capabilities=caps, results=results)

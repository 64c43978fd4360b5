"""Run registered checks one after another, each under its own deadline.

Checks run sequentially on purpose: several of them measure capacity
(cancellation, overload) and would disturb each other if interleaved. A check
that raises anything but :class:`CheckSkipped` fails, with the exception named
in the reason: an adapter letting a raw ``httpx`` or ``KeyError`` escape is a
conformance failure, not a crash of the suite.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping

import trio

from .registry import Check, CheckFailed, CheckSkipped
from .report import CheckResult

__all__ = ["run_checks", "select"]

DEFAULT_TIMEOUT = 60.0


def select(checks: Iterable[Check], only: str | None) -> list[Check]:
    """Checks whose name or category matches one of the comma-separated
    patterns in ``only`` (shell wildcards; a bare word also matches as a
    prefix, so ``errors`` selects every ``errors.*`` check)."""
    checks = list(checks)
    if not only:
        return checks
    patterns = [p.strip() for p in only.split(",") if p.strip()]
    return [c for c in checks if any(_matches(c, p) for p in patterns)]


def _matches(check: Check, pattern: str) -> bool:
    if any(ch in pattern for ch in "*?["):
        return fnmatch.fnmatchcase(check.name, pattern) or check.category == pattern
    return check.name == pattern or check.name.startswith(pattern + ".") or check.category == pattern


async def run_checks(
    checks: Iterable[Check],
    context: object,
    capabilities: Mapping[str, bool],
    *,
    check_timeout: float = DEFAULT_TIMEOUT,
) -> list[CheckResult]:
    return [await run_one(check, context, capabilities, check_timeout=check_timeout) for check in checks]


async def run_one(
    check: Check, context: object, capabilities: Mapping[str, bool], *, check_timeout: float
) -> CheckResult:
    missing = sorted(cap for cap in check.requires if not capabilities.get(cap, False))
    if missing:
        return _result(check, "skip", f"target does not claim {', '.join(missing)}", 0.0)
    limit = check.timeout if check.timeout is not None else check_timeout
    start = trio.current_time()
    try:
        with trio.fail_after(limit):
            detail = await check.fn(context)
    except BaseExceptionGroup as group:
        exc = _leaf(group)
        outcome = {CheckSkipped: "skip", CheckFailed: "fail"}.get(type(exc), "fail")
        reason = str(exc) if type(exc) in (CheckSkipped, CheckFailed) else _raised(exc)
        if isinstance(exc, trio.TooSlowError):
            reason = f"timed out after {limit:g}s"
        return _result(check, outcome, reason, trio.current_time() - start)
    except CheckSkipped as exc:
        return _result(check, "skip", str(exc), trio.current_time() - start)
    except CheckFailed as exc:
        return _result(check, "fail", str(exc), trio.current_time() - start)
    except trio.TooSlowError:
        return _result(check, "fail", f"timed out after {limit:g}s", trio.current_time() - start)
    except Exception as exc:
        return _result(check, "fail", _raised(exc), trio.current_time() - start)
    return _result(check, "pass", detail or "", trio.current_time() - start)


def _leaf(group: BaseExceptionGroup) -> BaseException:
    """The most telling exception in a group: a failed check first, then
    anything unexpected, then a skip (a concurrent sub-check may skip while a
    sibling fails; the failure wins). Cancellation is never chosen."""
    leaves: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        exc = stack.pop()
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(exc.exceptions)
        elif not isinstance(exc, trio.Cancelled):
            leaves.append(exc)
    rank = {CheckFailed: 0, CheckSkipped: 2}
    if not leaves:
        raise group
    return min(leaves, key=lambda e: rank.get(type(e), 1))


def _raised(exc: BaseException) -> str:
    return f"raised {type(exc).__name__}: {exc}"


def _result(check: Check, outcome: str, reason: str, seconds: float) -> CheckResult:
    return CheckResult(
        name=check.name,
        category=check.category,
        outcome=outcome,  # type: ignore[arg-type]
        reason=reason,
        seconds=round(seconds, 3),
    )

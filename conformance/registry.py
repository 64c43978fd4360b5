"""Checks as data: a name, a category, the capabilities they need, a function.

A conformance check is a small async function that takes a context (an HTTP
target or an in-process backend factory) and either returns (pass, with an
optional detail line), raises :class:`CheckFailed` (the target broke the
contract) or :class:`CheckSkipped` (the target does not claim what the check
needs). Keeping checks as registered data, rather than test functions, is what
lets the same suite run from the command line, from pytest and from a deploy
pipeline without depending on pytest (trio's ``check_two_way_stream`` has its
own ``_assert_raises`` for the same reason).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

__all__ = [
    "Check",
    "CheckFailed",
    "CheckSkipped",
    "Registry",
    "expect",
    "expect_equal",
    "fail",
    "skip",
]

CheckFn = Callable[[Any], Awaitable[str | None]]


class CheckFailed(Exception):
    """The target violated the contract; the message says how."""


class CheckSkipped(Exception):
    """The check does not apply to this target; the message says why."""


def fail(message: str) -> NoReturn:
    raise CheckFailed(message)


def skip(reason: str) -> NoReturn:
    raise CheckSkipped(reason)


def expect(condition: object, message: str) -> None:
    """Fail the check with ``message`` unless ``condition`` holds."""
    if not condition:
        raise CheckFailed(message)


def expect_equal(actual: object, expected: object, what: str) -> None:
    if actual != expected:
        raise CheckFailed(f"{what}: expected {_short(expected)}, got {_short(actual)}")


def _short(value: object, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class Check:
    name: str
    category: str
    fn: CheckFn
    requires: frozenset[str] = frozenset()
    doc: str = ""
    timeout: float | None = None  # None: the runner's default


@dataclass
class Registry:
    """An ordered set of checks; one per suite (HTTP, in-process)."""

    checks: list[Check] = field(default_factory=list)

    def check(
        self,
        name: str,
        category: str,
        *,
        requires: tuple[str, ...] = (),
        timeout: float | None = None,
    ) -> Callable[[CheckFn], CheckFn]:
        def register(fn: CheckFn) -> CheckFn:
            if any(c.name == name for c in self.checks):
                raise ValueError(f"duplicate conformance check name {name!r}")
            doc = (fn.__doc__ or "").strip().splitlines()
            self.checks.append(
                Check(name, category, fn, frozenset(requires), doc[0] if doc else "", timeout)
            )
            return fn

        return register

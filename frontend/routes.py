"""The route table: ``(method, path)`` to a handler, with path parameters.

Static paths are one dict lookup; a template such as ``/v1/jobs/{id}``
matches one path segment per parameter (no ``/`` inside), the values handed
to the handler as ``request.params``. Metrics label a request by its
template, never by the path itself, so ids do not blow up label sets. A path
that matches with another method is 405, with the methods it allows; no match
is 404.
"""

from __future__ import annotations

import re
from typing import Generic, TypeVar

from backends.errors import MethodNotAllowed, NotFound

__all__ = ["Match", "RouteTable"]

H = TypeVar("H")
_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


class Match(Generic[H]):
    __slots__ = ("handler", "params", "template")

    def __init__(self, handler: H, template: str, params: dict[str, str]) -> None:
        self.handler, self.template, self.params = handler, template, params


class RouteTable(Generic[H]):
    def __init__(self) -> None:
        self._static: dict[tuple[str, str], H] = {}
        self._templates: list[tuple[str, str, re.Pattern[str], H]] = []

    def add(self, method: str, path: str, handler: H) -> None:
        """Add (or replace) a route; ``{name}`` segments are parameters."""
        if "{" not in path:
            self._static[(method, path)] = handler
            return
        # Literal pieces escaped, each {name} one segment: split gives them in turn.
        pieces = _PARAM.split(path)
        pattern = re.compile("".join(
            re.escape(piece) if i % 2 == 0 else f"(?P<{piece}>[^/]+)" for i, piece in enumerate(pieces)
        ) + "$")
        self._templates = [t for t in self._templates if (t[0], t[1]) != (method, path)]
        self._templates.append((method, path, pattern, handler))

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._static or any((m, t) == key for m, t, _, _ in self._templates)

    def match(self, method: str, path: str) -> Match[H] | None:
        """The route for this request, or None (no 404/405 decision)."""
        handler = self._static.get((method, path))
        if handler is not None:
            return Match(handler, path, {})
        for m, template, pattern, h in self._templates:
            if m == method:
                found = pattern.match(path)
                if found is not None:
                    return Match(h, template, found.groupdict())
        return None

    def resolve(self, method: str, path: str) -> Match[H]:
        """The route, or :class:`NotFound` / :class:`MethodNotAllowed`."""
        found = self.match(method, path)
        if found is not None:
            return found
        allowed = sorted({m for (m, p) in self._static if p == path} | {
            m for m, _, pattern, _ in self._templates if pattern.match(path)
        })
        if allowed:
            raise MethodNotAllowed(f"{method} not allowed on {path}; use {', '.join(allowed)}")
        raise NotFound(f"no route {path}")

    def template(self, method: str, path: str) -> str:
        """The metrics label for this request: its route template, or "other"."""
        found = self.match(method, path)
        return found.template if found is not None else "other"

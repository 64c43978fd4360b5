"""A strict reader of OpenAI-style server-sent events.

OpenAI streams are ``text/event-stream``: events separated by a blank line,
each carrying one ``data: <json>`` line, the last one ``data: [DONE]``. Clients
in the wild (the ``openai`` SDK, LangChain) break on anything looser, so the
parser records every deviation instead of tolerating it silently; the checks
decide which deviations fail.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

__all__ = ["SSEStream", "parse_sse"]

_FIELDS = {"data", "event", "id", "retry"}


@dataclass
class SSEStream:
    chunks: list[dict[str, Any]] = field(default_factory=list)  # decoded JSON payloads
    done: bool = False  # a `data: [DONE]` event was seen
    after_done: int = 0  # events that came after [DONE]
    problems: list[str] = field(default_factory=list)
    unterminated: bool = False  # the body did not end with a blank line


def parse_sse(body: bytes) -> SSEStream:
    """Parse a whole event-stream body."""
    out = SSEStream()
    text = body.decode("utf-8", errors="replace").replace("\r\n", "\n")
    blocks = text.split("\n\n")
    if blocks and blocks[-1].strip():
        out.unterminated = True
        out.problems.append("stream does not end with a blank line after its last event")
    for block in blocks:
        if block.strip():
            _parse_event(block, out)
    return out


def _parse_event(block: str, out: SSEStream) -> None:
    data_lines = []
    for line in block.split("\n"):
        if not line or line.startswith(":"):
            continue
        name, sep, value = line.partition(":")
        if not sep or name not in _FIELDS:
            out.problems.append(f"not an SSE field line: {line[:80]!r}")
            continue
        if name == "data":
            data_lines.append(value[1:] if value.startswith(" ") else value)
    if not data_lines:
        return
    payload = "\n".join(data_lines)
    if out.done:
        out.after_done += 1
    if payload == "[DONE]":
        out.done = True
        return
    try:
        chunk = msgspec.json.decode(payload)
    except msgspec.DecodeError:
        out.problems.append(f"data is not JSON: {payload[:80]!r}")
        return
    if not isinstance(chunk, dict):
        out.problems.append(f"data is not a JSON object: {payload[:80]!r}")
        return
    out.chunks.append(chunk)

"""An incremental Server-Sent Events parser, bytes in, events out; shared by
the HTTP backend adapter and the load generator.

Timing a stream means noticing each event the moment its blank line arrives,
whatever way the bytes were cut into network chunks: an event, a line, a
``\\r\\n`` pair or a multi-byte UTF-8 character may be split across chunks. The
parser is sans-I/O (feed bytes, get events) so it is tested without sockets.
It follows the WHATWG rules that matter for OpenAI-style streams: lines end in
``\\r\\n``, ``\\n`` or ``\\r``; ``data:`` lines of one event join with ``\\n``; a
single space after the colon is dropped; ``:`` starts a comment; a blank line
dispatches the event.
"""

from __future__ import annotations

import codecs

import msgspec

__all__ = ["SSEEvent", "SSEParser"]


class SSEEvent(msgspec.Struct, frozen=True):
    data: str
    event: str = "message"


class SSEParser:
    """Feed raw bytes with :meth:`feed`; each call returns the events it completed."""

    def __init__(self, *, strict: bool = False) -> None:
        # strict: invalid UTF-8 raises UnicodeDecodeError (a backend adapter
        # turns it into a protocol error); lenient replaces it (a load
        # generator keeps timing).
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="strict" if strict else "replace")
        self._buffer = ""
        self._data: list[str] = []
        self._event = ""
        self._skip_lf = False  # the last chunk ended in CR: a leading LF belongs to it

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        text = self._decoder.decode(chunk)
        if text and self._skip_lf:
            self._skip_lf = False
            text = text.removeprefix("\n")
        self._buffer += text
        return self._drain()

    def close(self) -> list[SSEEvent]:
        """End of stream: flush a last event that lacked its blank line (lenient)."""
        self._buffer += self._decoder.decode(b"", final=True)
        events = self._drain()
        if self._buffer:
            events += self._line(self._buffer)
            self._buffer = ""
        if self._data:
            events += self._line("")
        return events

    def _drain(self) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        if "\r" not in self._buffer:
            # The common case (servers end lines in LF): one split, not a
            # search and a copy of the rest per line.
            # Inline, the common line and the common event (what _line and
            # _dispatch do for them): a call less each.
            lines = self._buffer.split("\n")
            self._buffer = lines.pop()
            for text in lines:
                if text.startswith("data: "):
                    self._data.append(text[6:])
                elif text:
                    self._line(text)
                elif self._data:
                    data = self._data
                    events.append(SSEEvent(data=data[0] if len(data) == 1 else "\n".join(data), event=self._event or "message"))
                    self._data, self._event = [], ""
                else:
                    self._event = ""
            return events
        while True:
            line = self._next_line()
            if line is None:
                return events
            events += self._line(line)

    def _next_line(self) -> str | None:
        """Pop one complete line, or ``None``. A ``\\r`` ends a line at once (an
        event is timed when its bytes arrive); if the next chunk starts with
        ``\\n``, that ``\\n`` is the rest of the same line break."""
        buf = self._buffer
        cr, lf = buf.find("\r"), buf.find("\n")
        ends = [i for i in (cr, lf) if i >= 0]
        if not ends:
            return None
        end = min(ends)
        width = 1
        if buf[end] == "\r":
            if end + 1 == len(buf):
                self._skip_lf = True
            elif buf[end + 1] == "\n":
                width = 2
        self._buffer = buf[end + width :]
        return buf[:end]

    def _line(self, line: str) -> list[SSEEvent]:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return []
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        return []

    def _dispatch(self) -> list[SSEEvent]:
        if not self._data:
            self._event = ""
            return []
        event = SSEEvent(data="\n".join(self._data), event=self._event or "message")
        self._data, self._event = [], ""
        return [event]

"""The simulator's trace format, and the requests it turns into.

A trace is JSON Lines, one request a line, in arrival order; an optional
first line is a header (any object with a ``headrace_trace`` key, the format
version, plus whatever describes where the trace came from)::

    {"headrace_trace": 1, "workload": "shared_prefix", "seed": 0, "params": {...}}
    {"t": 0.0312, "id": "c0.t0", "tenant": "tenant-3", "group": 3, "conversation": 0,
     "turn": 0, "prompt": [["0.sys3", 1712], ["0.c0.u0", 96]], "output_tokens": 211}
    {"t": 4.87, "id": "c0.t1", ..., "prompt": [["0.sys3", 1712], ["0.c0.u0", 96],
     ["0.c0.a0", 211], ["0.c0.u1", 143]], "output_tokens": 80}

- ``t``: arrival, in seconds from the start of the trace (non-decreasing).
- ``output_tokens``: tokens to generate (the request's ``max_tokens``; the
  modelled backend always generates all of them).
- The prompt, one of two ways. ``prompt_token_ids``: the ids themselves.
  ``prompt``: a list of *segments* ``[key, n]``, each standing for ``n``
  synthetic tokens drawn from ``key`` (:func:`segment_bytes`: SHAKE-128 of
  the key, mapped onto lowercase letters and spaces). Two prompts that start
  with the same segments share those tokens exactly, so a system prompt is one
  segment repeated in every request of its group, and turn k of a
  conversation repeats turn k-1's segments plus the previous answer and the
  new user message. Segments keep a 100k-request trace small (~30 MB).
- ``id``, ``tenant``, ``group``, ``conversation``, ``turn``: optional labels.

Replaying a trace for real: a segment's tokens are printable ASCII bytes, and
``headrace mock``'s token ids are a prompt's UTF-8 bytes, so sending
:func:`prompt_text` as a completion prompt gives the mock exactly the ids the
simulator hashed (and the same :func:`backends.base.chain_hashes`). A real
tokenizer splits that text differently, which changes the token counts, not
which requests share a prefix.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from backends.base import chain_hashes, hash_block
from policies.base import RouteRequest

__all__ = [
    "FORMAT_VERSION",
    "PromptBuilder",
    "SimRequest",
    "TraceError",
    "TraceRecord",
    "prepare",
    "prompt_text",
    "read_trace",
    "segment_bytes",
    "write_trace",
]

FORMAT_VERSION = 1
PREFIX_CHARS = 256  # RouteRequest.prefix, as router/dispatch.py cuts it
_ALPHABET = b"abcdefghijklmnopqrstuvwxyz      "  # 32 symbols, so byte % 32 is uniform
_TABLE = bytes(_ALPHABET[i % len(_ALPHABET)] for i in range(256))


class TraceError(Exception):
    """A trace that cannot be read: the message names the line."""


class TraceRecord(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    t: float
    output_tokens: int
    prompt: list[tuple[str, int]] | None = None
    prompt_token_ids: list[int] | None = None
    id: str = ""
    tenant: str = "default"
    group: int | None = None
    conversation: int | None = None
    turn: int | None = None


class SimRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One request ready to simulate: when, what the router would tell a policy, how long."""

    arrival: float
    route: RouteRequest
    output_tokens: int


def segment_bytes(key: str, n: int) -> bytes:
    """The ``n`` synthetic tokens of segment ``key``, as bytes (token id = byte).
    A prefix of a longer draw from the same key (SHAKE is an XOF)."""
    return hashlib.shake_128(key.encode()).digest(n).translate(_TABLE)


def prompt_text(record: TraceRecord) -> str:
    """The prompt as text: what a replay sends, byte for byte the ids simulated."""
    if record.prompt_token_ids is not None:
        return bytes(record.prompt_token_ids).decode("latin-1")
    return b"".join(segment_bytes(k, n) for k, n in record.prompt or ()).decode("ascii")


class PromptBuilder:
    """Block hashes of segment prompts, extending the longest prompt seen
    before that this one starts with (turn k from turn k-1, a first turn from
    its system prompt), so the cost grows with the new tokens only. The memo
    keeps the ``memo`` most recent prompts: their hashes, and the tokens of
    their last partial block."""

    def __init__(self, block_size: int, *, memo: int = 4096) -> None:
        self.block_size, self.memo_size = block_size, memo
        self._memo: OrderedDict[tuple[tuple[str, int], ...], tuple[tuple[int, ...], bytes]] = OrderedDict()

    def hashes(self, segments: list[tuple[str, int]]) -> tuple[int, ...]:
        key = tuple((k, n) for k, n in segments)
        found = self._memo.get(key)
        if found is not None:
            self._memo.move_to_end(key)
            return found[0]
        done, tail = 0, b""
        base: tuple[int, ...] = ()
        for k in range(len(key) - 1, 0, -1):
            hit = self._memo.get(key[:k])
            if hit is not None:
                done, (base, tail) = k, hit
                break
        if done == 0 and len(key) > 1:  # remember the first segment (a system prompt)
            base, tail = self._extend((), b"", key[:1])
            self._remember(key[:1], base, tail)
            done = 1
        hashes, tail = self._extend(base, tail, key[done:])
        self._remember(key, hashes, tail)
        return hashes

    def _extend(self, base: tuple[int, ...], tail: bytes,
                segments: Iterable[tuple[str, int]]) -> tuple[tuple[int, ...], bytes]:
        data = tail + b"".join(segment_bytes(k, n) for k, n in segments)
        bs, out = self.block_size, list(base)
        parent = out[-1] if out else None
        full = len(data) - len(data) % bs
        for start in range(0, full, bs):
            parent = hash_block(parent, tuple(data[start : start + bs]))
            out.append(parent)
        return tuple(out), data[full:]

    def _remember(self, key: tuple[tuple[str, int], ...], hashes: tuple[int, ...], tail: bytes) -> None:
        self._memo[key] = (hashes, tail)
        if len(self._memo) > self.memo_size:
            self._memo.popitem(last=False)


def _prefix(record: TraceRecord) -> str:
    if record.prompt_token_ids is not None:
        return bytes(t & 0xFF for t in record.prompt_token_ids[:PREFIX_CHARS]).decode("latin-1")
    parts, size = [], 0
    for k, n in record.prompt or ():
        take = min(n, PREFIX_CHARS - size)
        parts.append(segment_bytes(k, take))
        size += take
        if size >= PREFIX_CHARS:
            break
    return b"".join(parts).decode("ascii")


def prepare(records: Iterable[TraceRecord], block_size: int) -> Iterator[SimRequest]:
    """Each record as the router would describe it to a policy: block hashes
    of its prompt's full blocks, prompt length, tenant, a text prefix."""
    builder = PromptBuilder(block_size)
    for i, r in enumerate(records):
        if r.prompt_token_ids is not None:
            hashes, n = tuple(chain_hashes(r.prompt_token_ids, block_size)), len(r.prompt_token_ids)
        else:
            segments = r.prompt or []
            hashes, n = builder.hashes(segments), sum(c for _, c in segments)
        route = RouteRequest(
            request_id=r.id or f"r{i}", prefix=_prefix(r), tenant=r.tenant,
            block_hashes=hashes, block_size=block_size, prompt_tokens=n,
        )
        yield SimRequest(arrival=r.t, route=route, output_tokens=r.output_tokens)


def write_trace(path: str | os.PathLike[str], records: Iterable[TraceRecord],
                header: dict[str, Any] | None = None) -> int:
    """Write ``records`` (after ``header``, if given) as JSON Lines; returns how many."""
    encoder, n = msgspec.json.Encoder(), 0
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("wb") as out:
        if header is not None:
            out.write(encoder.encode({"headrace_trace": FORMAT_VERSION, **header}) + b"\n")
        for record in records:
            out.write(encoder.encode(record) + b"\n")
            n += 1
    return n


def read_trace(path: str | os.PathLike[str], *, limit: int | None = None) -> Iterator[TraceRecord]:
    """The records of a trace, checked (arrivals in order, one prompt form, sizes)."""
    decoder = msgspec.json.Decoder(TraceRecord)
    last, n = 0.0, 0
    with Path(path).open("rb") as lines:
        for lineno, line in enumerate(lines, 1):
            if not line.strip() or (lineno == 1 and b'"headrace_trace"' in line):
                continue
            if limit is not None and n >= limit:
                return
            try:
                record = decoder.decode(line)
            except msgspec.DecodeError as exc:
                raise TraceError(f"{path}:{lineno}: {exc}") from None
            _check(record, last, f"{path}:{lineno}")
            last, n = record.t, n + 1
            yield record


def _check(r: TraceRecord, last: float, where: str) -> None:
    problem = None
    if (r.prompt is None) == (r.prompt_token_ids is None):
        problem = "give exactly one of prompt (segments) or prompt_token_ids"
    elif r.t < last:
        problem = f"arrival t={r.t} is before the previous one ({last}); sort the trace by t"
    elif r.output_tokens < 1:
        problem = "output_tokens must be at least 1"
    elif r.prompt is not None and (not r.prompt or any(n < 1 for _, n in r.prompt)):
        problem = "prompt segments need a length of at least 1"
    elif r.prompt_token_ids is not None and (not r.prompt_token_ids or min(r.prompt_token_ids) < 0):
        problem = "prompt_token_ids must be non-empty and non-negative"
    if problem is not None:
        raise TraceError(f"{where}: {problem}")

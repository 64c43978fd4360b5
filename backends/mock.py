"""A deterministic fake backend, for tests and benchmarks.

Its output is a pure function of (prompt token ids, seed, position): the token
at absolute position ``p`` is drawn from a small word vocabulary by a CRC-32
of every preceding id, started from the seed's (the count of ids hashed is the
position). So a request resumed with ``prompt + emitted ids``, the same seed
and ``max_tokens - k`` continues exactly like the uninterrupted run, and a
test can tell an exact resume from a sloppy one; with ``resumed_tokens = k``
(the resume contract, ``GenerateRequest.resumed_tokens``) the stop strings,
the output cap and ``usage`` also count those k ids as output, so the rest of
the events is the uninterrupted run's, byte for byte. The CRC runs in C and rolls
forward one id at a time (``zlib.crc32(id, state)``, ~0.2 us); the splitmix64
in Python it replaced cost ~2 us per id, 270 us for a 130-byte prompt, most
of what a benchmark run spent in the mock.

Token ids 0..255 are bytes (prompt text tokenizes as its UTF-8 bytes); ids from
256 up are words of the vocabulary. Chat messages are rendered into text by a
trivial template. Time is spent with ``trio.sleep`` (so a ``MockClock`` drives
it) and faults are injected in-process as :mod:`backends.errors` exceptions;
``backends.mock_server`` injects the same faults at the HTTP level instead.

With ``block_size > 0`` a replica models one accelerator's prefix cache
(:mod:`backends.mock_cache`): the first token comes ``ttft_s`` plus the
uncached prompt tokens times ``prefill_s_per_token`` after the request, the
prefills of concurrent requests take turns in one lane (so load matters;
by priority, then arrival, a chunk of ``prefill_chunk_tokens`` at a time),
``usage.cached_tokens`` says what the cache served, and :meth:`MockBackend.kv_events`
publishes what it caches and evicts. Off (the default), nothing changes.
"""

from __future__ import annotations

import heapq
import random
import struct
import zlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Literal

import msgspec
import trio

from backends.base import (
    BackendInfo,
    ChatMessage,
    Event,
    GenerateRequest,
    Health,
    KVEvent,
    Logprob,
    TopLogprob,
    Usage,
    chain_hashes,
)
from backends.errors import (
    BackendProtocolError,
    BackendUnavailable,
    BadRequest,
    ContextLengthExceeded,
    HeadraceError,
    ModelNotFound,
    StreamBroken,
    UpstreamError,
    UpstreamRateLimited,
)
from backends.mock_cache import PrefixCache, PrefixCacheStatistics
from backends.tally import StreamTally

__all__ = [
    "DEFAULT_VOCAB",
    "Fault",
    "MockBackend",
    "MockConfig",
    "MockRun",
    "MockStatistics",
    "PrefillLane",
    "decode_ids",
    "encode_text",
    "fault_applies",
    "parse_fault",
    "render_chat",
]

MASK64 = (1 << 64) - 1
BYTE_IDS = 256  # ids below are bytes

DEFAULT_VOCAB: tuple[str, ...] = tuple(
    " " + w
    for w in [
        "the",
        "river",
        "runs",
        "under",
        "a",
        "stone",
        "bridge",
        "and",
        "water",
        "turns",
        "its",
        "wheel",
        "of",
        "an",
        "old",
        "mill",
        "where",
        "grain",
        "becomes",
        "flour",
        "while",
        "clouds",
        "drift",
        "over",
        "green",
        "hills",
        "toward",
        "quiet",
        "towns",
        "near",
        "tall",
        "pines",
        "in",
        "morning",
        "light",
        "every",
        "day",
        "slowly",
        "again",
    ]
)

FaultKind = Literal[
    "cut", "stall", "status", "malformed", "no_done", "no_final", "slow_first_token", "diverge"
]


class Fault(msgspec.Struct, frozen=True, kw_only=True):
    """One injected failure. ``after`` counts tokens already sent (by this
    stream: a resumed request's earlier output is not counted).

    ``no_done``: the stream ends after its final event (finish reason and
    usage) without ``data: [DONE]``, a complete answer; in-process, where
    there is no ``[DONE]``, nothing changes. ``no_final``: the stream ends
    right before its final event (the event with the finish reason, and the
    last token in it): in-process :class:`StreamBroken` where it would come,
    over HTTP a clean end of the body. ``diverge``: the output is not a
    function of the request (the request counter is mixed into the seed), so
    a replay of the same request gives other text."""

    kind: FaultKind
    after: int = 0
    status: int = 500
    retry_after: float | None = None
    delay_s: float = 0.0


def parse_fault(spec: str) -> Fault:
    """Parse the CLI spelling: ``cut-after=N``, ``stall-after=N``,
    ``malformed-after=N``, ``no-done``, ``no-final``, ``diverge``,
    ``slow-first-token=MS``, ``status=500|503[:retry-after=S]``,
    ``429[:retry-after=S]``."""
    head, _, tail = spec.strip().partition(":")
    name, _, value = head.partition("=")
    retry_after = _parse_retry_after(tail, spec)
    try:
        if name in ("cut-after", "stall-after", "malformed-after"):
            kind = {"cut-after": "cut", "stall-after": "stall", "malformed-after": "malformed"}[
                name
            ]
            return Fault(kind=kind, after=_non_negative(int(value)))  # type: ignore[arg-type]
        if name in _BARE_FAULTS and not value and not tail:
            return Fault(kind=_BARE_FAULTS[name])
        if name == "slow-first-token":
            return Fault(kind="slow_first_token", delay_s=_non_negative(float(value)) / 1000)
        if name == "status" or (name.isdigit() and not value):
            code = int(value if name == "status" else name)
            if not 400 <= code <= 599:
                raise ValueError
            return Fault(kind="status", status=code, retry_after=retry_after)
    except ValueError:
        pass
    raise ValueError(
        f"bad fault {spec!r}: use cut-after=N, stall-after=N, malformed-after=N, no-done, "
        "no-final, diverge, slow-first-token=MS, status=500|503[:retry-after=S] or "
        "429[:retry-after=S]"
    )


_BARE_FAULTS: dict[str, FaultKind] = {"no-done": "no_done", "no-final": "no_final", "diverge": "diverge"}


def _parse_retry_after(tail: str, spec: str) -> float | None:
    if not tail:
        return None
    key, _, value = tail.partition("=")
    try:
        if key != "retry-after":
            raise ValueError
        return _non_negative(float(value))
    except ValueError:
        raise ValueError(f"bad fault {spec!r}: the suffix must be retry-after=SECONDS") from None


def _non_negative(x: float) -> float:
    if x < 0:
        raise ValueError
    return x


def fault_applies(seed: int, index: int, rate: float) -> bool:
    """Whether request number ``index`` is hit: a deterministic draw."""
    if rate >= 1.0:
        return True
    return random.Random(_mix(seed, index, 0xFA17)).random() < rate


class MockConfig(msgspec.Struct, frozen=True, kw_only=True):
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    max_tokens: int = 256  # output length cap; also the default when a request has none
    max_context: int = 4096
    models: tuple[str, ...] = ("mock",)
    name: str = "mock"
    vocab: tuple[str, ...] = DEFAULT_VOCAB
    faults: Sequence[Fault] = ()
    fault_rate: float = 1.0
    seed: int = 0  # for fault draws and for seeds drawn for seedless requests
    # False: a backend that does not report token ids (an ordinary OpenAI
    # server): events carry no token ids, prompt ids or seed, and info() says
    # token_ids=False (the HTTP mock ignores ``return_token_ids``).
    token_ids: bool = True
    # The prefix-cache cost model (backends.mock_cache), on when block_size > 0:
    # tokens per KV block, the LRU's capacity in blocks, and the prefill cost of
    # each uncached prompt token (paid in the replica's one prefill lane).
    block_size: int = 0
    cache_blocks: int = 4096
    prefill_s_per_token: float = 0.0
    # Chunked prefill: a prefill holds the lane this many tokens at a time, so
    # a higher-priority request (a resumed stream, an interactive one) waits at
    # most one chunk, as in the engine (its 512-token budget per step) and
    # vLLM; 0: a whole prompt at once.
    prefill_chunk_tokens: int = 512


class MockStatistics(msgspec.Struct, frozen=True):
    in_flight: int
    started: int
    completed: int
    cancelled: int
    failed: int
    rejected: int  # refused before starting (bad request, context length)
    cache: PrefixCacheStatistics | None = None  # with the prefix-cache model on


# ---------------------------------------------------------------- pure parts


def _mix(*values: int) -> int:
    """splitmix64 over a sequence of integers."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & MASK64)) & MASK64
        h = (h + 0x9E3779B97F4A7C15) & MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & MASK64
        h ^= h >> 31
    return h


def encode_text(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def render_chat(messages: Sequence[ChatMessage]) -> str:
    parts = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else _content_text(m.content)
        parts.append(f"<|{m.role}|>{content}\n")
    return "".join(parts) + "<|assistant|>"


def _content_text(content: list[object] | None) -> str:
    if content is None:
        return ""
    texts = [p.get("text", "") for p in content if isinstance(p, dict)]
    return "".join(t for t in texts if isinstance(t, str))


def decode_ids(ids: Sequence[int], vocab: Sequence[str] = DEFAULT_VOCAB) -> str:
    """Text of ids: byte runs decode as UTF-8, words as themselves."""
    out, run = [], bytearray()
    for t in ids:
        if t < BYTE_IDS:
            run.append(t)
            continue
        if run:
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
        out.append(_word(t, vocab))
    if run:
        out.append(run.decode("utf-8", errors="replace"))
    return "".join(out)


def _word(token_id: int, vocab: Sequence[str]) -> str:
    i = token_id - BYTE_IDS
    return vocab[i] if 0 <= i < len(vocab) else f"<{token_id}>"


def _ids_bytes(ids: Sequence[int]) -> bytes:
    """Token ids as the hash reads them: 8 bytes each, little-endian."""
    try:
        return struct.pack(f"<{len(ids)}Q", *ids)
    except struct.error:  # an id past 64 bits (ids are checked non-negative)
        return struct.pack(f"<{len(ids)}Q", *(t & MASK64 for t in ids))


class _Generation:
    """The sans-I/O core of one stream: each ``step()`` draws one token and
    returns what to emit. Holds back text that may begin a stop string.

    A resumed generation (the last ``resumed`` ids of ``prompt`` are its own
    earlier output) replays that output first, emitting nothing: it counts
    towards ``emitted`` and ``limit`` (which is what remains of it), and its
    text goes through the stop-string look-behind, so text held back before
    the break comes out, and a stop string straddling it stops, exactly as
    in the uninterrupted run. The tokens themselves need nothing: they are a
    function of every id before them, whatever the split."""

    def __init__(
        self,
        prompt: list[int],
        seed: int,
        limit: int,
        request: GenerateRequest,
        vocab: Sequence[str],
        resumed: int = 0,
    ) -> None:
        self.seed, self.vocab = seed, vocab
        self.limit = resumed + limit
        self.position = len(prompt)
        # Started from the seed; the ids fed so far are the position and history.
        self.hash = zlib.crc32(_ids_bytes(prompt), zlib.crc32((seed & MASK64).to_bytes(8, "little")))
        self.stops = list(request.stop)
        self.stop_ids = set(request.stop_token_ids)
        self.logprobs = request.logprobs
        self.resumed = resumed
        self.emitted = 0
        self.pending = ""
        self._replay(prompt[len(prompt) - resumed :])

    def _replay(self, output: list[int]) -> None:
        """Take in earlier output without emitting it; one that should have
        stopped already is not a generation to continue."""
        for token in output:
            self.emitted += 1
            stopped = token in self.stop_ids
            if self.stops and not stopped:
                stopped = self._text(_word(token, self.vocab))[1]
            if stopped:
                raise BadRequest(
                    f"resumed token {self.emitted} ends the generation (a stop): "
                    "there is nothing to continue", param="resumed_tokens",
                )

    def step(self) -> tuple[int, str, list[Logprob] | None, Literal["stop", "length"] | None]:
        token = BYTE_IDS + self.hash % len(self.vocab)
        logprobs = self._logprobs(token) if self.logprobs is not None else None
        self.hash = zlib.crc32(token.to_bytes(8, "little"), self.hash)
        self.position += 1
        self.emitted += 1
        if token in self.stop_ids:
            return token, self._flush(), logprobs, "stop"
        piece = _word(token, self.vocab)
        if self.stops:
            piece, stopped = self._text(piece)
            if stopped:
                return token, piece, logprobs, "stop"
        if self.emitted >= self.limit:
            return token, piece + self._flush(), logprobs, "length"
        return token, piece, logprobs, None

    def plain(self) -> bool:
        """No stop strings, stop ids or logprobs: the rest can be drawn in one go."""
        return not self.stops and not self.stop_ids and self.logprobs is None

    def draw(self, n: int) -> list[int]:
        """The next ``n`` tokens of a :meth:`plain` generation, in one loop."""
        h, v, crc, out = self.hash, len(self.vocab), zlib.crc32, []
        for _ in range(n):
            token = BYTE_IDS + h % v
            out.append(token)
            h = crc(token.to_bytes(8, "little"), h)
        self.hash = h
        self.position += n
        self.emitted += n
        return out

    def _text(self, piece: str) -> tuple[str, bool]:
        buf = self.pending + piece
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return buf[: min(hits)], True
        hold = max(
            (k for s in self.stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0
        )
        self.pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def _flush(self) -> str:
        text, self.pending = self.pending, ""
        return text

    def _logprobs(self, token: int) -> list[Logprob]:
        n = self.logprobs or 0
        chosen = -round((zlib.crc32(b"logprob", self.hash) % 4000) / 1000.0 + 0.01, 3)
        top = [TopLogprob(token, chosen, _word(token, self.vocab))] if n else []
        v = len(self.vocab)
        for j in range(1, n):
            alt = BYTE_IDS + (token - BYTE_IDS + j) % v
            top.append(TopLogprob(alt, round(chosen - 0.5 * j, 3), _word(alt, self.vocab)))
        return [Logprob(token, chosen, _word(token, self.vocab), top)]


class PrefillLane:
    """One replica's prefill lane: one request at a time, the highest
    ``priority`` waiting first and, among equals, the one that came first
    (the engine's scheduler order). A waiter cancelled after it was handed
    the lane passes it on. The holder may :meth:`yield_` between chunks of
    its prefill (chunked prefill, as the engine's token budget per step
    does): a higher-priority waiter goes first, and the holder comes back
    before anyone it came ahead of."""

    def __init__(self) -> None:
        self._busy = False
        self._waiting: list[tuple[int, int, trio.Event]] = []  # a heap of (-priority, arrival, wake)
        self._arrivals = 0

    @asynccontextmanager
    async def turn(self, priority: int = 0) -> AsyncIterator[LaneTurn]:
        self._arrivals += 1
        held = LaneTurn((-priority, self._arrivals))
        if self._busy:
            await self._wait(held.order)
        else:
            self._busy = True
        try:
            yield held
        finally:
            if held.held:
                self._release()

    async def yield_(self, turn: LaneTurn) -> None:
        """Hand the lane ``turn`` holds to a higher-priority waiter, if any, and wait for it back."""
        if self._waiting and self._waiting[0][:2] < turn.order:
            turn.held = False
            self._release()  # the lane is theirs; it comes back in this turn's order
            await self._wait(turn.order)  # cancelled: not held (passed on if it was handed back)
            turn.held = True

    async def _wait(self, order: tuple[int, int]) -> None:
        entry = (*order, trio.Event())
        heapq.heappush(self._waiting, entry)
        try:
            await entry[2].wait()
        except BaseException:
            if entry[2].is_set():
                self._release()  # handed the lane as it was cancelled: pass it on
            else:
                self._waiting.remove(entry)
                heapq.heapify(self._waiting)
            raise

    def _release(self) -> None:
        if self._waiting:
            heapq.heappop(self._waiting)[2].set()  # the lane stays busy: it is theirs now
        else:
            self._busy = False


@dataclass(slots=True)
class LaneTurn:
    """A place in a :class:`PrefillLane`: its order, and whether it holds the lane now."""

    order: tuple[int, int]  # (-priority, arrival)
    held: bool = True


class MockRun:
    """One admitted request, stepped without I/O: ``step()`` gives each event
    (the first carries the prompt ids and seed; the last its finish reason and
    usage). :meth:`MockBackend.stream` paces these events in time; the HTTP
    fast path of ``backends.mock_server`` renders them straight to bytes.

    ``prompt`` is every id the request gave (what the prefix cache sees); a
    resumed request's last ``resumed`` of them are its earlier output, so its
    first event reports the prompt before them and its usage counts them as
    completion tokens, as the uninterrupted run's does. With ``ids`` off (a
    backend that does not report token ids) events carry no token ids, prompt
    ids or seed.

    Used as a context manager it counts in the backend's statistics like a
    stream: *completed* once :meth:`sent` reports the final event delivered,
    *cancelled* when left before that."""

    def __init__(
        self, tally: StreamTally, prompt: list[int], seed: int, gen: _Generation,
        faults: list[Fault], *, ids: bool = True,
    ) -> None:
        self._tally = tally
        self.prompt, self.seed, self.faults, self.ids = prompt, seed, faults, ids
        self.resumed = gen.resumed
        self._gen = gen
        self.finished = False  # the final event has been produced
        self._delivered = False
        self.cached_tokens = 0  # prompt tokens the prefix cache served (its model on)
        self.block_hashes: list[int] = []  # the prompt's full blocks (its model on)
        self.priority = 0  # its turn in the prefill lane: higher goes first (as in the engine)

    @property
    def emitted(self) -> int:
        """Output tokens so far, a resumed request's earlier ones included."""
        return self._gen.emitted

    @property
    def sent_tokens(self) -> int:
        """Output tokens this run has produced (what faults' ``after`` counts)."""
        return self._gen.emitted - self.resumed

    @property
    def original_prompt(self) -> list[int]:
        """The prompt without a resumed request's earlier output."""
        return self.prompt[: len(self.prompt) - self.resumed]

    def step(self) -> Event:
        token, text, logprobs, finish = self._gen.step()
        event = Event(token_ids=[token], text=text, logprobs=logprobs)
        if self.sent_tokens == 1:
            event.prompt_token_ids, event.seed = self.original_prompt, self.seed
        if finish is not None:
            self.finished = True
            event.finish_reason, event.usage = finish, self._usage()
        if not self.ids:
            event.token_ids, event.prompt_token_ids, event.seed = [], None, None
        return event

    def _usage(self) -> Usage:
        prompt = len(self.prompt) - self.resumed
        return Usage(prompt_tokens=prompt, completion_tokens=self.emitted,
                     cached_tokens=min(self.cached_tokens, prompt))

    def rest(self) -> list[Event]:
        """Every remaining event at once: what a run without delays sends."""
        gen = self._gen
        if not gen.plain() or self.faults or self.finished or not self.ids:
            events = []
            while not self.finished:
                events.append(self.step())
            return events
        first = self.sent_tokens == 0
        vocab = gen.vocab
        events = [Event(token_ids=[t], text=vocab[t - BYTE_IDS])
                  for t in gen.draw(gen.limit - gen.emitted)]
        if first:
            events[0].prompt_token_ids, events[0].seed = self.original_prompt, self.seed
        events[-1].finish_reason = "length"
        events[-1].usage = self._usage()
        self.finished = True
        return events

    def sent(self) -> None:
        """The consumer has the final event."""
        self._delivered = self.finished

    def __enter__(self) -> MockRun:
        self._tally.begin()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._delivered:
            self._tally.end("completed")
        else:
            self._tally.end("failed" if isinstance(exc, HeadraceError) else "cancelled")


# ---------------------------------------------------------------- the backend


class MockBackend:
    """The deterministic fake as a :class:`~backends.base.Backend`."""

    def __init__(self, config: MockConfig | None = None) -> None:
        self.config = config or MockConfig()
        self._seeds = random.Random(self.config.seed)
        self._requests = 0
        self._tally = StreamTally()
        self._rejected = 0
        c = self.config
        self.cache = PrefixCache(c.cache_blocks, c.block_size) if c.block_size > 0 else None
        self._lane = PrefillLane()  # one prefill at a time: higher priority, then arrival order
        self._kv_changed = trio.Event()

    def info(self) -> BackendInfo:
        """Its output is a function of the request alone (``exact_resume``),
        unless it does not report token ids or the ``diverge`` fault is on."""
        c = self.config
        diverges = any(f.kind == "diverge" for f in c.faults)
        return BackendInfo(
            name=c.name, models=c.models, max_context=c.max_context, token_ids=c.token_ids,
            seeds=not diverges, kv_events=self.cache is not None, block_size=c.block_size or None,
            kv_capacity_blocks=self.cache.capacity if self.cache is not None else None,
            prefix_sharing=self.cache is not None,  # its prefill lane is FIFO: a later prompt finds an earlier one's blocks
            tokenizer="bytes",  # its token ids are the prompt's bytes (encode_text)
            exact_resume=c.token_ids and not diverges,
        )

    async def health(self) -> Health:
        return Health(ok=True)

    async def aclose(self) -> None:
        return None

    def statistics(self) -> MockStatistics:
        t = self._tally
        cache = self.cache.statistics() if self.cache is not None else None
        return MockStatistics(
            t.in_flight, t.started, t.completed, t.cancelled, t.failed, self._rejected, cache
        )

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            if any(t < 0 for t in request.prompt_token_ids):
                raise BadRequest("prompt token ids must be non-negative", param="prompt")
            return list(request.prompt_token_ids)
        if request.messages is not None:
            return encode_text(render_chat(request.messages))
        return encode_text(request.prompt or "")

    def _limit(self, request: GenerateRequest, n_prompt: int) -> int:
        """The tokens left to generate. A resumed request's earlier output is
        in ``n_prompt`` and spent from the output cap, so it stops where the
        uninterrupted run would have."""
        c = self.config
        if request.model and c.models and request.model not in c.models:
            raise ModelNotFound(f"The model `{request.model}` does not exist.", param="model")
        asked, resumed = request.max_tokens, request.resumed_tokens
        if asked is not None and asked < 1:
            raise BadRequest("max_tokens must be at least 1", param="max_tokens")
        if n_prompt + (asked or 1) > c.max_context:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {c.max_context} tokens; the request has "
                f"{n_prompt} prompt tokens and asks for {asked or 1} more.",
                param="max_tokens",
            )
        if resumed >= c.max_tokens:
            raise BadRequest(
                f"resumed_tokens {resumed} reaches the output cap of {c.max_tokens} tokens",
                param="resumed_tokens",
            )
        return min(asked or c.max_tokens, c.max_tokens - resumed, c.max_context - n_prompt)

    @staticmethod
    def _resumed(request: GenerateRequest, n_prompt: int) -> int:
        k = request.resumed_tokens
        if k and request.prompt_token_ids is None:
            raise BadRequest("resumed_tokens needs a token-id prompt", param="resumed_tokens")
        if not 0 <= k <= n_prompt:
            raise BadRequest(
                f"resumed_tokens must be between 0 and the prompt's {n_prompt} tokens",
                param="resumed_tokens",
            )
        return k

    def _seed(self, request: GenerateRequest) -> int:
        """The request's seed; else 0 when greedy (temperature 0 output must
        not vary), else a fresh draw (reported on the first event)."""
        if request.seed is not None:
            return request.seed & MASK64
        if request.temperature == 0:
            return 0
        return self._seeds.getrandbits(63)

    def _faults(self, index: int) -> list[Fault]:
        """The faults that hit request number ``index``."""
        c = self.config
        return list(c.faults) if c.faults and fault_applies(c.seed, index, c.fault_rate) else []

    def admit(self, request: GenerateRequest) -> MockRun:
        """Check ``request`` and set up its generation; raises the
        :class:`~backends.errors.HeadraceError` a stream would raise first."""
        index = self._requests  # taken only by a request that is admitted
        try:
            prompt = self.prompt_ids(request)
            resumed = self._resumed(request, len(prompt))
            limit = self._limit(request, len(prompt))
            seed = self._seed(request)
            faults = self._faults(index)
            # diverge: the same request draws other tokens each time (the seed
            # it reports is still the one asked for, as a sloppy server's is).
            drawn = _mix(seed, index) if any(f.kind == "diverge" for f in faults) else seed
            gen = _Generation(prompt, drawn, limit, request, self.config.vocab, resumed)
        except HeadraceError:
            self._rejected += 1
            raise
        self._requests += 1
        run = MockRun(self._tally, prompt, seed, gen, faults, ids=self.config.token_ids)
        run.priority = request.priority
        return run

    async def prefill(self, run: MockRun, delay: float = 0.0) -> None:
        """Wait out ``run``'s time to first token: ``ttft_s + delay``, then, with
        the cache model on, its turn in the prefill lane and its uncached tokens."""
        await trio.sleep(self.config.ttft_s + delay)
        cache = self.cache
        if cache is None:
            return
        chunk = self.config.prefill_chunk_tokens
        async with self._lane.turn(run.priority) as turn:
            uncached = self._lookup(cache, run)
            while chunk and uncached > chunk:
                await trio.sleep(chunk * self.config.prefill_s_per_token)
                uncached -= chunk
                await self._lane.yield_(turn)
            await trio.sleep(uncached * self.config.prefill_s_per_token)
            self._store(cache, run)

    def prefill_now(self, run: MockRun) -> None:
        """:meth:`prefill` without the waiting, for a replica whose delays are all zero."""
        if self.cache is not None:
            self._lookup(self.cache, run)
            self._store(self.cache, run)

    @staticmethod
    def _lookup(cache: PrefixCache, run: MockRun) -> int:
        """Sets ``run.cached_tokens``; returns the prompt tokens left to compute."""
        run.block_hashes = chain_hashes(run.prompt, cache.block_size)
        run.cached_tokens = cache.match(run.block_hashes, len(run.prompt))
        return len(run.prompt) - run.cached_tokens

    def _store(self, cache: PrefixCache, run: MockRun) -> None:
        if cache.store(run.block_hashes):
            self._kv_changed.set()
            self._kv_changed = trio.Event()

    async def kv_events(self, since: int = -1) -> AsyncIterator[KVEvent]:
        """KV events with ``seq > since``, then new ones as they happen (forever),
        as ``EngineBackend.kv_events`` gives them: the last 10,000 are kept, so a
        subscriber further behind sees a gap in ``seq``. Without the cache model
        there are none."""
        last = since
        while True:
            changed = self._kv_changed
            for event in self.cache.since(last) if self.cache is not None else ():
                last = event.seq
                yield event
            await changed.wait()

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
        run = self.admit(request)
        async with aclosing(self._tally.track(self._run(run))) as events:
            async for event in events:
                yield event

    async def _run(self, run: MockRun) -> AsyncGenerator[Event, None]:
        faults = run.faults
        delay = sum(f.delay_s for f in faults if f.kind == "slow_first_token")
        await self.prefill(run, delay)
        _raise_status(faults)
        no_final = any(f.kind == "no_final" for f in faults)
        while True:
            await _token_fault(faults, run.sent_tokens)
            event = run.step()
            if run.finished and no_final:
                raise StreamBroken(
                    f"injected fault: the stream ended before its final event "
                    f"({run.sent_tokens - 1} tokens sent)"
                )
            yield event
            if run.finished:
                return
            await trio.sleep(self.config.tpot_s)


def _raise_status(faults: list[Fault]) -> None:
    for f in faults:
        if f.kind != "status":
            continue
        if f.status == 429:  # as an HTTP adapter translates a real 429
            raise UpstreamRateLimited("injected fault: status 429", retry_after=f.retry_after)
        if f.status == 503:
            raise BackendUnavailable(
                f"injected fault: status {f.status}", retry_after=f.retry_after
            )
        raise UpstreamError(f"injected fault: status {f.status}")


async def _token_fault(faults: list[Fault], emitted: int) -> None:
    """Faults that fire once ``after`` tokens have been sent."""
    for f in faults:
        if f.after != emitted:
            continue
        if f.kind == "cut":
            raise StreamBroken(f"injected fault: stream cut after {emitted} tokens")
        if f.kind == "malformed":
            raise BackendProtocolError(f"injected fault: malformed chunk after {emitted} tokens")
        if f.kind == "stall":
            await trio.sleep_forever()

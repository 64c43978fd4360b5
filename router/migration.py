"""Stream migration: what a broken stream needs to continue on another backend.

A stream that fails after its first event is resumed by the dispatcher
(:mod:`router.dispatch`) on another backend of the same route, in the same
response. This module holds the parts that do no I/O::

    Progress         what the client has been sent: prompt ids, output ids, text,
                     the seed the backend drew, the logprob entries
    resume_request   the continuation by token ids: prompt + emitted ids, the
                     ``resumed_tokens`` contract, max/min_tokens reduced, same seed
    resume_placement where a continuation may go: the candidates where it would
                     wait least for its first token (queued prefill, its own
                     uncached tokens, in-flight), so that a dead backend's
                     streams spread by the work queued, not by turn
    Replay           for backends without token ids: the original request again
                     (same seed); its text must begin with exactly what the client
                     has, which is dropped; anything else is a divergence
    StallWatch       each backend's inter-token latency, for the stall watchdog:
                     max(2 x p99, floor) once measured, the initial timeout before
    Standby          a stream's warm standby (opt-in, ``standby_tokens``): every N
                     tokens relayed, prompt + output so far prefilled on one other
                     backend that holds the prompt, so that a resume there
                     recomputes at most ~N tokens, not the whole output
    Settings         the knobs ([migration] and per [[models]] overrides)

The client never sees a byte twice or a gap: a continuation's events are
relayed as they come (token mode) or after the replayed prefix has been
checked and cut (replay mode); ``usage`` is rewritten to count the original
prompt once and every generated token once. When a stream cannot be resumed
(no backend left, the migration limit, a replay that diverged) the client
gets :class:`~backends.errors.MigrationFailed`, never a truncated success.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence

import msgspec

from backends.base import Event, GenerateRequest, Logprob, Usage
from backends.errors import (
    BackendProtocolError,
    BackendStalled,
    BackendTimeout,
    MigrationFailed,
    StreamBroken,
    UpstreamError,
)
from policies.base import BackendView, RouteRequest
from policies.kv_aware import KVAware

__all__ = [
    "HELD_FRACTION",
    "REASONS",
    "RESUME_BURST_S",
    "RESUME_DECODE_S_PER_SEQ",
    "RESUME_LONG_WAIT_S",
    "RESUME_PREFILL_S_PER_TOKEN",
    "RESUME_PRIORITY_BOOST",
    "RESUME_SHORT_PREFILL_TOKENS",
    "STANDBY_OUTCOMES",
    "STANDBY_PATIENCE",
    "MigrationStatistics",
    "Progress",
    "Replay",
    "Settings",
    "StallTimeout",
    "StallWatch",
    "Standby",
    "held_nowhere",
    "prefix_label",
    "reason_of",
    "resume_placement",
    "resume_request",
    "short_prefill_first",
    "standby_request",
    "text_continuation",
    "text_request",
]

# How a warm standby's sync ended, as the metrics label it.
STANDBY_OUTCOMES = ("synced", "failed", "skipped")

# Why a stream broke, as the metrics label it.
REASONS = ("broken", "stall", "timeout", "protocol", "error", "no_final")

# The resume gap's ``prefix`` label: "held" when the backend that continued a
# stream served at least this fraction of its original prompt from its cache.
HELD_FRACTION = 0.9


def prefix_label(cached_tokens: int | None, prompt_tokens: int) -> str:
    """``held`` when the continuation's usage says its backend served at
    least :data:`HELD_FRACTION` of the original ``prompt_tokens`` from its
    prefix cache, ``missed`` when less, ``unknown`` when it reported no usage
    (it broke again before its final event)."""
    if cached_tokens is None or prompt_tokens <= 0:
        return "unknown"
    return "held" if cached_tokens >= HELD_FRACTION * prompt_tokens else "missed"


class StallTimeout(BackendStalled):
    """The router's own watchdog (for backends that do not time their
    streams): no event from the backend for too long."""


class _NoFinal(StreamBroken):
    """The backend's stream ended without its final event."""


def no_final(events: int) -> StreamBroken:
    return _NoFinal(f"the backend stream ended before its final event (after {events} events)")


def reason_of(exc: UpstreamError) -> str:
    """The metrics label of a mid-stream failure."""
    if isinstance(exc, BackendStalled):
        return "stall"
    if isinstance(exc, _NoFinal):
        return "no_final"
    if isinstance(exc, BackendTimeout):
        return "timeout"
    if isinstance(exc, BackendProtocolError):
        return "protocol"
    if isinstance(exc, StreamBroken):
        return "broken"
    return "error"


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """How streams are watched and migrated (``[migration]`` in the config,
    overridden per model route)."""

    enabled: bool = True
    max_migrations: int = 3  # per request
    # None: auto, max(stall_factor x the backend's p99 inter-token latency, stall_floor),
    # and stall_initial until the backend has stall_samples measurements.
    stall_timeout: float | None = None
    stall_factor: float = 2.0
    stall_floor: float = 1.0
    stall_initial: float = 10.0
    stall_samples: int = 64
    first_token_timeout: float | None = None  # None: the backend adapter's own
    replay: bool = True  # replay and verify on backends that report no token ids
    # Completions only, opt-in: where no backend has token ids and replay is off
    # or diverged, continue from prompt + the text sent (inexact, counted so).
    text_continuation: bool = False
    # Warm standby, opt-in: every this many tokens a stream relays, its prompt
    # and output so far are prefilled (max_tokens 1) on one other backend of
    # its route that holds its prompt; a resume there recomputes at most about
    # this many tokens instead of the whole output. Costs that backend a short
    # prefill per N tokens per stream and the stream's KV blocks. 0: off.
    standby_tokens: int = 0


class MigrationStatistics(msgspec.Struct, frozen=True, kw_only=True):
    # (reason, outcome) -> count; outcome: resumed (by token ids), replayed
    # (replay and verify), continued (text continuation, inexact), failed (the
    # client got the terminal error).
    migrations: dict[str, int] = {}
    divergences: int = 0  # replays whose text differed from what the client had
    inexact: int = 0  # resumed on a backend that does not promise exact resume
    # Warm standby syncs by outcome: synced, failed, skipped (no other
    # backend held the prompt); and the tokens the synced ones sent less
    # those their backends reported cached (a resumed request's usage counts
    # the original prompt's only: an upper bound of what they prefilled).
    standby_syncs: dict[str, int] = {}
    standby_tokens: int = 0


class Progress:
    """What has been relayed so far: enough to resume elsewhere."""

    __slots__ = (
        "_pieces", "cached", "events", "finished", "ids_complete", "logprobs", "prompt_token_ids", "seed", "text_events", "token_ids",
    )  # fmt: skip

    def __init__(self) -> None:
        self.prompt_token_ids: list[int] | None = None
        self.token_ids: list[int] = []
        self._pieces: list[str] = []  # the text, joined only when a resume reads it
        self.text_events = 0  # events that carried text (a token count where there are no ids)
        self.seed: int | None = None
        self.events = 0
        self.logprobs = 0  # logprob entries relayed
        self.finished = False  # the final event (finish_reason) was relayed
        self.ids_complete = True  # every event with text carried its token ids
        self.cached: int | None = None

    def add(self, event: Event) -> None:
        self.events += 1
        if event.token_ids:
            self.token_ids += event.token_ids
        elif event.text:
            self.ids_complete = False
        if event.text:
            self._pieces.append(event.text)
            self.text_events += 1
        if event.logprobs:
            self.logprobs += len(event.logprobs)
        if event.prompt_token_ids is not None and self.prompt_token_ids is None:
            self.prompt_token_ids = event.prompt_token_ids
        if event.seed is not None and self.seed is None:
            self.seed = event.seed
        if event.finish_reason is not None:
            self.finished = True
        if event.usage is not None and self.cached is None:
            self.cached = event.usage.cached_tokens

    @property
    def text(self) -> str:
        """The text relayed so far (its pieces, joined once: adding each
        event's to a string copied all of it every event)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def resumable_by_ids(self) -> bool:
        return self.prompt_token_ids is not None and self.ids_complete and bool(self.token_ids)

    def usage(self, reported: Usage | None) -> Usage:
        """The whole generation's usage: the original prompt once, every
        token the client received once."""
        prompt = len(self.prompt_token_ids) if self.prompt_token_ids is not None else (reported.prompt_tokens if reported else 0)
        cached = reported.cached_tokens if reported is not None else (self.cached or 0)
        return Usage(prompt_tokens=prompt, completion_tokens=len(self.token_ids), cached_tokens=min(cached, prompt))


# A continuation goes one step ahead of new requests of its class in the
# backend's queue (the engine schedules by priority, then arrival): the client
# is mid-answer, and a killed backend's streams all resume at once.
RESUME_PRIORITY_BOOST = 1


def resume_request(request: GenerateRequest, progress: Progress) -> GenerateRequest:
    """The continuation of ``request`` after what ``progress`` relayed: by
    token ids, with the resume contract (:attr:`GenerateRequest.resumed_tokens`),
    its priority raised by :data:`RESUME_PRIORITY_BOOST`."""
    assert progress.prompt_token_ids is not None
    k = len(progress.token_ids)
    return msgspec.structs.replace(
        request,
        prompt=None,
        messages=None,
        prompt_token_ids=[*progress.prompt_token_ids, *progress.token_ids],
        resumed_tokens=k,
        max_tokens=None if request.max_tokens is None else request.max_tokens - k,
        min_tokens=max(0, request.min_tokens - k),
        seed=progress.seed if progress.seed is not None else request.seed,
        priority=request.priority + RESUME_PRIORITY_BOOST,
    )


# A continuation whose own prefill fits one step of the engine's token budget
# (its new backend holds the rest of the prompt) goes one more step ahead of
# those that must prefill more: shortest prefill first among the streams a
# dead backend breaks at once. Most find their prompt held and need ~50
# tokens; in arrival order, the few that must prefill the whole prompt (1000
# tokens on the chaos bed) held the lane for the rest behind them.
RESUME_SHORT_PREFILL_TOKENS = 512


# A continuation that must prefill more than RESUME_SHORT_PREFILL_TOKENS
# wherever it goes (no backend holds its prompt) waits for the short ones of
# its break to reach their first token before it is placed: an engine
# cannot preempt a prefill chunk it has started, so short continuations sent
# after a long one wait a whole chunk each (on the chaos bed one 1000-token
# continuation held 17 short ones 70-100 ms). It first waits
# RESUME_BURST_S (a dead backend's streams break within a few ms of each
# other, and are placed as they do), then at most RESUME_LONG_WAIT_S in all.
RESUME_BURST_S = 0.01
RESUME_LONG_WAIT_S = 0.5


def held_nowhere(cached: Mapping[str, int], request: RouteRequest) -> bool:
    """Whether, by the policy's estimate ``cached``, no backend holds all
    but :data:`RESUME_SHORT_PREFILL_TOKENS` of the continuation ``request``
    (a long one). An empty estimate of a request without block hashes (no
    prefix keys) knows nothing: not long."""
    if not cached and not request.block_hashes:
        return False
    return max(cached.values(), default=0) < request.prompt_tokens - RESUME_SHORT_PREFILL_TOKENS


def short_prefill_first(request: GenerateRequest, uncached_tokens: int) -> GenerateRequest:
    """``request`` (a continuation) one priority step up when what its new
    backend must prefill fits :data:`RESUME_SHORT_PREFILL_TOKENS`."""
    if uncached_tokens > RESUME_SHORT_PREFILL_TOKENS:
        return request
    return msgspec.structs.replace(request, priority=request.priority + 1)


# kv_aware's default coefficients, read from its options (policies/kv_aware.py):
# the seconds of prefill one uncached prompt token costs, and the delay each
# sequence running on a backend adds to a new one's first token.
RESUME_PREFILL_S_PER_TOKEN = KVAware.Options().prefill_s_per_token
RESUME_DECODE_S_PER_SEQ = KVAware.Options().decode_s_per_seq


def resume_placement(
    candidates: Sequence[BackendView], prompt_tokens: int, cached: Mapping[str, int] | None = None,
    queued: Mapping[str, int] | None = None,
) -> list[BackendView]:
    """The candidates where a continuation of ``prompt_tokens`` tokens
    (prompt + emitted) would wait least for its first token, by kv_aware's
    cost without its home term::

        wait(b) = RESUME_PREFILL_S_PER_TOKEN x (queued(b) + uncached(b))
                + RESUME_DECODE_S_PER_SEQ x in_flight(b)

    ``uncached(b)`` is ``prompt_tokens`` less what ``cached`` says b holds
    (the policy's estimate where it has one; none: the same for all, so the
    queues decide). ``queued(b)``: the uncached tokens awaiting a first token
    there by the policy's count (``queued``, kv_aware's), else the view's
    ``pending_prefill_tokens`` (whole prompts: where most of each is held,
    a dead backend's continuations, a few dozen tokens each, would count as
    a thousand and spread by count alone, not to where they are held).
    The routing policy picks among the ones returned (all
    tied): a dead backend's streams, which break at once, go where the
    queued prefill is least, each one's own prompt counted there before the
    next is placed, not in turn onto a backend whose lane is full."""
    if not candidates:
        return []
    held = cached or {}

    def wait(c: BackendView) -> float:
        uncached = max(prompt_tokens - held.get(c.name, 0), 0)
        pending = queued.get(c.name, 0) if queued is not None else c.pending_prefill_tokens
        return RESUME_PREFILL_S_PER_TOKEN * (pending + uncached) + RESUME_DECODE_S_PER_SEQ * c.in_flight

    waits = [wait(c) for c in candidates]
    least = min(waits)
    return [c for c, w in zip(candidates, waits, strict=True) if w <= least + 1e-9]


# How long a warm standby's sync may take before it is given up (background
# work, a priority step below the streams' own in the backend's queue).
STANDBY_PATIENCE = 10.0


class Standby:
    """One stream's warm standby (:attr:`Settings.standby_tokens`): the
    backend that holds its prompt and output up to the last sync, and when
    the next sync is due. One sync at a time: a stream whose last sync is
    still running skips to the next due point."""

    __slots__ = ("backend", "busy", "every", "next_at", "request")

    def __init__(self, request: GenerateRequest, every: int) -> None:
        self.request = request  # the original (for its target), which every sync continues
        self.every = every
        self.next_at = every  # output tokens relayed when the next sync is due
        self.backend: str | None = None  # chosen at the first sync, kept while it can serve
        self.busy = False

    def due(self, progress: Progress) -> bool:
        return (not self.busy and len(progress.token_ids) >= self.next_at
                and not progress.finished and progress.resumable_by_ids)  # fmt: skip

    def started(self, progress: Progress) -> None:
        self.busy = True
        self.next_at = len(progress.token_ids) + self.every


def standby_request(request: GenerateRequest, progress: Progress) -> GenerateRequest:
    """A warm standby's sync: the continuation's prompt (prompt + output so
    far, the resume contract), one token to generate (what prefills it), one
    priority step below the stream's own (background work), no stop
    strings, logprobs or trace of its own."""
    resumed = resume_request(request, progress)
    return msgspec.structs.replace(
        resumed, max_tokens=1, min_tokens=0, stop=[], stop_token_ids=[], logprobs=None,
        priority=request.priority - 1, traceparent=None, request_id=f"{request.request_id}-standby",
    )  # fmt: skip


def continuation(event: Event, progress: Progress) -> Event:
    """A token-mode continuation's event as the client gets it: the prompt
    ids, the seed and the model were said already; usage covers it all."""
    if event.prompt_token_ids is None and event.seed is None and event.model is None and event.usage is None:
        return event
    out = msgspec.structs.replace(event, prompt_token_ids=None, seed=None, model=None)
    if event.usage is not None:
        progress_after = len(progress.token_ids) + len(event.token_ids)
        usage = progress.usage(event.usage)
        out.usage = Usage(usage.prompt_tokens, progress_after, usage.cached_tokens)
    return out


def text_request(request: GenerateRequest, progress: Progress) -> GenerateRequest | None:
    """Text continuation (opt-in, inexact): a completion's prompt followed by
    the text already sent, the limits reduced by the tokens sent (counted by
    their events where there are no ids). None for chat (no standard way to
    prefill the assistant's answer) or a token-id prompt."""
    if request.messages is not None or request.prompt_token_ids is not None or request.prompt is None:
        return None
    n = len(progress.token_ids) or progress.text_events
    return msgspec.structs.replace(
        request,
        prompt=request.prompt + progress.text,
        max_tokens=None if request.max_tokens is None else max(1, request.max_tokens - n),
        min_tokens=max(0, request.min_tokens - n),
        seed=progress.seed if progress.seed is not None else request.seed,
    )


def text_continuation(event: Event, progress: Progress, sent: int) -> Event:
    """A text continuation's event as the client gets it: its usage counts the
    ``sent`` tokens as generated, not as prompt (approximately: the new
    backend tokenized the sent text itself)."""
    out = msgspec.structs.replace(event, prompt_token_ids=None, seed=None, model=None)
    if event.usage is not None:
        u = event.usage
        out.usage = Usage(max(0, u.prompt_tokens - sent), u.completion_tokens + sent, min(u.cached_tokens, max(0, u.prompt_tokens - sent)))
    return out


class Replay:
    """Replay and verify: a regenerated stream whose text (and token ids,
    when both runs carry them) must begin with exactly what the client has;
    that prefix is dropped and the rest relayed. ``feed`` raises
    :class:`MigrationFailed` (code ``replay_diverged``) on any difference."""

    def __init__(self, progress: Progress) -> None:
        self.sent_text = progress.text
        self.sent_ids = progress.token_ids if progress.ids_complete else None
        self.sent_logprobs = progress.logprobs
        self.text = ""  # replayed text not yet past the client's
        self.ids: list[int] = []
        self.logprobs = 0
        self.caught_up = not self.sent_text and not self.sent_ids

    def feed(self, event: Event) -> Event | None:
        """The part of ``event`` the client has not seen (None: nothing new yet)."""
        if self.caught_up:
            return msgspec.structs.replace(event, prompt_token_ids=None, seed=None, model=None)
        self.text += event.text
        sent = self.sent_text
        drop_ids = 0
        if self.sent_ids is not None and event.token_ids:
            room = len(self.sent_ids) - len(self.ids)
            head = event.token_ids[: max(0, room)]
            if head != self.sent_ids[len(self.ids) : len(self.ids) + len(head)]:
                raise self._diverged("token ids")
            self.ids += head
            drop_ids = len(head)
        if len(self.text) < len(sent):
            if not sent.startswith(self.text):
                raise self._diverged("text")
            if event.finish_reason is not None:
                raise self._diverged("length: the replay ended before reaching the text already sent")
            self._count_logprobs(event)
            return None
        if not self.text.startswith(sent):
            raise self._diverged("text")
        self.caught_up = True
        rest = self.text[len(sent) :]
        logprobs = self._rest_logprobs(event)
        if not rest and not event.token_ids[drop_ids:] and event.finish_reason is None and not logprobs:
            return None
        return Event(
            token_ids=event.token_ids[drop_ids:],
            text=rest,
            logprobs=logprobs,
            finish_reason=event.finish_reason,
            usage=event.usage,
        )

    def _count_logprobs(self, event: Event) -> None:
        self.logprobs += len(event.logprobs or ())

    def _rest_logprobs(self, event: Event) -> list[Logprob] | None:
        if not event.logprobs:
            return event.logprobs
        skip = max(0, self.sent_logprobs - self.logprobs)
        self.logprobs += len(event.logprobs)
        rest = event.logprobs[skip:]
        return rest or None

    def _diverged(self, what: str) -> MigrationFailed:
        return MigrationFailed(
            f"the stream broke and its replay on another backend differed ({what}); the answer cannot be completed exactly",
            code="replay_diverged",
        )


class StallWatch:
    """Inter-token latency per backend over its last ``window`` gaps, and the
    stall timeout it implies. The p99 is recomputed every ``every`` samples
    (a sort of ``window`` floats, ~14 us), not per token, and as soon as
    there are ``stall_samples`` of them."""

    def __init__(self, settings: Settings, window: int = 512, every: int = 128) -> None:
        self.settings = settings
        self.window, self.every = window, every
        self._gaps: dict[str, deque[float]] = {}
        self._since: dict[str, int] = {}
        self._p99: dict[str, float] = {}

    def add(self, backend: str, seconds: float) -> None:
        self.extend(backend, (seconds,))

    def extend(self, backend: str, seconds: Sequence[float]) -> None:
        """``add`` each of ``seconds``, the p99 recomputed (at most once) if
        ``every`` samples have come since it last was."""
        gaps = self._gaps.get(backend)
        if gaps is None:
            gaps = self._gaps[backend] = deque(maxlen=self.window)
            self._since[backend] = 0
        gaps.extend(seconds)
        n = self._since[backend] + len(seconds)
        if n >= self.every or (backend not in self._p99 and len(gaps) >= self.settings.stall_samples):
            n = 0
            ordered = sorted(gaps)
            self._p99[backend] = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
        self._since[backend] = n

    def p99(self, backend: str) -> float | None:
        gaps = self._gaps.get(backend)
        if gaps is None or len(gaps) < self.settings.stall_samples:
            return None
        return self._p99.get(backend)

    def timeout(self, backend: str, settings: Settings | None = None) -> float:
        """Seconds without an event after which ``backend``'s stream counts as stalled."""
        s = settings or self.settings
        if s.stall_timeout is not None:
            return s.stall_timeout
        p99 = self.p99(backend)
        if p99 is None:
            return s.stall_initial
        return max(s.stall_factor * p99, s.stall_floor)

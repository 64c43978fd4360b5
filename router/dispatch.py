"""The dispatcher: the router's own Backend, served by OpenAIServer.

For each generation it plans the models to try (:mod:`router.routes`: the
requested model's route, a split's sticky version, then the fallbacks), and
for each model asks that group's policy for one of its eligible actors (up,
not draining, serving the model, not cooling down after a 429), streams from
it and relays the events. Until the first event reaches the client a request
moves on::

    for target in plan.targets:                  the chain: the model, then its fallbacks
        route = route_request(upstream request, keys)  the policy's view, with the prompt's block hashes
        up to max_attempts times:
            a retry (any attempt after the request's first): a slot in the
                retry budget (spent -> the last error, no retry), then a
                full-jitter backoff (trio.sleep, cancellable)
            actor = target.policy.pick(candidates the breakers allow); dispatched, on_dispatch
            stream; first event: on_first_token, named by target.name
            done -> return; however the attempt ends: on_complete(ok=finished),
                breakers.record(ok) on success or an upstream error (not a 429),
                breakers.release when there is no verdict (429, 4xx, cancelled)
            before the first event:
                upstream error (connect, timeout, 5xx)  -> next backend of the group
                429                                     -> cool that backend down, next backend
                context length, a later model exists    -> next model
                any other client error (4xx)            -> to the client as is, never retried
            after it: raise                      (the migration issue resumes there)

When nothing answers, the client gets the last attempt's error (a 429 keeps
its Retry-After); if no backend could even be tried because every one is
cooling down, a 429 with the shortest remaining cool-down; with no eligible
backend at all, :class:`~backends.errors.BackendUnavailable` (503 +
Retry-After: the soonest end of an ejection when the breakers ejected them,
else ``retry_after``).

The breakers (a :class:`~policies.breaker.BreakerPolicy`) count and time;
the backend's one state is its actor's health (router/health.py). Every
breaker transition is relayed there (:meth:`Dispatcher.sync`: after each
outcome, and before anything reads the states, since an ejection ends with
time), and a backend the probes hold down has its breaker reset::

    breaker CLOSED -> OPEN        actor EJECT      (UP / SUSPECT -> EJECTED)
    breaker OPEN -> HALF_OPEN     actor COOLED     (EJECTED -> HALF_OPEN)
    breaker HALF_OPEN -> CLOSED   actor RECOVERED  (HALF_OPEN -> UP)
    breaker HALF_OPEN -> OPEN     actor EJECT      (HALF_OPEN -> EJECTED)
    actor DOWN / UNKNOWN          breakers.set_serving(False): reset, out of the fleet rule
                                  (told on each change of the probes' verdict)

A backend at its concurrency limit (:attr:`BackendActor.limit`, learned
from its 429s) is passed over while another of the group has room.

The response's ``model`` is the route that answered: the dispatcher names it
on the first event (``Event.model``), which the frontend reads.

Timing per request goes to a :class:`Recorder` (queue time, time to first
token, inter-token latency); :mod:`router.metrics` implements it.
"""

from __future__ import annotations

import logging
import math
import random
import sys
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Protocol

import msgspec
import trio

from backends.base import BackendInfo, Event, GenerateRequest, Health
from backends.errors import (
    BackendUnavailable,
    ClientError,
    ContextLengthExceeded,
    HeadraceError,
    MigrationFailed,
    UpstreamError,
    UpstreamRateLimited,
    drop_tracebacks,
)
from frontend.context import new_span_id
from frontend.sli import GapBatch, ReadClock
from policies.base import BackendView, RouteRequest, RoutingPolicy
from policies.breaker import (
    BreakerPolicy,
    BreakerState,
    BreakerStatistics,
    RetryBudget,
    RetryBudgetStatistics,
    full_jitter,
)
from policies.placement import Placement
from router.actors import ActorStatistics, BackendActor, StreamTicket, closing_stream
from router.config import ConfigError
from router.health import HealthEvent, HealthState
from router.logs import Attempt, Journal, RequestRecord, failure_code
from router.migration import (
    HELD_FRACTION,
    RESUME_BURST_S,
    RESUME_LONG_WAIT_S,
    RESUME_SHORT_PREFILL_TOKENS,
    STANDBY_PATIENCE,
    MigrationStatistics,
    Progress,
    Replay,
    StallTimeout,
    StallWatch,
    Standby,
    continuation,
    held_nowhere,
    no_final,
    prefix_label,
    reason_of,
    resume_placement,
    resume_request,
    short_prefill_first,
    standby_request,
    text_continuation,
    text_request,
)
from router.migration import Settings as MigrationSettings
from router.prefix_keys import PrefixKeys
from router.routes import RouteTable, Target, VersionStatistics
from router.tracing import child_traceparent

__all__ = [
    "Cooldowns",
    "DispatchStatistics",
    "Dispatcher",
    "NullRecorder",
    "Progress",
    "Recorder",
    "route_request",
]

log = logging.getLogger(__name__)

PREFIX_CHARS = 256  # how much prompt text a policy sees (for prefix hashing)
# Requests that name an affinity key (a batch's items: its id) go to the
# backend the key's first request went to, whatever the routing policy, while
# that backend's in-flight count is at most AFFINITY_LOAD x the candidates'
# mean (+1); the AFFINITY_KEYS most recent keys are kept.
AFFINITY_LOAD = 1.25
AFFINITY_KEYS = 10_000


class Recorder(Protocol):
    def queue_time(self, backend: str, seconds: float) -> None: ...
    def time_to_first_token(self, backend: str, seconds: float) -> None: ...
    def inter_token_latencies(self, backend: str, seconds: Sequence[float]) -> None: ...
    def resume_gap(self, backend: str, seconds: float, prefix: str) -> None: ...


class NullRecorder:
    def queue_time(self, backend: str, seconds: float) -> None:
        pass

    def time_to_first_token(self, backend: str, seconds: float) -> None:
        pass

    def inter_token_latencies(self, backend: str, seconds: Sequence[float]) -> None:
        pass

    def resume_gap(self, backend: str, seconds: float, prefix: str) -> None:
        pass


class DispatchStatistics(msgspec.Struct, frozen=True, kw_only=True):
    streams: int  # generations dispatched
    retries: int  # attempts moved on (another backend or model) before the first token
    unavailable: int  # refused: no eligible backend
    failed: int  # ended by an upstream error after all attempts or mid-stream
    fallbacks: int = 0  # answered by a model after the first of its chain
    rate_limited: int = 0  # 429s from backends (each cooled that backend down)
    retries_refused: int = 0  # retries the retry budget refused (the request got the upstream error)
    cooling: tuple[str, ...] = ()  # backends cooling down after a 429 now
    versions: tuple[VersionStatistics, ...] = ()  # per (split route, version)
    breakers: tuple[BreakerStatistics, ...] = ()  # per backend, when the breakers report them
    retry_budget: RetryBudgetStatistics | None = None  # None: no budget
    migration: MigrationStatistics = MigrationStatistics()
    retries_from: dict[str, int] = {}  # per backend: attempts that failed there before the first token and moved on
    broken_on: dict[str, int] = {}  # per backend: streams that broke there after their first token (then migrated or failed)


class Cooldowns:
    """Backends a 429 took out of routing, and until when (router clock)."""

    def __init__(self, default: float = 1.0, maximum: float = 60.0) -> None:
        self.default, self.maximum = default, maximum
        self._until: dict[str, float] = {}

    def start(self, backend: str, now: float, retry_after: float | None) -> float:
        """Cool ``backend`` for ``retry_after`` (the default when None, at
        most the maximum); the seconds it will be out."""
        seconds = min(self.maximum, self.default if retry_after is None else retry_after)
        self._until[backend] = max(self._until.get(backend, now), now + seconds)
        return seconds

    def remaining(self, backend: str, now: float) -> float:
        until = self._until.get(backend)
        if until is None:
            return 0.0
        if until <= now:
            del self._until[backend]
            return 0.0
        return until - now

    def cooling(self, now: float) -> tuple[str, ...]:
        return tuple(name for name in list(self._until) if self.remaining(name, now) > 0)


def route_request(request: GenerateRequest, keys: PrefixKeys | None = None) -> RouteRequest:
    """The policy's view of a request: with ``keys``, the chained block
    hashes of its prompt (token blocks where the model's tokenizer is known,
    text blocks of the whole conversation otherwise)."""
    ids = tuple(request.prompt_token_ids) if request.prompt_token_ids is not None else None
    if keys is not None:
        k = keys.keys(request, request.model)
        return RouteRequest(
            request_id=request.request_id,
            model=request.model,
            prompt_token_ids=ids,
            prefix=k.prefix[:PREFIX_CHARS],
            tenant=request.tenant,
            priority=request.priority,
            block_hashes=k.block_hashes,
            block_size=k.block_size,
            prompt_tokens=k.prompt_tokens,
            affinity=request.affinity or "",
        )
    prefix = request.prompt or ""
    if not prefix and request.messages:
        prefix = "".join(m.content for m in request.messages if isinstance(m.content, str))
    return RouteRequest(
        request_id=request.request_id,
        model=request.model,
        prompt_token_ids=ids,
        prefix=prefix[:PREFIX_CHARS],
        tenant=request.tenant,
        priority=request.priority,
        prompt_tokens=len(ids) if ids is not None else len(prefix) // 4,
        affinity=request.affinity or "",
    )


class _Feedback:
    """A policy's optional feedback methods (policies.base.RoutingFeedback),
    looked up once per request; a missing one is a no-op."""

    __slots__ = ("complete", "dispatch", "first_token")

    def __init__(self, policy: RoutingPolicy) -> None:
        self.dispatch = getattr(policy, "on_dispatch", None)
        self.first_token = getattr(policy, "on_first_token", None)
        self.complete = getattr(policy, "on_complete", None)


class _Outcome:
    """What a request met on its way: the answer when nothing serves it."""

    __slots__ = ("ejected", "error", "wait")

    def __init__(self) -> None:
        self.error: HeadraceError | None = None  # the last attempt's
        self.wait: float | None = None  # the shortest cool-down that kept a backend out
        self.ejected: float | None = None  # the soonest end of an ejection that kept one out

    def cooling(self, seconds: float) -> None:
        self.wait = seconds if self.wait is None else min(self.wait, seconds)

    def ejection(self, seconds: float) -> None:
        self.ejected = seconds if self.ejected is None else min(self.ejected, seconds)


# A breaker's move (as last relayed -> as it is now) and the health events
# that bring the actor's state along (router/health.py).
_RELAY: dict[tuple[BreakerState, BreakerState], tuple[HealthEvent, ...]] = {
    (BreakerState.CLOSED, BreakerState.OPEN): (HealthEvent.EJECT,),
    (BreakerState.OPEN, BreakerState.HALF_OPEN): (HealthEvent.COOLED,),
    (BreakerState.HALF_OPEN, BreakerState.CLOSED): (HealthEvent.RECOVERED,),
    (BreakerState.HALF_OPEN, BreakerState.OPEN): (HealthEvent.EJECT,),
    # Two moves in one call (a probe dispatched before the ejection ended,
    # judged after it; a trip then an end, for a clock that jumped).
    (BreakerState.OPEN, BreakerState.CLOSED): (HealthEvent.COOLED, HealthEvent.RECOVERED),
    (BreakerState.CLOSED, BreakerState.HALF_OPEN): (HealthEvent.EJECT, HealthEvent.COOLED),
}
# What the actor's state says its breaker is.
_OPEN, _HALF_OPEN, _CLOSED, _EJECTED = BreakerState.OPEN, BreakerState.HALF_OPEN, BreakerState.CLOSED, HealthState.EJECTED


def _by_ids(actors: Iterable[BackendActor]) -> list[BackendActor]:
    """Those of ``actors`` that report token ids (a resume by ids can go there)."""
    return [a for a in actors if a.info is not None and a.info.token_ids]


def _held(target: Target, views: list[BackendView], route: RouteRequest, now: float) -> dict[str, int] | None:
    """The target policy's estimate of the tokens of ``route`` each of
    ``views`` holds (kv_aware's ``cached_tokens``), or None where it makes none."""
    estimate: Callable[[list[BackendView], RouteRequest, float], dict[str, int]] | None
    estimate = getattr(target.policy, "cached_tokens", None)
    return estimate(views, route, now) if estimate is not None else None


def _server(actor: BackendActor) -> str:
    """The server behind ``actor``: its adapter's URL (entries that name one
    server share its prefill), else its name."""
    return str(getattr(actor.backend, "base_url", None) or actor.name)


class _Broken:
    """A stream that failed after its first event: why, where, and when."""

    __slots__ = ("at", "backend", "error", "settings", "standby", "sub", "target")

    def __init__(
        self, error: UpstreamError, backend: str, target: Target, sub: GenerateRequest, settings: MigrationSettings, at: float,
        standby: Standby | None = None,
    ) -> None:
        self.error, self.backend, self.target, self.sub, self.settings, self.at = error, backend, target, sub, settings, at
        self.standby = standby


async def _next(ticket: StreamTicket, wait: float, backend: str, progress: Progress) -> Event | None:
    """The stream's next event (None at its end), or :class:`StallTimeout`
    after ``wait`` seconds without one; the ticket is told which (and what
    the backend's stream raised). The deadline covers the wait for the
    backend only, never the consumer's time. An infinite ``wait`` enters no
    cancel scope (7 us an event on a slow core)."""
    try:
        if wait == math.inf:
            event = await ticket.events.__anext__()
        else:
            with trio.CancelScope(deadline=trio.current_time() + wait) as scope:
                event = await ticket.events.__anext__()
            if scope.cancelled_caught:
                what = "its first event" if not progress.events else "an event"
                raise StallTimeout(f"backend {backend} sent no {what} for {wait:.3g}s (after {progress.events} events)")
    except StopAsyncIteration:
        ticket.done()
        return None
    except StallTimeout:
        raise  # the dispatcher's verdict, not the stream's (actor.stalled() tells its health)
    except BaseException as exc:
        raise ticket.failed(exc)  # noqa: B904 (failed() chains a translated error to exc)
    ticket.event(event)
    return event


class Dispatcher:
    """Backend-shaped: ``stream``, ``info``, ``health``, ``aclose``.

    ``policy`` serves models no route names; ``routes`` (default: none)
    holds the configured routes, each group with its own policy."""

    def __init__(
        self,
        actors: Sequence[BackendActor],
        policy: RoutingPolicy,
        *,
        routes: RouteTable | None = None,
        max_attempts: int = 3,
        retry_after: float = 1.0,
        cooldown: float = 1.0,
        max_cooldown: float = 60.0,
        recorder: Recorder | None = None,
        clock: Callable[[], float] = trio.current_time,
        name: str = "headrace",
        keys: PrefixKeys | None = None,
        breakers: BreakerPolicy | None = None,
        retry_budget: RetryBudget | None = None,
        backoff_base: float = 0.025,
        backoff_cap: float = 0.25,
        draw: Callable[[], float] = random.random,
        migration: MigrationSettings | None = None,
        journal: Journal | None = None,
        placement: Placement | None = None,
        spawn: Callable[..., None] | None = None,
    ) -> None:
        """``breakers`` (default: none) filter the candidates and hear every
        attempt's outcome; ``retry_budget`` (default: unlimited) bounds the
        retries in flight; before each retry a full-jitter backoff of up to
        ``backoff_base x 2^(k-1)``, at most ``backoff_cap`` (``draw`` in [0, 1)).
        ``spawn(fn, *args)`` runs background work (warm standby syncs) beside
        the streams; without it there is none."""
        self.actors = {a.name: a for a in actors}
        self._info_cache: tuple[RouteTable, tuple[BackendInfo | None, ...], BackendInfo] | None = None
        self.breakers = breakers
        self._release: Callable[[str, float], None] | None = getattr(breakers, "release", None)
        self._set_serving: Callable[[str, bool, float], None] | None = getattr(breakers, "set_serving", None)
        self._serving: dict[str, bool] = {}  # what set_serving was last told, per backend
        self._ejected_until: Callable[[str, float], float | None] | None = getattr(breakers, "ejected_until", None)
        if breakers is not None and hasattr(breakers, "add"):
            breakers.add(self.actors)  # the fleet rule counts every backend, per group
        self.retry_budget = retry_budget
        self.migration = migration or MigrationSettings()
        self.stall = StallWatch(self.migration)
        self._migrations: dict[str, int] = {}  # "reason:outcome" -> count
        self._retries_from: dict[str, int] = {}  # backend -> attempts that failed there and moved on
        self._broken_on: dict[str, int] = {}  # backend -> streams that broke there mid-answer
        self._divergences = 0
        self._inexact = 0
        self.spawn = spawn
        # Per server (a backend's URL; entries that share one share its prefill),
        # continuations with a short prefill placed there and not yet at their
        # first event; the event is set when one of those counts falls to 0.
        self._short_resumes: dict[str, int] = {}
        self._shorts_done: trio.Event | None = None
        self._standby: dict[str, int] = {}  # warm standby syncs by outcome
        self._standby_tokens = 0  # what the synced ones sent, less what their backends had cached
        self.backoff_base, self.backoff_cap, self.draw = backoff_base, backoff_cap, draw
        self._active = 0  # streams in flight (the retry budget's base)
        self.keys = keys
        self.policy = policy
        self.routes = routes if routes is not None else RouteTable((), policy)
        if breakers is not None and hasattr(breakers, "set_groups"):
            # the fleet rule holds per model group: a route's configured backends
            breakers.set_groups(self.routes.groups())
        self.max_attempts = max_attempts
        self.retry_after = retry_after
        self.cooldowns = Cooldowns(cooldown, max_cooldown)
        self._affinity: OrderedDict[str, str] = OrderedDict()  # affinity key -> its backend, least recent first
        self.recorder: Recorder = recorder or NullRecorder()
        self.clock = clock
        self.name = name
        self.journal = journal  # the requests' records (router/logs.py): attempts, timings, spans
        self.placement = placement
        self._counts = dict.fromkeys(
            ("streams", "retries", "unavailable", "failed", "fallbacks", "rate_limited", "retries_refused"), 0
        )
        for _, group in self.routes.policies():
            missing = sorted(set(group or ()) - set(self.actors))
            if missing:
                raise ConfigError(f"a model route names backends the router does not have: {', '.join(missing)}")

    # ------------------------------------------------------------ Backend

    def info(self) -> BackendInfo:
        """The configured model names and aliases, then the union of every
        backend's models (up or not: a model whose backends are all down is
        503, not 404). Asked on every request (the model check): cached
        until the route table or a backend's info changes (a probe's
        refresh puts a new info object in place)."""
        routes = self.routes
        infos = tuple(a.info for a in self.actors.values())
        cached = self._info_cache
        if cached is not None and cached[0] is routes and cached[1] == infos:  # the same objects: no field compared
            return cached[2]
        result = self._info()
        self._info_cache = (routes, infos, result)
        return result

    def _info(self) -> BackendInfo:
        models: dict[str, None] = dict.fromkeys(self.routes.public_names())
        for actor in self.actors.values():
            models.update(dict.fromkeys(actor.models))
        infos = [a.info for a in self.actors.values() if a.info is not None]
        # The smallest context any backend has: a request that fits it fits
        # wherever it is routed (per-model limits would need per-model views).
        contexts = [i.max_context for i in infos if i.max_context is not None]
        return BackendInfo(
            name=self.name,
            models=tuple(models),
            max_context=min(contexts) if contexts else None,
            token_ids=bool(infos) and all(i.token_ids for i in infos),
        )

    async def health(self) -> Health:
        """Liveness: the router itself is alive; detail says how many backends are up."""
        self.sync()
        up = sum(a.eligible(None) for a in self.actors.values())
        return Health(ok=True, detail=f"{up}/{len(self.actors)} backends up")

    def ready(self) -> bool:
        self.sync()
        return any(a.eligible(None) for a in self.actors.values())

    # ------------------------------------------------------------ backends at runtime (router/admin.py)

    def add(self, actor: BackendActor) -> None:
        self.actors[actor.name] = actor
        if self.breakers is not None and hasattr(self.breakers, "add"):
            self.breakers.add([actor.name])

    def remove(self, name: str) -> None:
        """Out of routing; out of its breaker's fleet rule."""
        self.actors.pop(name, None)
        if self._set_serving is not None:
            self._serving[name] = False
            self._set_serving(name, False, self.clock())

    # ------------------------------------------------------------ one state per backend

    def sync(self) -> None:
        """Bring every actor's health state level with its breaker (an
        ejection ends with time, not with an event): call before reading
        states. Cheap: a poll per backend."""
        if self.breakers is None:
            return
        now = self.clock()
        for actor in self.actors.values():
            self._sync(actor, now)

    def _sync(self, actor: BackendActor, now: float) -> None:
        breakers = self.breakers
        if breakers is None or actor.closed:
            return
        state = actor.state
        up = state.probed_up
        if self._set_serving is not None and self._serving.get(actor.name) is not up:
            # Told when it changes (a request syncs every candidate, twice).
            self._serving[actor.name] = up
            self._set_serving(actor.name, up, now)
        if not up:
            return  # down or not yet probed: the probes decide, its breaker was reset
        actual = breakers.state(actor.name, now)
        shown = _OPEN if state is _EJECTED else _HALF_OPEN if state is HealthState.HALF_OPEN else _CLOSED
        if actual is not shown:  # (no enum hashed in the common case: each hash is a Python call)
            for event in _RELAY[(shown, actual)]:
                actor.breaker_moved(event)

    def backend_statistics(self) -> list[ActorStatistics]:
        """Every actor's statistics, their states level with the breakers."""
        self.sync()
        return [a.statistics() for a in self.actors.values()]

    async def aclose(self) -> None:
        for actor in self.actors.values():
            with trio.CancelScope(shield=True):
                await actor.aclose()

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
        # One generator from the backend's stream to the caller, the journal's
        # part included: a wrapper around it was one more hop for every event.
        self._counts["streams"] += 1
        self._active += 1  # the retry budget's base
        rec = self.journal.get(request) if self.journal is not None else None
        output = rec.output if rec is not None else None
        try:
            arrived = self.clock()
            plan = self.routes.plan(request)
            outcome = _Outcome()
            attempts = 0  # over the whole chain: every one after the first is a retry
            progress = Progress()  # what the client has been sent (nothing, until the first event)
            broken: _Broken | None = None
            for step, target in enumerate(plan.targets):
                sub = request if target.upstream == request.model else msgspec.structs.replace(request, model=target.upstream)
                route = route_request(sub, self.keys)
                feedback = _Feedback(target.policy)
                settings = target.migration or self.migration
                standby = Standby(sub, settings.standby_tokens) if settings.standby_tokens and self.spawn is not None else None
                tried: set[str] = set()
                for _ in range(self.max_attempts):
                    retry = attempts > 0
                    if retry:
                        if not self._candidates(target, tried, _Outcome()):
                            break  # nobody left here: no budget spent, no backoff slept
                        if not await self._retry_backoff(attempts):
                            raise self._final_error(outcome, request.model)  # the budget is spent
                    try:
                        actor = self._pick(target, route, tried, outcome)
                        if actor is None:
                            break  # nothing (more) in this group: the next model
                        attempts += 1
                        tried.add(actor.name)
                        self.recorder.queue_time(actor.name, self.clock() - arrived)
                        if self.breakers is not None:
                            self.breakers.dispatched(actor.name, self.clock())
                        if feedback.dispatch is not None:
                            feedback.dispatch(actor.name, route, self.clock())
                        recorder, name, last_at = self.recorder, actor.name, arrived
                        gaps = GapBatch(partial(self._gaps_seen, name))
                        cached: int | None = None
                        finished = False
                        verdict: bool | None = None  # the breaker's: None for no verdict on the backend
                        attempt = rec.attempt(name, self.clock()) if rec is not None else None
                        failure: BaseException | None = None  # what ended the attempt, for its span
                        try:
                            ticket, first_wait, after_first = self._open(actor, sub, route, settings, attempt, rec)
                            async with ticket:
                                clock = ReadClock(self.clock)
                                while True:
                                    event = await _next(ticket, after_first if progress.events else first_wait, name, progress)
                                    if event is None:
                                        break
                                    now = clock.of(event)
                                    if progress.events == 0:
                                        recorder.time_to_first_token(name, now - arrived)
                                        if attempt is not None and rec is not None:
                                            rec.first_event(attempt, now)
                                        event = self._first_event(event, target, request, step)
                                        if feedback.first_token is not None:
                                            feedback.first_token(name, route, now)
                                    elif event.token_ids:
                                        gaps.add(now - last_at)
                                    if event.usage is not None:
                                        cached = event.usage.cached_tokens
                                        if rec is not None:
                                            rec.usage(event.usage)
                                    last_at = now
                                    progress.add(event)
                                    if standby is not None and standby.due(progress):
                                        self._sync_standby(standby, target, progress, name)
                                    if output is not None:  # log_prompts: the output's text too
                                        output.append(event.text)
                                    yield event
                            if progress.events and not progress.finished:
                                raise no_final(progress.events)
                            finished = verdict = True
                            return
                        except ContextLengthExceeded as exc:
                            failure = exc
                            if progress.events or step + 1 == len(plan.targets):
                                raise  # the client's error: no larger model to move on to
                            log.info("model %s: %s; trying the next model", target.name, exc.message)
                            outcome.error = exc
                            self._counts["retries"] += 1
                            drop_tracebacks(exc)
                            break
                        except UpstreamError as exc:
                            failure = exc
                            verdict = None if isinstance(exc, UpstreamRateLimited) else False
                            if progress.events:
                                if isinstance(exc, StallTimeout):
                                    actor.stalled()  # the actor saw a cancel, not a failure
                                broken = _Broken(exc, actor.name, target, sub, settings, self.clock(), standby)
                            else:
                                # The actor's stream already told its health (and woke its prober).
                                self._failed_early(actor, exc, outcome)
                            drop_tracebacks(exc)  # kept (broken, outcome), raised again only afresh
                        finally:
                            gaps.flush()
                            self._judge(name, verdict)
                            if feedback.complete is not None:
                                feedback.complete(name, route, self.clock(), ok=finished, cached_tokens=cached)
                            if attempt is not None and rec is not None:
                                error = None if finished else failure_code(failure or sys.exc_info()[1])
                                rec.attempt_done(attempt, self.clock(), last_at if progress.events else None, error)
                    finally:
                        if retry and self.retry_budget is not None:
                            self.retry_budget.release()
                    if broken is not None:
                        break
                if broken is not None:
                    break
            if broken is not None:
                try:
                    async with closing_stream(self._migrate(broken, progress, rec)) as continued:
                        async for event in continued:
                            if output is not None:  # log_prompts: the output's text too
                                output.append(event.text)
                            yield event
                except UpstreamError:
                    self._counts["failed"] += 1
                    plan.failed()
                    raise
                return
            plan.failed()
            raise self._final_error(outcome, request.model)
        except HeadraceError as exc:
            if rec is not None:
                rec.failed(exc)
            raise
        finally:
            self._active -= 1


    # ------------------------------------------------------------ migration

    async def _migrate(self, b: _Broken, progress: Progress, rec: RequestRecord | None = None) -> AsyncIterator[Event]:
        """Continue a stream that broke after its first event on another
        backend of its route (never one that failed it), until it finishes,
        or raise :class:`MigrationFailed`."""
        target, settings, error = b.target, b.settings, b.error
        # Where this stream failed, and when (trio's clock). The backend that
        # failed it last is never asked again straight away; an earlier one
        # only once it has answered since (a restarted backend is back).
        failed = {b.backend: trio.current_time()}
        migrations = 0
        diverged = False  # a replay differed: text continuation (when opted in) is what is left
        while True:
            reason = reason_of(error)
            log.warning("stream on %s broke after %d events (%s: %s)", b.backend, progress.events, reason, error.message)
            self._broken_on[b.backend] = self._broken_on.get(b.backend, 0) + 1
            if not settings.enabled:
                self._migrated(reason, "failed")
                raise error
            if migrations >= settings.max_migrations:
                raise self._migration_failed(reason, f"the stream broke {migrations + 1} times (limit {settings.max_migrations} migrations)", "migration_limit")
            excluded = {b.backend} | {n for n, at in failed.items() if n not in self.actors or self.actors[n].ok_at <= at}
            candidates = self._candidates(target, excluded, _Outcome())
            by_ids = _by_ids(candidates)
            by_text = text_request(b.sub, progress) if settings.text_continuation else None
            relay: Callable[[Event], Event | None]
            if progress.resumable_by_ids and by_ids:
                mode, candidates, sub = "resumed", by_ids, resume_request(b.sub, progress)
                relay = partial(continuation, progress=progress)
            elif settings.replay and not diverged and candidates:
                mode = "replayed"
                sub = b.sub if progress.seed is None else msgspec.structs.replace(b.sub, seed=progress.seed)
                relay = Replay(progress).feed
            elif by_text is not None and candidates:
                mode, sub = "continued", by_text
                relay = partial(text_continuation, progress=progress, sent=len(progress.token_ids) or progress.text_events)
            else:
                raise self._migration_failed(reason, "no other backend can continue this stream", "no_backend_to_resume", status=503)
            # Not charged to the retry budget: a backend that dies takes all its
            # streams with it, and each has earned its continuation (bounded by
            # max_migrations), where a retry storm is new load on a sick fleet.
            migrations += 1
            actor: BackendActor | None = None
            if rec is not None:
                rec.migrations += 1
            span = rec.span("migration", b.at) if rec is not None else None
            if span is not None:
                span.attributes.update({"headrace.reason": reason, "headrace.mode": mode, "headrace.from": b.backend})
            try:
                route = route_request(sub, self.keys)
                views, held = self._resume_views(target, candidates, route)
                if mode == "resumed" and held is not None and held_nowhere(held, route):
                    await self._after_short_resumes({_server(a) for a in self.members(target)})
                    candidates = _by_ids(self._candidates(target, excluded, _Outcome()))
                    views, held = self._resume_views(target, candidates, route)
                name = target.policy.pick(views, route, self.clock())
                actor = self.actors.get(name) if name is not None else None
                if actor is None or actor not in candidates:
                    raise self._migration_failed(reason, "the routing policy found no backend to continue on", "no_backend_to_resume", status=503)
                uncached = route.prompt_tokens - held.get(actor.name, 0) if mode == "resumed" and held is not None else None
                if uncached is not None:
                    sub = short_prefill_first(sub, uncached)
                info = actor.info
                if mode == "continued" or (mode == "resumed" and (info is None or not info.exact_resume)):
                    self._inexact += 1
                log.info("resuming the stream on %s (%s, %d tokens sent)", actor.name, mode, len(progress.token_ids))
                # This break counts as resumed the moment its continuation relays
                # something, whatever becomes of the continuation later.
                resumed = partial(self._migrated, reason, mode)
                attempt = rec.attempt(actor.name, self.clock(), span.span_id if span is not None else None) if rec is not None else None
                keep = b.standby if mode == "resumed" else None  # kept in sync from the continuation on
                # A short prefill: counted until its first event (or its end), for the long ones to wait on.
                short = self._short_resume(_server(actor)) if uncached is not None and uncached <= RESUME_SHORT_PREFILL_TOKENS else None
                try:
                    async for event in self._continue(actor, sub, route, target, settings, progress, relay, b.at, resumed,
                                                      attempt, rec, keep, short):
                        yield event
                finally:
                    if short is not None:
                        short()
                if span is not None:
                    span.finish(self.clock(), None, **{"headrace.to": actor.name})
                return
            except MigrationFailed as exc:
                if span is not None:
                    span.finish(self.clock(), exc.code)
                if exc.code != "replay_diverged":
                    raise  # counted where it was raised
                if by_text is None:
                    self._migrated(reason, "failed")
                    raise
                diverged = True  # nothing of the replay was relayed: continue from the text instead
                continue  # it answered, differently: it (or another) may continue the text
            except UpstreamError as exc:
                error = exc
                drop_tracebacks(exc)
            except ClientError as exc:  # the new backend refused the continuation: try another
                error = UpstreamError(f"backend refused the resumed request: {exc.message}")
                drop_tracebacks(exc)
            if span is not None:
                span.finish(self.clock(), reason_of(error))
            if actor is not None:
                failed[actor.name] = trio.current_time()
            b = _Broken(error, actor.name if actor is not None else b.backend, target, b.sub, settings, self.clock(), b.standby)

    def _resume_views(self, target: Target, candidates: list[BackendActor], route: RouteRequest,
                      ) -> tuple[list[BackendView], dict[str, int] | None]:  # fmt: skip
        """A continuation's candidates as its policy sees them: those where it
        would wait least for its first token (:func:`~router.migration.resume_placement`),
        by the policy's estimate of what each holds when it makes one
        (kv_aware's ``cached_tokens``), and that estimate (None without one).
        The pick and the first ``__anext__`` of its stream (where the actor
        counts the pending prefill) run with no checkpoint between them, so
        the next stream's pick sees it."""
        views = [a.view() for a in candidates]
        cached = _held(target, views, route, self.clock())
        queued_prefill: Callable[[], Mapping[str, int] | None] | None = getattr(target.policy, "queued_prefill", None)
        queued = queued_prefill() if queued_prefill is not None else None
        return resume_placement(views, route.prompt_tokens, cached, queued), cached

    async def _continue(
        self,
        actor: BackendActor,
        sub: GenerateRequest,
        route: RouteRequest,
        target: Target,
        settings: MigrationSettings,
        progress: Progress,
        relay: Callable[[Event], Event | None],
        broke_at: float,
        resumed: Callable[[], None],
        attempt: Attempt | None = None,
        rec: RequestRecord | None = None,
        standby: Standby | None = None,
        prefilled: Callable[[], None] | None = None,
    ) -> AsyncIterator[Event]:
        """One continuation attempt, its events as the client gets them;
        ``resumed()`` when the first of them leaves; the stream's warm
        standby kept in sync (token mode); ``prefilled()`` at its first
        event from the backend."""
        name, feedback = actor.name, _Feedback(target.policy)
        if self.breakers is not None:
            self.breakers.dispatched(name, self.clock())
        if feedback.dispatch is not None:
            feedback.dispatch(name, route, self.clock())
        finished, verdict, first, cached = False, None, True, None
        last_at = self.clock()
        gaps = GapBatch(partial(self._gaps_seen, name))
        gap_from: float | None = broke_at  # until the first new event reaches the client
        gap: float | None = None  # observed at the end, labelled by what the backend held (its usage)
        try:
            ticket, first_wait, after_first = self._open(actor, sub, route, settings, attempt, rec)
            async with ticket:
                clock = ReadClock(self.clock)
                while True:
                    event = await _next(ticket, first_wait if first else after_first, name, progress)
                    if event is None:
                        break
                    now = clock.of(event)
                    if first:
                        first = False
                        if prefilled is not None:
                            prefilled()
                        if feedback.first_token is not None:
                            feedback.first_token(name, route, now)
                    elif event.token_ids:
                        gaps.add(now - last_at)
                    last_at = now
                    if event.usage is not None:
                        cached = event.usage.cached_tokens
                    out = relay(event)
                    if out is None:
                        continue
                    if rec is not None and out.usage is not None:
                        rec.usage(out.usage)
                    if gap_from is not None:
                        gap, gap_from = now - gap_from, None
                        resumed()
                    progress.add(out)
                    if standby is not None and standby.due(progress):
                        self._sync_standby(standby, target, progress, name)
                    yield out
            if not progress.finished:
                raise no_final(progress.events)
            finished = verdict = True
        except MigrationFailed:
            self._divergences += 1
            raise
        except UpstreamError as exc:
            verdict = None if isinstance(exc, UpstreamRateLimited) else False
            if isinstance(exc, StallTimeout):
                actor.stalled()
            raise
        finally:
            gaps.flush()
            if gap is not None:
                original = len(progress.prompt_token_ids) if progress.prompt_token_ids is not None else route.prompt_tokens
                self.recorder.resume_gap(name, gap, prefix_label(cached, original))
            self._judge(name, verdict)
            if feedback.complete is not None:
                feedback.complete(name, route, self.clock(), ok=finished, cached_tokens=cached)
            if attempt is not None and rec is not None:
                rec.attempt_done(attempt, self.clock(), last_at, None if finished else failure_code(sys.exc_info()[1]))

    def _short_resume(self, server: str) -> Callable[[], None]:
        """Count a short continuation on ``server`` until the returned
        callable (idempotent) says it has its first event."""
        shorts = self._short_resumes
        shorts[server] = shorts.get(server, 0) + 1
        done = False

        def prefilled() -> None:
            nonlocal done
            if done:
                return
            done = True
            left = shorts[server] - 1
            if left:
                shorts[server] = left
                return
            del shorts[server]
            if self._shorts_done is not None:
                self._shorts_done.set()
                self._shorts_done = None

        return prefilled

    async def _after_short_resumes(self, group: set[str]) -> None:
        """A long continuation's wait (:data:`~router.migration.RESUME_LONG_WAIT_S`):
        the rest of its break's burst, then the short continuations placed on
        the servers of its ``group`` to their first event, so that its prefill
        holds none of their chunks before them."""
        with trio.move_on_after(RESUME_LONG_WAIT_S):
            await trio.sleep(RESUME_BURST_S)
            while not group.isdisjoint(self._short_resumes):
                if self._shorts_done is None:
                    self._shorts_done = trio.Event()
                await self._shorts_done.wait()

    # ------------------------------------------------------------ warm standby

    def _sync_standby(self, standby: Standby, target: Target, progress: Progress, current: str) -> None:
        """Start a sync of ``standby`` (due) beside the stream, which goes on at once."""
        assert self.spawn is not None and progress.prompt_token_ids is not None
        standby.started(progress)
        request = standby_request(standby.request, progress)
        try:
            self.spawn(self._standby_sync, standby, target, request, current, len(progress.prompt_token_ids))
        except RuntimeError:  # the router is not running (it is stopping): no sync
            standby.busy = False

    async def _standby_sync(self, standby: Standby, target: Target, request: GenerateRequest, current: str,
                            prompt_tokens: int) -> None:  # fmt: skip
        """Prefill ``request`` (prompt + output so far, one token to
        generate) on the stream's standby: best effort, nothing of it reaches
        the client, a failure only counts. The routing policy hears it as a
        dispatch (what that backend now holds: where a resume goes)."""
        outcome, tokens = "failed", 0
        try:
            with trio.move_on_after(STANDBY_PATIENCE):
                route = route_request(request, self.keys)
                actor = self._standby_actor(standby, target, route, current, prompt_tokens)
                if actor is None:
                    outcome = "skipped"
                    return
                feedback = _Feedback(target.policy)
                if feedback.dispatch is not None:
                    feedback.dispatch(actor.name, route, self.clock())
                cached: int | None = None
                ok = False
                try:
                    async with closing_stream(actor.stream(request, prompt_tokens=route.prompt_tokens)) as events:
                        async for event in events:
                            if event.usage is not None:
                                cached = event.usage.cached_tokens
                    ok = True
                finally:
                    if feedback.complete is not None:
                        feedback.complete(actor.name, route, self.clock(), ok=ok, cached_tokens=cached)
                outcome, tokens = "synced", route.prompt_tokens - (cached or 0)
        except Exception as exc:  # best effort: the stream it serves goes on regardless
            log.debug("warm standby sync failed: %s", exc)
            drop_tracebacks(exc)
        finally:
            standby.busy = False
            self._standby[outcome] = self._standby.get(outcome, 0) + 1
            self._standby_tokens += tokens

    def _standby_actor(self, standby: Standby, target: Target, route: RouteRequest, current: str,
                       prompt_tokens: int) -> BackendActor | None:  # fmt: skip
        """The stream's standby: the one chosen before while it can serve (and
        is not the stream's backend now), else one of the route's other
        backends with token ids that holds the stream's prompt by the routing
        policy's estimate, as the policy picks among them; None where none
        does (a standby that must prefill the whole prompt would double its
        cost) or the policy makes no estimate."""
        candidates = _by_ids(self._candidates(target, {current}, _Outcome()))
        if standby.backend is not None:
            for kept in candidates:
                if kept.name == standby.backend:
                    return kept
            standby.backend = None
        if not candidates:
            return None
        now = self.clock()
        views = [a.view() for a in candidates]
        held = _held(target, views, route, now)
        if held is None:
            return None
        holding = [v for v in views if held.get(v.name, 0) >= HELD_FRACTION * prompt_tokens]
        name = target.policy.pick(holding, route, now) if holding else None
        actor = self.actors.get(name) if name is not None else None
        if actor is None or actor not in candidates:
            return None
        standby.backend = actor.name
        return actor

    def _gaps_seen(self, backend: str, seconds: list[float]) -> None:
        """A batch of ``backend``'s inter-token gaps: its histogram and its stall watch."""
        self.recorder.inter_token_latencies(backend, seconds)
        self.stall.extend(backend, seconds)

    def _open(
        self, actor: BackendActor, sub: GenerateRequest, route: RouteRequest, settings: MigrationSettings,
        attempt: Attempt | None = None, rec: RequestRecord | None = None,
    ) -> tuple[StreamTicket, float, float]:
        """One attempt's stream (its actor's ticket: iterated here, without the
        actor's wrapper), and how long to wait for its first event and
        for each later one. The backend times its own silences (given the
        watchdog's timeout), or the dispatcher times each wait itself. The
        attempt's ``traceparent`` names its own span (router/tracing.py)."""
        if sub.traceparent is not None:
            span_id = attempt.span_id if attempt is not None else new_span_id()
            sampled = rec.context.sampled if rec is not None else None
            sub = msgspec.structs.replace(sub, traceparent=child_traceparent(sub.traceparent, span_id, sampled))
        first_wait = settings.first_token_timeout if settings.first_token_timeout is not None else math.inf
        stall = self.stall.timeout(actor.name, settings)
        watched = actor.watches_stalls
        ticket = actor.open(sub, route.prompt_tokens, stall_timeout=stall if watched else None)
        return ticket, first_wait, math.inf if watched else stall

    def _migrated(self, reason: str, outcome: str) -> None:
        key = f"{reason}:{outcome}"
        self._migrations[key] = self._migrations.get(key, 0) + 1

    def _migration_failed(self, reason: str, why: str, code: str, *, status: int | None = None) -> MigrationFailed:
        self._migrated(reason, "failed")
        log.warning("stream not resumed (%s): %s", code, why)
        return MigrationFailed(
            f"the backend failed mid-stream and the answer could not be resumed: {why}",
            code=code,
            status=status,
            retry_after=self.retry_after if status == 503 else None,
        )

    # ------------------------------------------------------------ helpers

    def members(self, target: Target) -> list[BackendActor]:
        """The target's group, whatever their state: its named group (trusted
        to serve the model), or every backend that lists the model (or lists
        nothing yet)."""
        if target.backends is not None:
            return [self.actors[name] for name in target.backends]
        model = target.upstream
        return [a for a in self.actors.values() if model is None or not a.models or model in a.models]

    def _candidates(self, target: Target, tried: set[str], outcome: _Outcome) -> list[BackendActor]:
        """The group's eligible backends not tried yet, not cooling down
        after a 429 and let through by their breaker; those at their
        concurrency limit only when all are. An ejected one notes when its
        ejection ends (the 503's Retry-After when nobody is left)."""
        now = self.clock()
        candidates: list[BackendActor] = []
        for actor in self.members(target):
            self._sync(actor, now)
            if not actor.eligible(None):
                if actor.state is HealthState.EJECTED and not actor.draining and self._ejected_until is not None:
                    until = self._ejected_until(actor.name, now)
                    if until is not None:
                        outcome.ejection(until - now)
                continue
            if actor.name in tried:
                continue
            wait = self.cooldowns.remaining(actor.name, now)
            if wait > 0:
                outcome.cooling(wait)
            elif self.breakers is None or self.breakers.allows(actor.name, now):
                candidates.append(actor)
        roomy = [a for a in candidates if a.in_flight < a.limit]
        return roomy if roomy else candidates

    def _pick(self, target: Target, route: RouteRequest, tried: set[str], outcome: _Outcome) -> BackendActor | None:
        candidates = self._candidates(target, tried, outcome)
        if self.placement is not None:  # batch work to the tagged (cheap) backends (policies/placement.py)
            candidates = list(self.placement.filter(candidates, route.priority))
        if not candidates:
            return None
        home = self._affinity_home(route.affinity, candidates) if route.affinity else None
        if isinstance(home, BackendActor):
            return home
        name = target.policy.pick([a.view() for a in candidates], route, self.clock())
        if name is None:
            return None  # the policy refused: as if the group had nobody
        chosen = self.actors.get(name)
        if chosen is None or chosen not in candidates:
            raise BackendUnavailable(f"routing policy chose {name!r}, which is not a candidate", retry_after=self.retry_after)
        if route.affinity and home is None:  # a new key, or its home is gone: the pick is its home
            self._affinity[route.affinity] = name
            if len(self._affinity) > AFFINITY_KEYS:
                self._affinity.popitem(last=False)
        return chosen

    def _affinity_home(self, key: str, candidates: list[BackendActor]) -> BackendActor | bool | None:
        """The backend ``key``'s requests go to while it is a candidate and
        its in-flight count is within ``AFFINITY_LOAD`` x the candidates'
        mean (+1: the cap of consistent hashing with bounded loads). True:
        the home is full, this request overflows to the policy's pick and
        the home stays; None: no home (new, or gone), the pick becomes it."""
        home = self.actors.get(self._affinity.get(key, ""))
        if home is None or home not in candidates:
            return None
        self._affinity.move_to_end(key)
        if home.in_flight > math.ceil(AFFINITY_LOAD * (sum(a.in_flight for a in candidates) + 1) / len(candidates)):
            return True
        return home

    async def _retry_backoff(self, attempt: int) -> bool:
        """Before retry ``attempt`` (1 = the first): a slot in the retry
        budget (False when it is spent: no retry), then the full-jitter
        backoff, on trio's clock and cancellable. The caller releases the slot."""
        if self.retry_budget is not None and not self.retry_budget.try_acquire(self._active):
            self._counts["retries_refused"] += 1
            log.warning("retry budget spent (%d retries in flight): no retry", self.retry_budget.active)
            return False
        try:
            await trio.sleep(full_jitter(attempt, self.draw(), base=self.backoff_base, cap=self.backoff_cap))
        except BaseException:
            if self.retry_budget is not None:
                self.retry_budget.release()
            raise
        return True

    def _judge(self, backend: str, verdict: bool | None) -> None:
        """Tell the breaker how an attempt ended: ``ok`` or not, or, with no
        verdict on the backend (a 429, a 4xx, cancelled, or a backend the
        probes took down meanwhile), free its probe slot; then relay what
        the breaker did to the actor's state."""
        if self.breakers is None:
            return
        now = self.clock()
        actor = self.actors.get(backend)
        if actor is None:
            return  # removed at runtime meanwhile
        if verdict is not None and actor.state.probed_up:
            self.breakers.record(backend, verdict, now)
        elif self._release is not None:
            self._release(backend, now)
        self._sync(actor, now)

    def ejected(self, backend: str) -> bool:
        """Does the breaker keep new requests from ``backend`` now (open, or
        half-open with its probes taken)?"""
        return self.breakers is not None and not self.breakers.allows(backend, self.clock())

    def _first_event(self, event: Event, target: Target, request: GenerateRequest, step: int) -> Event:
        """Name the model that answers, when it is not the one asked for."""
        if step:
            self._counts["fallbacks"] += 1
        if target.name is None or target.name == request.model:
            return event
        return msgspec.structs.replace(event, model=target.name)

    def _failed_early(self, actor: BackendActor, exc: UpstreamError, outcome: _Outcome) -> None:
        if isinstance(exc, UpstreamRateLimited):
            seconds = self.cooldowns.start(actor.name, self.clock(), exc.retry_after)
            self._counts["rate_limited"] += 1
            if exc.retry_after is None:
                exc.retry_after = seconds  # the client hears when to come back
            log.warning("backend %s answered 429: cooling down for %.3gs", actor.name, seconds)
        else:
            log.warning("backend %s failed before the first token: %s", actor.name, exc.message)
        outcome.error = exc
        self._counts["retries"] += 1
        self._retries_from[actor.name] = self._retries_from.get(actor.name, 0) + 1

    def _final_error(self, outcome: _Outcome, model: str | None) -> HeadraceError:
        if outcome.error is not None:
            self._counts["failed"] += 1
            return outcome.error
        what = f"model {model!r}" if model else "this request"
        if outcome.wait is not None:
            return UpstreamRateLimited(
                f"every backend for {what} is cooling down after a 429; retry later", retry_after=outcome.wait
            )
        self._counts["unavailable"] += 1
        if outcome.ejected is not None:  # every one left is ejected: back when the first returns
            return BackendUnavailable(
                f"every backend for {what} is ejected after failures; retry later",
                retry_after=max(outcome.ejected, 0.001),
            )
        return BackendUnavailable(f"no healthy backend for {what}; retry later", retry_after=self.retry_after)

    def ejection_wait(self, backends: Iterable[str]) -> float | None:
        """Seconds until the first of ``backends`` that the breakers ejected
        returns (None: none of them is ejected now)."""
        if self._ejected_until is None:
            return None
        self.sync()
        now = self.clock()
        ends = [until for name in backends if (until := self._ejected_until(name, now)) is not None]
        return min(ends) - now if ends else None

    def statistics(self) -> DispatchStatistics:
        self.sync()
        return DispatchStatistics(
            **self._counts,
            cooling=self.cooldowns.cooling(self.clock()),
            versions=tuple(self.routes.statistics()),
            breakers=self._breaker_statistics(),
            retry_budget=self.retry_budget.statistics() if self.retry_budget is not None else None,
            migration=MigrationStatistics(
                migrations=dict(self._migrations), divergences=self._divergences, inexact=self._inexact,
                standby_syncs=dict(self._standby), standby_tokens=self._standby_tokens,
            ),
            retries_from=dict(self._retries_from),
            broken_on=dict(self._broken_on),
        )

    def _breaker_statistics(self) -> tuple[BreakerStatistics, ...]:
        report = getattr(self.breakers, "statistics", None)
        return tuple(report(self.clock())) if report is not None else ()

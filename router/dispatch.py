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
            actor = target.policy.pick(...); on_dispatch
            stream; first event: on_first_token, named by target.name
            done -> return; however the attempt ends: on_complete(ok=finished)
            before the first event:
                upstream error (connect, timeout, 5xx)  -> next backend of the group
                429                                     -> cool that backend down, next backend
                context length, a later model exists    -> next model
                any other client error (4xx)            -> to the client as is, never retried
            after it: raise                      (the migration issue resumes there)

When nothing answers, the client gets the last attempt's error (a 429 keeps
its Retry-After); if no backend could even be tried because every one is
cooling down, a 429 with the shortest remaining cool-down; with no eligible
backend at all, :class:`~backends.errors.BackendUnavailable` (503 + Retry-After).

The response's ``model`` is the route that answered: the dispatcher names it
on the first event (``Event.model``), which the frontend reads.

Timing per request goes to a :class:`Recorder` (queue time, time to first
token, inter-token latency); :mod:`router.metrics` implements it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Protocol

import msgspec
import trio

from backends.base import BackendInfo, Event, GenerateRequest, Health
from backends.errors import (
    BackendUnavailable,
    ContextLengthExceeded,
    HeadraceError,
    UpstreamError,
    UpstreamRateLimited,
)
from policies.base import RouteRequest, RoutingPolicy
from router.actors import BackendActor, closing_stream
from router.config import ConfigError
from router.prefix_keys import PrefixKeys
from router.routes import RouteTable, Target, VersionStatistics

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


class Recorder(Protocol):
    def queue_time(self, backend: str, seconds: float) -> None: ...
    def time_to_first_token(self, backend: str, seconds: float) -> None: ...
    def inter_token_latency(self, backend: str, seconds: float) -> None: ...


class NullRecorder:
    def queue_time(self, backend: str, seconds: float) -> None:
        pass

    def time_to_first_token(self, backend: str, seconds: float) -> None:
        pass

    def inter_token_latency(self, backend: str, seconds: float) -> None:
        pass


class DispatchStatistics(msgspec.Struct, frozen=True, kw_only=True):
    streams: int  # generations dispatched
    retries: int  # attempts moved on (another backend or model) before the first token
    unavailable: int  # refused: no eligible backend
    failed: int  # ended by an upstream error after all attempts or mid-stream
    fallbacks: int = 0  # answered by a model after the first of its chain
    rate_limited: int = 0  # 429s from backends (each cooled that backend down)
    cooling: tuple[str, ...] = ()  # backends cooling down after a 429 now
    versions: tuple[VersionStatistics, ...] = ()  # per (split route, version)


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


class Progress:
    """What has been relayed so far: enough to resume elsewhere later."""

    def __init__(self) -> None:
        self.prompt_token_ids: list[int] | None = None
        self.token_ids: list[int] = []
        self.seed: int | None = None
        self.events = 0

    def add(self, event: Event) -> None:
        self.events += 1
        self.token_ids += event.token_ids
        if event.prompt_token_ids is not None:
            self.prompt_token_ids = event.prompt_token_ids
        if event.seed is not None:
            self.seed = event.seed


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

    __slots__ = ("error", "wait")

    def __init__(self) -> None:
        self.error: HeadraceError | None = None  # the last attempt's
        self.wait: float | None = None  # the shortest cool-down that kept a backend out

    def cooling(self, seconds: float) -> None:
        self.wait = seconds if self.wait is None else min(self.wait, seconds)


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
    ) -> None:
        self.actors = {a.name: a for a in actors}
        self.keys = keys
        self.policy = policy
        self.routes = routes if routes is not None else RouteTable((), policy)
        self.max_attempts = max_attempts
        self.retry_after = retry_after
        self.cooldowns = Cooldowns(cooldown, max_cooldown)
        self.recorder: Recorder = recorder or NullRecorder()
        self.clock = clock
        self.name = name
        self._counts = dict.fromkeys(("streams", "retries", "unavailable", "failed", "fallbacks", "rate_limited"), 0)
        for _, group in self.routes.policies():
            missing = sorted(set(group or ()) - set(self.actors))
            if missing:
                raise ConfigError(f"a model route names backends the router does not have: {', '.join(missing)}")

    # ------------------------------------------------------------ Backend

    def info(self) -> BackendInfo:
        """The configured model names and aliases, then the union of every
        backend's models (up or not: a model whose backends are all down is
        503, not 404)."""
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
        up = sum(a.eligible(None) for a in self.actors.values())
        return Health(ok=True, detail=f"{up}/{len(self.actors)} backends up")

    def ready(self) -> bool:
        return any(a.eligible(None) for a in self.actors.values())

    async def aclose(self) -> None:
        for actor in self.actors.values():
            with trio.CancelScope(shield=True):
                await actor.aclose()

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
        self._counts["streams"] += 1
        arrived = self.clock()
        plan = self.routes.plan(request)
        outcome = _Outcome()
        for step, target in enumerate(plan.targets):
            sub = request if target.upstream == request.model else msgspec.structs.replace(request, model=target.upstream)
            route = route_request(sub, self.keys)
            feedback = _Feedback(target.policy)
            tried: set[str] = set()
            for _ in range(self.max_attempts):
                actor = self._pick(target, route, tried, outcome)
                if actor is None:
                    break  # nothing (more) in this group: the next model
                tried.add(actor.name)
                self.recorder.queue_time(actor.name, self.clock() - arrived)
                if feedback.dispatch is not None:
                    feedback.dispatch(actor.name, route, self.clock())
                progress = Progress()
                recorder, name, last_at = self.recorder, actor.name, arrived
                cached: int | None = None
                finished = False
                try:
                    async with closing_stream(actor.stream(sub, prompt_tokens=route.prompt_tokens)) as events:
                        async for event in events:
                            now = self.clock()
                            if progress.events == 0:
                                recorder.time_to_first_token(name, now - arrived)
                                event = self._first_event(event, target, request, step)
                                if feedback.first_token is not None:
                                    feedback.first_token(name, route, now)
                            elif event.token_ids:
                                recorder.inter_token_latency(name, now - last_at)
                            if event.usage is not None:
                                cached = event.usage.cached_tokens
                            last_at = now
                            progress.add(event)
                            yield event
                    finished = True
                    return
                except ContextLengthExceeded as exc:
                    if progress.events or step + 1 == len(plan.targets):
                        raise  # the client's error: no larger model to move on to
                    log.info("model %s: %s; trying the next model", target.name, exc.message)
                    outcome.error = exc
                    self._counts["retries"] += 1
                    break
                except UpstreamError as exc:
                    if progress.events:
                        self._counts["failed"] += 1
                        plan.failed()
                        raise  # after the first token: the migration issue resumes here
                    # The actor's stream already told its health (and woke its prober).
                    self._failed_early(actor, exc, outcome)
                finally:
                    if feedback.complete is not None:
                        feedback.complete(name, route, self.clock(), ok=finished, cached_tokens=cached)
        plan.failed()
        raise self._final_error(outcome, request.model)

    # ------------------------------------------------------------ helpers

    def _group(self, target: Target) -> Iterable[BackendActor]:
        """The target's eligible backends: its named group (trusted to serve
        the model), or every backend that lists the model."""
        if target.backends is None:
            return (a for a in self.actors.values() if a.eligible(target.upstream))
        return (a for a in map(self.actors.__getitem__, target.backends) if a.eligible(None))

    def _pick(self, target: Target, route: RouteRequest, tried: set[str], outcome: _Outcome) -> BackendActor | None:
        now = self.clock()
        candidates: list[BackendActor] = []
        for actor in self._group(target):
            if actor.name in tried:
                continue
            wait = self.cooldowns.remaining(actor.name, now)
            if wait > 0:
                outcome.cooling(wait)
            else:
                candidates.append(actor)
        if not candidates:
            return None
        name = target.policy.pick([a.view() for a in candidates], route, now)
        if name is None:
            return None  # the policy refused: as if the group had nobody
        chosen = self.actors.get(name)
        if chosen is None or chosen not in candidates:
            raise BackendUnavailable(f"routing policy chose {name!r}, which is not a candidate", retry_after=self.retry_after)
        return chosen

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
        return BackendUnavailable(f"no healthy backend for {what}; retry later", retry_after=self.retry_after)

    def statistics(self) -> DispatchStatistics:
        return DispatchStatistics(
            **self._counts,
            cooling=self.cooldowns.cooling(self.clock()),
            versions=tuple(self.routes.statistics()),
        )

"""The dispatcher: the router's own Backend, served by OpenAIServer.

For each generation it asks the routing policy for one of the eligible actors
(up, not draining, serving the model), streams from it, and relays the events.
A backend that fails before its first event is skipped and the request goes to
another (at most ``max_attempts`` backends); after the first event an error is
passed on (resuming there from the token ids already relayed is the migration
issue: :class:`Progress` already records what a resume needs). No eligible
backend -> :class:`~backends.errors.BackendUnavailable` (503 + Retry-After).

Timing per request goes to a :class:`Recorder` (queue time, time to first
token, inter-token latency); :mod:`router.metrics` implements it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

import msgspec
import trio

from backends.base import BackendInfo, Event, GenerateRequest, Health
from backends.errors import BackendUnavailable, UpstreamError
from policies.base import RouteRequest, RoutingPolicy
from router.actors import BackendActor, closing_stream

__all__ = ["DispatchStatistics", "Dispatcher", "NullRecorder", "Progress", "Recorder", "route_request"]

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
    retries: int  # attempts moved to another backend before the first token
    unavailable: int  # refused: no eligible backend
    failed: int  # ended by an upstream error after all attempts or mid-stream


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


def route_request(request: GenerateRequest) -> RouteRequest:
    """The policy's view of a request."""
    prefix = request.prompt or ""
    if not prefix and request.messages:
        prefix = "".join(m.content for m in request.messages if isinstance(m.content, str))
    ids = tuple(request.prompt_token_ids) if request.prompt_token_ids is not None else None
    return RouteRequest(
        request_id=request.request_id,
        model=request.model,
        prompt_token_ids=ids,
        prefix=prefix[:PREFIX_CHARS],
        tenant=request.tenant,
        priority=request.priority,
    )


class Dispatcher:
    """Backend-shaped: ``stream``, ``info``, ``health``, ``aclose``."""

    def __init__(
        self,
        actors: Sequence[BackendActor],
        policy: RoutingPolicy,
        *,
        max_attempts: int = 3,
        retry_after: float = 1.0,
        recorder: Recorder | None = None,
        clock: Callable[[], float] = trio.current_time,
        name: str = "headrace",
    ) -> None:
        self.actors = {a.name: a for a in actors}
        self.policy = policy
        self.max_attempts = max_attempts
        self.retry_after = retry_after
        self.recorder: Recorder = recorder or NullRecorder()
        self.clock = clock
        self.name = name
        self._counts = {"streams": 0, "retries": 0, "unavailable": 0, "failed": 0}

    # ------------------------------------------------------------ Backend

    def info(self) -> BackendInfo:
        """The union of every backend's models (up or not: a model whose
        backends are all down is 503, not 404)."""
        models: dict[str, None] = {}
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
        route = route_request(request)
        tried: set[str] = set()
        last: UpstreamError | None = None
        for _ in range(self.max_attempts):
            actor = self._pick(route, tried, last)
            if actor is None:
                break
            tried.add(actor.name)
            self.recorder.queue_time(actor.name, self.clock() - arrived)
            progress = Progress()
            recorder, name, last_at = self.recorder, actor.name, arrived
            try:
                async with closing_stream(actor.stream(request)) as events:
                    async for event in events:
                        now = self.clock()
                        if progress.events == 0:
                            recorder.time_to_first_token(name, now - arrived)
                        elif event.token_ids:
                            recorder.inter_token_latency(name, now - last_at)
                        last_at = now
                        progress.add(event)
                        yield event
                return
            except UpstreamError as exc:
                if progress.events:
                    self._counts["failed"] += 1
                    raise  # after the first token: the migration issue resumes here
                # The actor's stream already told its health (and woke its prober).
                log.warning("backend %s failed before the first token: %s", actor.name, exc.message)
                last = exc
                self._counts["retries"] += 1
        self._counts["failed"] += 1
        raise last if last is not None else self._unavailable(route)

    # ------------------------------------------------------------ helpers

    def _pick(self, route: RouteRequest, tried: set[str], last: UpstreamError | None) -> BackendActor | None:
        candidates = [a for a in self.actors.values() if a.name not in tried and a.eligible(route.model)]
        if not candidates:
            if last is None:
                raise self._unavailable(route)
            return None
        name = self.policy.pick([a.view() for a in candidates], route, self.clock())
        if name is None:
            raise self._unavailable(route)
        actor = self.actors.get(name)
        if actor is None or actor not in candidates:
            raise BackendUnavailable(f"routing policy chose {name!r}, which is not a candidate", retry_after=self.retry_after)
        return actor

    def _unavailable(self, route: RouteRequest) -> BackendUnavailable:
        self._counts["unavailable"] += 1
        what = f"model {route.model!r}" if route.model else "this request"
        return BackendUnavailable(f"no healthy backend for {what}; retry later", retry_after=self.retry_after)

    def statistics(self) -> DispatchStatistics:
        return DispatchStatistics(**self._counts)

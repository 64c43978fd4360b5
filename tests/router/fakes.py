"""Small in-test backends implementing the Backend protocol, each recording
what happened to it (streams started, cancelled, in flight, probes)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import trio

from backends.base import BackendInfo, Event, GenerateRequest, Health, Usage
from backends.engine.stop import StopMatcher
from backends.errors import BackendUnavailable, HeadraceError, StreamBroken


def _resume_point(prompt: list[int]) -> int:
    """Where the count continues: a prompt ending in ``0, 1, ..., k-1`` (a
    resumed stream) continues at ``k``; any other prompt starts at 0."""
    j, expect = len(prompt) - 1, None
    while j >= 0 and (expect is None or prompt[j] == expect):
        expect = prompt[j] - 1
        if prompt[j] == 0:
            return prompt[-1] + 1
        j -= 1
    return 0


class FakeBackend:
    """Emits ``max_tokens`` (default 4) tokens ``0, 1, ...`` as words ``" t<i>"``
    (continuing the count when the prompt ends in one: the resume contract),
    honouring stop strings; it passes the in-process conformance suite.

    ``fail_before`` raises before the first event; ``break_after`` raises
    StreamBroken after that many events; ``delay`` sleeps before each token;
    ``healthy`` drives probes (``crash_probe`` raises a non-project error)."""

    def __init__(
        self,
        name: str = "fake",
        models: tuple[str, ...] = ("m",),
        *,
        delay: float = 0.0,
        fail_before: HeadraceError | None = None,
        break_after: int | None = None,
    ) -> None:
        self.name = name
        self.models = models
        self.delay = delay
        self.fail_before = fail_before
        self.break_after = break_after
        self.healthy = True
        self.crash_probe = 0  # probes left that raise RuntimeError
        self.hang_probe = False
        self.probes = 0
        self.started = 0
        self.cancelled = 0
        self.in_flight = 0
        self.closed = False
        self.cancelled_at: float | None = None

    def info(self) -> BackendInfo:
        return BackendInfo(name=self.name, models=self.models, token_ids=True)

    async def health(self) -> Health:
        self.probes += 1
        if self.crash_probe:
            self.crash_probe -= 1
            raise RuntimeError("adapter bug")
        if self.hang_probe:
            await trio.sleep_forever()
        if not self.healthy:
            raise BackendUnavailable("connection refused")
        return Health(ok=True)

    async def aclose(self) -> None:
        self.closed = True

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
        self.started += 1
        if self.fail_before is not None:
            raise self.fail_before
        n = request.max_tokens or 4
        prompt = request.prompt_token_ids or [1, 2, 3]
        first = _resume_point(prompt)
        stops = StopMatcher(request.stop)
        self.in_flight += 1
        try:
            for i in range(n):
                if self.break_after is not None and i == self.break_after:
                    raise StreamBroken(f"{self.name} died")
                await trio.sleep(self.delay)
                token = first + i
                text, stopped = stops.feed(f" t{token}")
                last = stopped or i == n - 1
                if last and not stopped:
                    text += stops.flush()
                yield Event(
                    token_ids=[token],
                    text=text,
                    prompt_token_ids=prompt if i == 0 else None,
                    seed=request.seed if i == 0 else None,
                    finish_reason=("stop" if stopped else "length") if last else None,
                    usage=Usage(len(prompt), i + 1) if last else None,
                )
                if last:
                    return
        except (trio.Cancelled, GeneratorExit):
            self.cancelled += 1
            self.cancelled_at = trio.current_time()
            raise
        finally:
            self.in_flight -= 1

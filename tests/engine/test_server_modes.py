"""`headrace engine --speculative` and `--tp` change speed, never output:
the real command line in subprocesses answers exactly like the plain
in-process engine (tiny model, greedy and seeded)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from backends.base import GenerateRequest
from backends.engine.backend import build_engine, open_engine_backend
from backends.engine.config import EngineConfig
from backends.engine.speculative import SpecConfig

pytestmark = pytest.mark.slow

# Repetitive prompts give the n-gram proposer something to find.
PROMPTS = ["the cat the cat the cat the", "a b c a b c a b", "hello world"]


async def _plain(tiny_gguf: Path, body: dict[str, object]) -> list[int]:
    engine, tok, name = build_engine(EngineConfig(model=str(tiny_gguf), num_kv_blocks=128, block_size=4))
    async with open_engine_backend(engine, tok, model_name=name) as backend:
        req = GenerateRequest(prompt=str(body["prompt"]), max_tokens=int(body["max_tokens"]),  # type: ignore[call-overload]
                              temperature=float(body["temperature"]), seed=int(body["seed"]), ignore_eos=True)  # type: ignore[call-overload]
        return [t async for e in backend.stream(req) for t in e.token_ids]


async def _serve(cmd: list[str]) -> tuple[trio.Process, str]:
    proc = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    line = b""
    with trio.fail_after(120):
        while b"engine serving" not in line or not line.endswith(b"\n"):
            chunk = await proc.stdout.receive_some(1024)
            assert chunk, "engine exited before printing its URL"
            line += chunk
    return proc, line.decode().rsplit(" on ", 1)[1].strip()


@pytest.mark.parametrize("extra", [["--speculative", "ngram", "--num-speculative-tokens", "3"], ["--tp", "2"]])
async def test_engine_modes_answer_exactly_like_the_plain_engine(tiny_gguf: Path, extra: list[str]) -> None:
    cmd = [sys.executable, "-m", "router.cli", "engine", "--model", str(tiny_gguf), "--port", "0",
           "--threads", "1", "--block-size", "4", "--dtype", "float32", *extra]
    proc, url = await _serve(cmd)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            for prompt in PROMPTS:
                for temperature in (0.0, 0.9):
                    body = {"prompt": prompt, "max_tokens": 12, "temperature": temperature, "seed": 11,
                            "ignore_eos": True, "return_token_ids": True}
                    r = await client.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    assert r.json()["choices"][0]["token_ids"] == await _plain(tiny_gguf, body), (prompt, temperature)
            metrics = (await client.get("/metrics")).text
            if "--speculative" in extra:
                drafted = next(line for line in metrics.splitlines() if line.startswith("headrace_engine_spec_draft_tokens_total"))
                assert float(drafted.split()[-1]) > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(20):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_a_stop_string_ends_a_speculative_event_at_the_token_that_completed_it(tiny_gguf: Path) -> None:
    """Speculation delivers several tokens per step; the event's ids must stop
    where its text stops, or a resume would skip tokens."""
    # adaptive=False: the premise below (some step delivers several tokens) must
    # not depend on the cost model's measured step times.
    spec = SpecConfig(method="ngram", num_speculative_tokens=4, adaptive=False)
    outputs: dict[str, list[tuple[str, list[int], str]]] = {}
    for label, spec_ in (("plain", None), ("spec", spec)):
        engine, tok, name = build_engine(EngineConfig(model=str(tiny_gguf), num_kv_blocks=128, block_size=4), spec=spec_)
        outputs[label] = []
        async with open_engine_backend(engine, tok, model_name=name) as backend:
            base = GenerateRequest(prompt=PROMPTS[0], max_tokens=24, temperature=0.0, ignore_eos=True)
            full = [e async for e in backend.stream(base)]
            if spec_ is not None:  # the premise: some steps delivered several tokens
                assert max(len(e.token_ids) for e in full) > 1
            text = "".join(e.text for e in full)
            for at in range(1, len(text) - 3, max(1, len(text) // 10)):
                stop = text[at : at + 3]
                req = GenerateRequest(prompt=PROMPTS[0], max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
                stopped = [e async for e in backend.stream(req)]
                ids = [t for e in stopped for t in e.token_ids]
                assert stopped[-1].finish_reason == "stop"
                outputs[label].append((stop, ids, "".join(e.text for e in stopped)))
    assert outputs["plain"] == outputs["spec"]

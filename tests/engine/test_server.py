"""`headrace engine` over real HTTP (h1 and h2 prior knowledge) on 127.0.0.1:0, tiny model."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

from backends.engine.backend import EngineBackend, build_engine
from backends.engine.config import EngineConfig, SamplingDefaults
from backends.engine.server import main, run_server
from frontend.serving import ServeOptions


@pytest.fixture
async def server(tiny_gguf: Path) -> AsyncIterator[tuple[str, EngineBackend]]:
    config = EngineConfig(
        model=str(tiny_gguf),
        num_kv_blocks=64,
        block_size=4,
        max_model_len=128,
        enable_kv_events=True,
    )
    engine, tok, name = build_engine(config)
    backend = EngineBackend(engine, tok, model_name=name)
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(run_server, backend, ServeOptions("127.0.0.1", 0), shutdown)
        yield url, backend
        shutdown.set()


async def test_completion_chat_stream_over_http2(server: tuple[str, EngineBackend]) -> None:
    url, backend = server
    async with httpx.AsyncClient(base_url=url, http1=False, http2=True) as client:
        r = await client.post(
            "/v1/completions", json={"prompt": "the water", "max_tokens": 5, "temperature": 0}
        )
        assert r.status_code == 200 and r.http_version == "HTTP/2"
        body = r.json()
        assert body["usage"]["completion_tokens"] <= 5 and body["model"] == backend.model_name
        req = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
            "temperature": 0,
        }
        async with client.stream("POST", "/v1/chat/completions", json=req) as resp:
            assert resp.status_code == 200
            lines = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in {"stop", "length"}
        assert (await client.get("/health")).status_code == 200


async def test_logprobs_over_http_in_both_openai_shapes(server: tuple[str, EngineBackend]) -> None:
    """/v1/completions ``logprobs: 3``: three distinct alternatives per token (plus
    the chosen one if it is not among them) and rising text offsets; chat: tokens
    with their bytes. Streamed chunks give the same entries as the whole answer."""
    url, _ = server
    async with httpx.AsyncClient(base_url=url) as client:
        body = {"prompt": "the water", "max_tokens": 8, "temperature": 0, "logprobs": 3, "ignore_eos": True}
        choice = (await client.post("/v1/completions", json=body)).json()["choices"][0]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == 8 and all(lp["tokens"])
        assert all(len(top) == 3 and tok in top for tok, top in zip(lp["tokens"], lp["top_logprobs"], strict=True))
        offsets = lp["text_offset"]
        assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(choice["text"])
        assert offsets[-1] > 0
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
            chunks = [json.loads(line[6:]) async for line in resp.aiter_lines() if line.startswith("data: {")]
        streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
        assert [t for c in streamed for t in c["tokens"]] == lp["tokens"]
        assert [o for c in streamed for o in c["text_offset"]] == offsets

        chat = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
            "ignore_eos": True,
        }
        content = (await client.post("/v1/chat/completions", json=chat)).json()["choices"][0]["logprobs"]["content"]
        assert len(content) == 6
        for entry in content:
            assert entry["token"] and entry["bytes"] and all(0 <= b < 256 for b in entry["bytes"])
            texts = [t["token"] for t in entry["top_logprobs"]]
            assert len(set(texts)) == 2 and texts[0] == entry["token"]


async def test_models_say_which_sampling_defaults_apply(tiny_gguf: Path) -> None:
    config = EngineConfig(
        model=str(tiny_gguf), num_kv_blocks=16, block_size=4, max_model_len=64,
        sampling_defaults=SamplingDefaults(temperature=0.4, top_p=0.8),
    )
    engine, tok, name = build_engine(config)
    backend = EngineBackend(engine, tok, model_name=name)
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(run_server, backend, ServeOptions("127.0.0.1", 0), shutdown)
        async with httpx.AsyncClient(base_url=url) as client:
            (model,) = (await client.get("/v1/models")).json()["data"]
        shutdown.set()
    assert model["id"] == name and model["max_model_len"] == 64
    assert model["sampling_defaults"] == {"temperature": 0.4, "top_p": 0.8}
    assert model["sampling_defaults_source"] == "engine config"


async def test_tokenize_detokenize_round_trip(server: tuple[str, EngineBackend]) -> None:
    url, _ = server
    async with httpx.AsyncClient(base_url=url) as client:
        r = await client.post(
            "/tokenize", json={"prompt": " the winter", "return_token_strs": True}
        )
        assert r.status_code == 200
        tok = r.json()
        assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 128
        assert tok["token_strs"][0] == "Ġthe"
        r = await client.post("/detokenize", json={"tokens": tok["tokens"]})
        assert r.json() == {"prompt": " the winter"}
        chat = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]})
        assert chat.json()["tokens"][0] == 1  # <|im_start|>
        bad = await client.post("/detokenize", json={"tokens": [1, 999999]})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        assert (await client.post("/tokenize", json={"prompt": 3})).status_code == 400


async def test_bad_requests_are_400(server: tuple[str, EngineBackend]) -> None:
    url, _ = server
    async with httpx.AsyncClient(base_url=url) as client:
        # Streaming requests: the frontend pulls the first event before answering,
        # so an error raised by the engine at admission gets its real status.
        r = await client.post(
            "/v1/completions", json={"prompt": "the " * 100, "max_tokens": 100, "stream": True}
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = await client.post(
            "/v1/completions", json={"prompt": [1, 5, 10**7], "max_tokens": 2, "stream": True}
        )
        assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
        r = await client.post("/v1/completions", json={"prompt": "the " * 100, "max_tokens": 100})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 500},
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = await client.post(
            "/v1/completions", json={"prompt": [1, 5], "max_tokens": 2, "stream": True}
        )
        assert r.status_code == 200  # still serving after bad input


async def test_kv_events_stream_and_resume(server: tuple[str, EngineBackend]) -> None:
    url, _ = server
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        for start in (3, 50):  # two different prompts: two "stored" events
            r = await client.post(
                "/v1/completions", json={"prompt": list(range(start, start + 17)), "max_tokens": 2}
            )
            assert r.status_code == 200
        first = await _read_events(client, "/v1/kv_events", 2)
        assert first[0]["kind"] == "stored" and first[0]["block_hashes"]
        assert first[1]["seq"] > first[0]["seq"]
        resumed = await _read_events(client, f"/v1/kv_events?since={first[0]['seq']}", 1)
        assert resumed[0] == first[1]


async def _read_events(client: httpx.AsyncClient, path: str, n: int) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    with trio.fail_after(10):
        async with client.stream("GET", path) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    out.append(json.loads(line[6:]))
                    if len(out) == n:
                        return out
    return out


async def test_metrics_expose_engine_counters(server: tuple[str, EngineBackend]) -> None:
    url, _ = server
    async with httpx.AsyncClient(base_url=url) as client:
        await client.post(
            "/v1/completions", json={"prompt": "the", "max_tokens": 3, "ignore_eos": True}
        )
        text = (await client.get("/metrics")).text
    for name in [
        "tokens_per_second",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_ratio",
        "prefix_cache_hit_rate",
        "preemptions_total",
        "batch_size_bucket",
    ]:
        assert f"headrace_engine_{name}" in text
    assert "headrace_engine_generated_tokens_total 3.0" in text


def test_cli_reports_a_missing_model_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--model", str(tmp_path / "missing.gguf"), "--port", "0"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow
async def test_headrace_engine_command_serves_and_drains_on_sigint(tiny_gguf: Path) -> None:
    """The real command line in a subprocess: prints its URL, serves, exits 0 on SIGINT."""
    import signal
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "router.cli",
        "engine",
        "--model",
        str(tiny_gguf),
        "--port",
        "0",
        "--threads",
        "1",
    ]
    proc = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        with trio.fail_after(60):
            assert proc.stdout is not None
            out = b""  # start-up lines (what it loaded and holds), then the URL
            while b"engine serving" not in out or not out.endswith(b"\n"):
                chunk = await proc.stdout.receive_some(1024)
                assert chunk, "engine exited before printing its URL"
                out += chunk
            line = next(x for x in out.decode().splitlines() if x.startswith("engine serving"))
            url = line.split(" on ", 1)[1].strip()
            async with httpx.AsyncClient(base_url=url) as client:
                assert (await client.get("/health")).status_code == 200
                r = await client.post("/v1/completions", json={"prompt": "the", "max_tokens": 2})
                assert r.status_code == 200
            proc.send_signal(signal.SIGINT)
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_shutdown_drains_in_flight_streams_before_stopping_the_engine(tiny_gguf: Path) -> None:
    config = EngineConfig(model=str(tiny_gguf), num_kv_blocks=64, block_size=4, max_model_len=128)
    engine, tok, name = build_engine(config)
    backend = EngineBackend(engine, tok, model_name=name)
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(run_server, backend, ServeOptions("127.0.0.1", 0), shutdown)
        req = {"prompt": "the", "max_tokens": 100, "ignore_eos": True, "stream": True}
        lines = []
        async with (
            httpx.AsyncClient(base_url=url, timeout=30) as client,
            client.stream("POST", "/v1/completions", json=req) as resp,
        ):
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    shutdown.set()  # after the first chunk
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert not (await backend.health()).ok  # the engine stopped after the drain


def test_dtype_auto_picks_bfloat16_only_where_it_is_fast() -> None:
    import torch

    from backends.engine.server import resolve_dtype

    assert resolve_dtype("float32", "cpu") == "float32"
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert resolve_dtype("auto", "cpu") == ("bfloat16" if native else "float32")


def test_cli_sampling_flags_reach_the_engine_config() -> None:
    from backends.engine.server import _config, _parser
    from backends.errors import BadRequest

    args = _parser().parse_args(
        ["--generation-config", "off", "--sampling-defaults", '{"temperature": 0.3}', "--dtype", "float32"]
    )
    config = _config(args)
    assert config.generation_config == "off"
    assert config.sampling_defaults == SamplingDefaults(temperature=0.3)
    with pytest.raises(BadRequest, match="sampling-defaults"):
        _config(_parser().parse_args(["--sampling-defaults", '{"temp": 1}', "--dtype", "float32"]))


def test_cli_speculative_flags_build_a_spec_config_and_bad_values_are_client_errors() -> None:
    from backends.engine.server import _parser, _spec_config
    from backends.errors import BadRequest

    parser = _parser()
    assert _spec_config(parser.parse_args([])).method == "off"
    cfg = _spec_config(
        parser.parse_args(["--speculative", "ngram", "--num-speculative-tokens", "6"])
    )
    assert (cfg.method, cfg.num_speculative_tokens, cfg.max_batch_size) == ("ngram", 6, None)
    assert _spec_config(parser.parse_args(["--speculative", "ngram"])).k_max == 15
    with pytest.raises(BadRequest):
        _spec_config(parser.parse_args(["--num-speculative-tokens", "0"]))


def test_the_idle_kv_budget_is_a_flag_and_a_bad_one_is_a_clear_error() -> None:
    from backends.engine.server import _config, _parser
    from backends.errors import BadRequest

    assert _config(_parser().parse_args(["--dtype", "float32"])).kv_idle_gb is None  # the 64 MiB default
    config = _config(_parser().parse_args(["--dtype", "float32", "--kv-idle-gb", "0.25"]))
    assert config.kv_idle_gb == 0.25 and config.resolve_kv_idle_blocks(1 << 20, 4096) == 256
    with pytest.raises(BadRequest, match="kv_idle_gb must be > 0"):  # `headrace engine` exits 2 with it
        _config(_parser().parse_args(["--dtype", "float32", "--kv-idle-gb", "0"]))


def test_batch_invariance_is_on_by_default_and_can_be_turned_off() -> None:
    from backends.engine.server import _config, _parser

    assert _config(_parser().parse_args(["--dtype", "float32"])).batch_invariant is True
    assert _config(_parser().parse_args(["--dtype", "float32", "--no-batch-invariant"])).batch_invariant is False

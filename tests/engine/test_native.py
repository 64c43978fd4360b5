"""Native decode layers (backends/engine/native.py): the kernel layout holds the file's
weights, a decode step is at least as close to float32 as the torch packed path, each
row's result depends on nothing but the row, and without a compiler torch serves."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from backends.engine import native
from backends.engine.backend import build_engine
from backends.engine.config import EngineConfig
from backends.engine.engine import LLMEngine
from backends.engine.loader import load_model
from backends.engine.native import NativeDecode, q4_blocks
from backends.engine.quant import Q4Weight, attach_q4, q4_from_gguf
from backends.engine.runner import ModelRunner
from backends.engine.scheduler import ScheduledSeq
from backends.engine.sequence import SamplingParams, Sequence
from tests.engine import tiny

needs_native = pytest.mark.skipif(native.library() is None, reason="no C compiler here")


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("native") / "tiny-q4_1.gguf"
    return tiny.write_gguf(tiny.hf_model(), path, qtype=gguf.GGMLQuantizationType.Q4_1)


def _q4(rows: int, cols: int, qtype: str, seed: int) -> Q4Weight:
    array = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = gguf.quants.quantize(array, getattr(gguf.GGMLQuantizationType, qtype))
    q4 = q4_from_gguf(raw, qtype, (rows, cols))
    assert q4 is not None
    return q4


@pytest.mark.parametrize("rows", [(8, 4), (8, 6)])  # 6: the tile of 4 needs padding
def test_the_kernel_layout_holds_the_files_weights(rows: tuple[int, int]) -> None:
    parts = [_q4(rows[0], 64, "Q4_1", 1), _q4(rows[1], 64, "Q4_0", 2)]
    blocks = q4_blocks(parts)  # [tiles, K / 32, 80]
    n = sum(rows)
    assert blocks.shape == (-(-n // 4), 2, 80) and blocks.dtype == torch.uint8
    d = blocks[..., 0:16].contiguous().view(torch.float16).float()  # [tiles, nb, 4 d + 4 m]
    scale, offset = d[..., :4], d[..., 4:]
    codes = blocks[..., 16:].reshape(*blocks.shape[:2], 4, 16)
    q = torch.cat([codes & 0x0F, codes >> 4], dim=-1).float()  # [tiles, nb, 4, 32]
    w = q * scale[..., None] + offset[..., None]
    weights = w.permute(0, 2, 1, 3).reshape(-1, 64)  # [tiles * 4, K]
    expected = torch.cat([p.dequantize() for p in parts])
    torch.testing.assert_close(weights[:n], expected, rtol=0, atol=1e-6)
    assert not weights[n:].any()  # padding rows are zeros


def _runner(path: Path, dtype: torch.dtype, packed: bool) -> ModelRunner:
    loaded = load_model(str(path), dtype=dtype)
    runner = ModelRunner(loaded.model, num_kv_blocks=64, block_size=4, dtype=dtype)
    if packed:
        attach_q4(runner.model, loaded.q4)
    return runner


def _decode_logits(runner: ModelRunner, prompts: list[list[int]], steps: int = 3) -> list[torch.Tensor]:
    """Prefill every prompt in one step, then decode ``steps`` greedy steps together;
    the logits of each decode step, [len(prompts), V] float32."""
    seqs = []
    for i, prompt in enumerate(prompts):
        seq = Sequence(f"s{i}", list(prompt), SamplingParams())
        seq.block_table = list(range(10 * i, 10 * i + 10))
        seqs.append(seq)
    logits = runner.execute([ScheduledSeq(s, len(s.token_ids)) for s in seqs])
    out = []
    for _ in range(steps):
        for seq, row in zip(seqs, logits, strict=True):
            seq.num_computed_tokens = len(seq.token_ids)
            seq.token_ids.append(int(row.argmax()))
        logits = runner.execute([ScheduledSeq(s, 1) for s in seqs])
        out.append(logits)
    return out


PROMPTS = [[5, 6, 7, 8, 9], [30, 31, 32], [40, 41, 42, 43, 44, 45, 46], [12, 13]]


# The matmuls as this CPU builds them (integer dot products where it has VNNI), and
# built without VNNI: the float32 variant that CPUs without it run.
VARIANTS = ["", "-mno-avx512vnni -mno-avxvnni"]


@pytest.fixture(params=VARIANTS, ids=["native", "float-matmuls"])
def variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(native, "_lib", [])
    monkeypatch.setenv("HEADRACE_NATIVE_CFLAGS", request.param)
    if native.library() is None:
        pytest.skip("no C compiler here")
    return str(request.param)


def test_a_native_step_is_as_close_to_float32_as_the_torch_packed_path(
    tiny_q4: Path, variant: str
) -> None:
    reference = _runner(tiny_q4, torch.float32, packed=False)  # the file's weights, exactly
    fast = _runner(tiny_q4, torch.bfloat16, packed=True)
    torch_path = _runner(tiny_q4, torch.bfloat16, packed=True)
    torch_path.model.native_decode = False
    # Teacher-forced: every runner decodes the reference's tokens.
    ref = _decode_logits(reference, PROMPTS)
    nat = _decode_logits(fast, PROMPTS)
    assert isinstance(fast.model.__dict__["_fast"]["native"], NativeDecode)
    tor = _decode_logits(torch_path, PROMPTS)
    assert "native" not in torch_path.model.__dict__.get("_fast", {})
    for r, n, t in zip(ref, nat, tor, strict=True):
        scale = r.abs().max()
        native_err = float((n - r).abs().max() / scale)
        torch_err = float((t - r).abs().max() / scale)
        assert native_err < 0.03
        assert native_err <= 1.25 * torch_err + 1e-3, (native_err, torch_err)


def test_a_rows_result_depends_on_the_row_only(tiny_q4: Path, variant: str) -> None:
    """Alone, batched with others, or on one thread: the same bits."""
    together = _decode_logits(_runner(tiny_q4, torch.bfloat16, packed=True), PROMPTS)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = _decode_logits(_runner(tiny_q4, torch.bfloat16, packed=True), PROMPTS)
    finally:
        torch.set_num_threads(threads)
    for i, prompt in enumerate(PROMPTS):
        alone = _decode_logits(_runner(tiny_q4, torch.bfloat16, packed=True), [prompt])
        for step in range(len(alone)):
            assert torch.equal(alone[step][0], together[step][i])
            assert torch.equal(single[step][i], together[step][i])


def _serve(engine: LLMEngine, prompts: list[list[int]], arrivals: list[int]) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    step = 0
    while step <= arrivals[-1] or engine.scheduler.has_unfinished():
        for i in (i for i, at in enumerate(arrivals) if at == step):
            engine.add_request(f"r{i}", prompts[i], params)
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        step += 1
    return [out[f"r{i}"] for i in range(len(prompts))]


@needs_native
def test_tokens_alone_equal_tokens_batched_with_prefills_in_the_step(tiny_q4: Path) -> None:
    """Requests arrive while others decode, so steps mix prefill and decode rows: the
    decode rows still run natively, and each request gets the tokens it gets alone."""
    config = EngineConfig(model=str(tiny_q4), dtype="bfloat16")
    engine, _, _ = build_engine(config)
    together = _serve(engine, PROMPTS, [0, 0, 2, 4])
    assert isinstance(engine.runner.model.__dict__["_fast"]["native"], NativeDecode)
    for prompt, tokens in zip(PROMPTS, together, strict=True):
        alone, _, _ = build_engine(config)
        assert _serve(alone, [prompt], [0]) == [tokens]


@needs_native
def test_weight_edits_and_hooks_are_seen(tiny_q4: Path) -> None:
    config = EngineConfig(model=str(tiny_q4), dtype="bfloat16")
    engine, _, _ = build_engine(config)
    model = engine.runner.model
    _serve(engine, PROMPTS[:1], [0])
    plan = model.__dict__["_fast"]["native"]
    assert isinstance(plan, NativeDecode) and plan.valid()
    with torch.inference_mode():  # an in-place edit: the codes no longer describe it
        model.layers[1].feed_forward.w2.weight.mul_(-1.5)
    assert not plan.valid()
    edited = _serve(engine, PROMPTS[:1], [0])
    assert model.__dict__["_fast"]["native"] is False  # no codes for w2: torch serves
    reference, _, _ = build_engine(config)
    reference.runner.model.native_decode = False
    with torch.inference_mode():
        reference.runner.model.layers[1].feed_forward.w2.weight.mul_(-1.5)
    assert edited == _serve(reference, PROMPTS[:1], [0])

    fresh, _, _ = build_engine(config)
    calls: list[int] = []
    fresh.runner.model.layers[0].attention.register_forward_hook(lambda *_: calls.append(1))
    _serve(fresh, PROMPTS[:1], [0])
    assert len(calls) == 12  # every step went through the module


def test_without_a_compiler_torch_serves(tiny_q4: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_lib", [])
    monkeypatch.setenv("CC", "/bin/false")  # a compiler that always fails
    assert native.library() is None
    config = EngineConfig(model=str(tiny_q4), dtype="bfloat16")
    engine, _, _ = build_engine(config)
    tokens = _serve(engine, PROMPTS[:2], [0, 0])
    assert engine.runner.model.__dict__["_fast"]["native"] is False
    reference, _, _ = build_engine(config)
    reference.runner.model.native_decode = False
    assert tokens == _serve(reference, PROMPTS[:2], [0, 0])

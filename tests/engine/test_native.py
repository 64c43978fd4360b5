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


# (hidden size, query heads, KV heads): head_dim 16, and head_dim 64 as the default
# model has (the kernels' bfloat16 dot-product attention takes head_dim % 32 == 0)
SHAPES = {"head16": (64, 4, 2), "head64": (128, 2, 1)}


@pytest.fixture(scope="module", params=list(SHAPES.values()), ids=list(SHAPES))
def tiny_q4(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    hidden, heads, kv_heads = request.param
    path = tmp_path_factory.mktemp("native") / f"tiny-{hidden}-q4_1.gguf"
    model = tiny.hf_model(hidden=hidden, heads=heads, kv_heads=kv_heads)
    return tiny.write_gguf(model, path, qtype=gguf.GGMLQuantizationType.Q4_1)


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
    """A runner on the kernels chosen by batch size (few-sequence and batched; the
    batch-invariant mode takes the batched one for every row: tests/engine_invariance)."""
    loaded = load_model(str(path), dtype=dtype)
    runner = ModelRunner(
        loaded.model, num_kv_blocks=256, block_size=4, dtype=dtype, batch_invariant=False
    )
    if packed:
        attach_q4(runner.model, loaded.q4)
    return runner


def _decode_logits(
    runner: ModelRunner, prompts: list[list[int]], steps: int = 3,
    forced: list[list[int]] | None = None,
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill every prompt in one step, then decode ``steps`` steps together, each
    sequence taking its greedy token (or the next of ``forced[i]``: teacher forcing).
    Returns the logits of each decode step ([len(prompts), V] float32) and the tokens
    each sequence took."""
    seqs = []
    for i, prompt in enumerate(prompts):
        seq = Sequence(f"s{i}", list(prompt), SamplingParams())
        seq.block_table = list(range(10 * i, 10 * i + 10))
        seqs.append(seq)
    logits = runner.execute([ScheduledSeq(s, len(s.token_ids)) for s in seqs])
    out, taken = [], [[] for _ in prompts]
    for step in range(steps):
        for i, (seq, row) in enumerate(zip(seqs, logits, strict=True)):
            seq.num_computed_tokens = len(seq.token_ids)
            token = forced[i][step] if forced else int(row.argmax())
            seq.token_ids.append(token)
            taken[i].append(token)
        logits = runner.execute([ScheduledSeq(s, 1) for s in seqs])
        out.append(logits)
    return out, taken


PROMPTS = [[5, 6, 7, 8, 9], [30, 31, 32], [40, 41, 42, 43, 44, 45, 46], [12, 13]]
# More sequences than INT4_MAX_SEQS: the batched kernels (AMX, or bfloat16 dot products).
MANY = [[7 + i, 50 + 3 * i, 9, 100 + i][: 2 + i % 3] for i in range(12)]

# The kernels as this CPU builds them (integer dot products where it has VNNI, AMX for
# many rows where it has AMX), without VNNI and AMX (float32 for a few rows, bfloat16
# dot products for many), and plain AVX-512 (float32 for both): what other CPUs run.
NO_VNNI_AMX = "-mno-avx512vnni -mno-avxvnni -mno-amx-tile -mno-amx-bf16 -mno-amx-int8"
VARIANTS = {"native": "", "no-vnni-amx": NO_VNNI_AMX, "plain": NO_VNNI_AMX + " -mno-avx512bf16"}


@pytest.fixture(params=list(VARIANTS.values()), ids=list(VARIANTS))
def variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(native, "_lib", [])
    monkeypatch.setenv("HEADRACE_NATIVE_CFLAGS", request.param)
    if native.library() is None:
        pytest.skip("no C compiler here")
    return str(request.param)


@pytest.mark.parametrize("prompts", [PROMPTS, MANY], ids=["few", "many"])
def test_a_native_step_is_as_close_to_float32_as_the_torch_path(
    tiny_q4: Path, variant: str, prompts: list[list[int]]
) -> None:
    reference = _runner(tiny_q4, torch.float32, packed=False)  # the file's weights, exactly
    fast = _runner(tiny_q4, torch.bfloat16, packed=True)
    torch_path = _runner(tiny_q4, torch.bfloat16, packed=True)
    torch_path.model.native_decode = False
    # Teacher-forced: every runner decodes the reference's tokens.
    ref, forced = _decode_logits(reference, prompts)
    nat, _ = _decode_logits(fast, prompts, forced=forced)
    assert isinstance(fast.model.__dict__["_fast"]["native"], NativeDecode)
    tor, _ = _decode_logits(torch_path, prompts, forced=forced)
    assert "native" not in torch_path.model.__dict__.get("_fast", {})
    for r, n, t in zip(ref, nat, tor, strict=True):
        scale = r.abs().max()
        native_err = float((n - r).abs().max() / scale)
        torch_err = float((t - r).abs().max() / scale)
        assert native_err < 0.03
        assert native_err <= 1.25 * torch_err + 1e-3, (native_err, torch_err)


def _logits(path: Path, prompts: list[list[int]], threads: int | None = None) -> list[torch.Tensor]:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads or before)
        return _decode_logits(_runner(path, torch.bfloat16, packed=True), prompts)[0]
    finally:
        torch.set_num_threads(before)


def test_a_rows_result_depends_on_the_row_only(tiny_q4: Path, variant: str) -> None:
    """Within each kernel: alone or batched with a few others; batched with 2, 8 or 11
    others; on two threads or one: the same bits."""
    limit = _runner(tiny_q4, torch.bfloat16, packed=True).model.packed_seq_limit()
    few = PROMPTS[:limit]
    together = _logits(tiny_q4, few)
    single = _logits(tiny_q4, few, threads=1)
    for i, prompt in enumerate(few):
        alone = _logits(tiny_q4, [prompt])
        for step in range(len(alone)):
            assert torch.equal(alone[step][0], together[step][i])
            assert torch.equal(single[step][i], together[step][i])
    many = _logits(tiny_q4, MANY)
    many_single = _logits(tiny_q4, MANY, threads=1)
    for n in sorted({limit + 1, 9}):
        fewer = _logits(tiny_q4, MANY[:n])
        for step in range(len(many)):
            assert torch.equal(fewer[step], many[step][:n])
    for step in range(len(many)):
        assert torch.equal(many_single[step], many[step])


def _serve(
    engine: LLMEngine, prompts: list[list[int]], arrivals: list[int],
    max_tokens: list[int] | None = None,
) -> list[list[int]]:
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    step = 0
    while step <= max(arrivals) or engine.scheduler.has_unfinished():
        for i in (i for i, at in enumerate(arrivals) if at == step):
            n = max_tokens[i] if max_tokens else 12
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            engine.add_request(f"r{i}", prompts[i], params)
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        step += 1
    return [out[f"r{i}"] for i in range(len(prompts))]


@needs_native
def test_tokens_alone_equal_tokens_batched_with_prefills_in_the_step(tiny_q4: Path) -> None:
    """Requests arrive while others decode, so steps mix prefill and decode rows: the
    decode rows still run natively, and each request gets the tokens it gets alone, as
    long as the steps stay on the few-sequence kernel."""
    config = EngineConfig(model=str(tiny_q4), dtype="bfloat16", batch_invariant=False)
    engine, _, _ = build_engine(config)
    few = PROMPTS[: engine.runner.model.packed_seq_limit()]
    together = _serve(engine, few, [0, 2, 3, 5][: len(few)])
    assert isinstance(engine.runner.model.__dict__["_fast"]["native"], NativeDecode)
    for prompt, tokens in zip(few, together, strict=True):
        alone, _, _ = build_engine(config)
        assert _serve(alone, [prompt], [0]) == [tokens]


@needs_native
def test_many_sequences_get_the_same_tokens_however_they_arrive(tiny_q4: Path) -> None:
    """On the many-sequence kernel too: twelve requests at once, or ten and then two
    more that meet them mid-decode (mixed steps) and end with them (so no step falls
    back to a few sequences), give every request the same tokens."""
    config = EngineConfig(model=str(tiny_q4), dtype="bfloat16", batch_invariant=False)
    lengths = [12] * 10 + [10, 10]
    at_once, _, _ = build_engine(config)
    staggered, _, _ = build_engine(config)
    assert at_once.runner.model.packed_seq_limit() < 10
    expected = _serve(at_once, MANY, [0] * 12, lengths)
    assert _serve(staggered, MANY, [0] * 10 + [2, 2], lengths) == expected


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

"""4-bit weights kept packed: the codes read from GGUF blocks are exactly the file's
weights, the kernel computes with them, and the model uses them only where it should."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from backends.engine.backend import build_engine
from backends.engine.config import EngineConfig
from backends.engine.engine import LLMEngine
from backends.engine.loader import load_model
from backends.engine.model import FastDecode, LinearGroup, _can_pack
from backends.engine.quant import (
    INT4_MAX_ROWS,
    Int4Linear,
    Q4Weight,
    attach_q4,
    int4_supported,
    q4_from_gguf,
    q4_of,
)
from backends.engine.sequence import SamplingParams
from tests.engine import tiny

needs_int4 = pytest.mark.skipif(
    not int4_supported(torch.empty(0, dtype=torch.bfloat16)),
    reason="torch has no CPU int4 kernel here",
)


def _q4(rows: int, cols: int, qtype: str, seed: int = 0) -> tuple[Q4Weight, np.ndarray]:
    """A random weight quantised by gguf: (our codes, gguf's own dequantisation)."""
    array = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    raw = gguf.quants.quantize(array, kind)
    q4 = q4_from_gguf(raw, qtype, (rows, cols))
    assert q4 is not None
    return q4, gguf.quants.dequantize(raw, kind)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_codes_read_from_gguf_blocks_give_back_gguf_weights_exactly(qtype: str) -> None:
    q4, expected = _q4(48, 96, qtype)
    assert q4.shape == (48, 96)
    assert q4.codes.dtype == torch.uint8 and q4.codes.shape == (48, 48)
    assert int(q4.q().min()) >= 0 and int(q4.q().max()) <= 15
    assert torch.equal(q4.dequantize(), torch.from_numpy(expected))


def test_other_tensor_types_have_no_codes() -> None:
    array = np.ones((4, 32), dtype=np.float32)
    raw = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
    assert q4_from_gguf(raw, "Q8_0", (4, 32)) is None
    assert q4_from_gguf(array, "F32", (4, 32)) is None


@needs_int4
def test_the_kernel_multiplies_by_the_weights_and_rows_do_not_interact() -> None:
    a, wa = _q4(64, 96, "Q4_1", seed=1)
    b, wb = _q4(32, 96, "Q4_0", seed=2)
    lin = Int4Linear([a, b], torch.bfloat16)
    x = torch.randn(INT4_MAX_ROWS, 96).to(torch.bfloat16)
    y = lin(x)
    assert y.shape == (INT4_MAX_ROWS, 96) and y.dtype == torch.bfloat16
    exact = x.float() @ torch.from_numpy(np.concatenate([wa, wb])).T
    torch.testing.assert_close(y.float(), exact, rtol=2e-2, atol=2e-2 * exact.abs().max().item())
    for i in range(INT4_MAX_ROWS):  # a row alone gives the same bits as in the batch
        assert torch.equal(lin(x[i : i + 1]), y[i : i + 1])


def test_shapes_the_kernel_cannot_take_are_refused() -> None:
    a, _ = _q4(40, 64, "Q4_0")  # N not a multiple of 16
    assert not Int4Linear.fits([a])
    with pytest.raises(ValueError, match="do not fit"):
        Int4Linear([a], torch.bfloat16)


@needs_int4
def test_a_linear_group_uses_the_codes_for_small_batches_only_and_forgets_stale_ones() -> None:
    q4, dense = _q4(64, 96, "Q4_1", seed=3)
    lin = nn.Linear(96, 64, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(dense))
    group = LinearGroup(lin)
    small = torch.randn(INT4_MAX_ROWS, 96).to(torch.bfloat16)
    big = torch.randn(INT4_MAX_ROWS + 1, 96).to(torch.bfloat16)
    before = group(small)[0]
    assert attach_q4(nn.ModuleDict({"proj": lin}), {"proj.weight": q4}) == 1
    assert q4_of(lin) is q4
    packed = Int4Linear([q4], torch.bfloat16)
    assert torch.equal(group(small)[0], packed(small))  # the 4-bit kernel
    assert not torch.equal(group(small)[0], before)
    assert torch.equal(group(big)[0], nn.functional.linear(big, lin.weight))  # dense
    lin.weight = nn.Parameter(lin.weight.detach().clone())  # replaced: codes are stale
    assert q4_of(lin) is None
    assert torch.equal(group(small)[0], before)


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("q4") / "tiny-q4_1.gguf"
    return tiny.write_gguf(tiny.hf_model(), path, qtype=gguf.GGMLQuantizationType.Q4_1)


def test_the_loader_keeps_the_codes_of_every_q4_matrix(tiny_q4: Path) -> None:
    loaded = load_model(str(tiny_q4))
    state = dict(loaded.model.named_parameters())
    assert "layers.0.attention.wq.weight" in loaded.q4
    assert "layers.1.feed_forward.w2.weight" in loaded.q4
    for name, q4 in loaded.q4.items():
        assert torch.equal(q4.dequantize(), state[name].detach()), name


@needs_int4
def test_engine_serves_q4_packed_and_stays_batch_invariant(tiny_q4: Path) -> None:
    """bfloat16 + packed codes: answers close to the dense model's and, within the
    kernel's row range, the same tokens alone and batched."""
    prompts = [[5, 6, 7, 8, 9], [30, 31, 32], [40, 41, 42, 43, 44, 45, 46], [12, 13]]

    def run(packed: bool, batch: list[list[int]]) -> list[list[int]]:
        # the batch-size-chosen kernels (batch_invariant=False): the packed rows
        config = EngineConfig(
            model=str(tiny_q4), dtype="bfloat16", packed_weights=packed, batch_invariant=False
        )
        engine, _, _ = build_engine(config)
        engine.runner.model.native_decode = False  # torch's kernel: test_native.py has the rest
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(batch))}
        arrivals = [0, 0, 2, 4][: len(batch)]  # prefills together, then meeting decodes
        step = 0
        while step <= arrivals[-1] or engine.scheduler.has_unfinished():
            for i in (i for i, at in enumerate(arrivals) if at == step):
                engine.add_request(f"r{i}", batch[i], params)
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
            step += 1
        attention = engine.runner.model.layers[0].attention
        assert (attention._qkv._int4 is not None) == packed
        return [out[f"r{i}"] for i in range(len(batch))]

    together = run(True, prompts)
    alone = [run(True, [p])[0] for p in prompts]
    assert together == alone
    # The dense bfloat16 model is the same weights up to bfloat16 rounding.
    dense = run(False, prompts)
    agree = sum(a == b for t, d in zip(together, dense, strict=True) for a, b in zip(t, d, strict=True))
    assert agree >= 0.75 * sum(len(t) for t in together)


def _decode(engine: LLMEngine, prompts: list[list[int]], tokens: int = 10) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {}
    base = engine.statistics().num_requests_finished  # fresh request ids each call
    for i, prompt in enumerate(prompts):
        out[f"q{base}-{i}"] = []
        engine.add_request(f"q{base}-{i}", prompt, params)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return list(out.values())


@pytest.mark.parametrize(
    ("dtype", "packed"), [("bfloat16", True), ("bfloat16", False), ("float32", False)]
)
def test_the_fast_decode_path_gives_the_module_paths_tokens(
    tiny_q4: Path, dtype: str, packed: bool
) -> None:
    """Decode steps run as straight-line kernel calls (model.FastDecode): the same
    tokens as the module path, packed 4-bit, prepacked bfloat16 or float32; a weight
    edited in place and a hook on a layer (how tensor parallelism all-reduces) are
    seen."""
    if dtype == "bfloat16" and not _can_pack(torch.empty(0, dtype=torch.bfloat16)):
        pytest.skip("oneDNN has no bfloat16 kernels on this CPU")
    if packed and not int4_supported(torch.empty(0, dtype=torch.bfloat16)):
        pytest.skip("torch has no CPU int4 kernel here")
    prompts = [[5, 6, 7, 8, 9], [30, 31, 32], [40, 41, 42, 43], [12, 13]]
    config = EngineConfig(
        model=str(tiny_q4), dtype=dtype, packed_weights=packed, batch_invariant=False
    )
    fast_engine, _, _ = build_engine(config)
    slow_engine, _, _ = build_engine(config)
    fast, slow = fast_engine.runner.model, slow_engine.runner.model
    slow.fast_decode = False
    fast.native_decode = False  # this is about the torch kernels: tests/engine/test_native.py
    assert _decode(fast_engine, prompts) == _decode(slow_engine, prompts)
    plan = fast.__dict__["_fast"][True]  # 4 decoding sequences: packed rows
    assert isinstance(plan, FastDecode) and plan.valid()
    assert isinstance(plan.layers[0].down, Int4Linear) == packed
    assert not any(isinstance(p, FastDecode) for p in slow.__dict__.get("_fast", {}).values())

    with torch.inference_mode():  # an in-place edit: the kernels are rebuilt, or dropped
        for model in (fast, slow):
            model.layers[1].feed_forward.w2.weight.mul_(-1.5)
    assert not plan.valid()
    assert _decode(fast_engine, prompts) == _decode(slow_engine, prompts)

    calls: list[int] = []
    fast.layers[0].attention.register_forward_hook(lambda *_: calls.append(1))
    _decode(fast_engine, prompts[:1], tokens=3)
    assert len(calls) == 3  # the prefill and both decode steps went through the module

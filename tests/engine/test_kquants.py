"""GGUF K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) load exactly as ``gguf`` dequantises them,
and the engine serves a model stored in them.

gguf-py dequantises K-quants but cannot write them, so the blocks are built by hand:
random codes and sub-block scales, with finite fp16 super-block scales (``d``, ``dmin``)
sized so the weights stay in the range of the rest of the tiny model. A K-quant
super-block holds 256 values of one row, so the tiny model gets ``intermediate=256`` and
every layer's ``ffn_down`` (rows of 256) is stored that way; the rest stays F32.
"""

from __future__ import annotations

import copy
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from backends.base import GenerateRequest
from backends.engine.backend import build_engine, open_engine_backend
from backends.engine.config import EngineConfig
from backends.engine.loader import ModelLoadError, load_model, read_checkpoint
from backends.engine.runner import ModelRunner
from backends.engine.scheduler import ScheduledSeq
from backends.engine.sequence import SamplingParams, Sequence
from tests.engine import tiny

Q = gguf.GGMLQuantizationType
INTERMEDIATE = 256  # one K-quant super-block per ffn_down row
LAYERS = 2

# Where each type keeps its fp16 super-block scales (byte offset in the block) and how
# large to make them: (largest sub-block scale * largest code) * d stays near 0.2, and
# the subtracted minimum (dmin * largest 4/6-bit min) near 0.1.
_SCALES: dict[gguf.GGMLQuantizationType, tuple[tuple[int, float], ...]] = {
    Q.Q2_K: ((80, 0.2 / (15 * 3)), (82, 0.1 / 15)),  # scales[16] qs[64] d dmin
    Q.Q3_K: ((108, 0.2 / (32 * 4)),),  # hmask[32] qs[64] scales[12] d
    Q.Q4_K: ((0, 0.2 / (63 * 15)), (2, 0.1 / 63)),  # d dmin scales[12] qs[128]
    Q.Q5_K: ((0, 0.2 / (63 * 31)), (2, 0.1 / 63)),  # d dmin scales[12] qh[32] qs[128]
    Q.Q6_K: ((208, 0.2 / (128 * 32)),),  # ql[128] qh[64] scales[16] d
}
K_TYPES = list(_SCALES)


def kquant_bytes(
    qtype: gguf.GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator
) -> np.ndarray:
    """A ``[rows, cols]`` matrix in ``qtype`` as GGUF stores it: uint8 ``[rows, bytes]``."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    blocks = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    unscaled = blocks.copy()
    for offset, magnitude in _SCALES[qtype]:
        scale = (rng.uniform(0.5, 1.0, size=n) * magnitude).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(n, 2)
        unscaled[:, offset : offset + 2] = 0
    # The offsets above are the block's only scales: zeroing them zeroes every value.
    assert not gguf.quants.dequantize(unscaled, qtype).any(), qtype.name
    return blocks.reshape(rows, cols // block * size)


@pytest.fixture(scope="module")
def wide_hf_model():  # type: ignore[no-untyped-def]
    return tiny.hf_model(intermediate=INTERMEDIATE, layers=LAYERS, seed=3)


@pytest.fixture(scope="module", params=K_TYPES, ids=[t.name for t in K_TYPES])
def kquant_model(request, tmp_path_factory, wide_hf_model):  # type: ignore[no-untyped-def]
    """(qtype, GGUF path, {layer: expected float32 ffn_down}, HF model with those weights)."""
    qtype: gguf.GGMLQuantizationType = request.param
    rng = np.random.default_rng(int(qtype))
    dim = wide_hf_model.config.hidden_size
    raw = {
        f"blk.{i}.ffn_down.weight": (kquant_bytes(qtype, dim, INTERMEDIATE, rng), qtype)
        for i in range(LAYERS)
    }
    path = tiny.write_gguf(
        wide_hf_model, tmp_path_factory.mktemp(qtype.name) / f"tiny-{qtype.name}.gguf", raw=raw
    )
    expected = {
        i: gguf.quants.dequantize(raw[f"blk.{i}.ffn_down.weight"][0], qtype) for i in range(LAYERS)
    }
    reference = copy.deepcopy(wide_hf_model)
    with torch.no_grad():
        for i, w in expected.items():
            reference.model.layers[i].mlp.down_proj.weight.copy_(torch.from_numpy(w))
    return qtype, path, expected, reference


def test_kquant_weights_load_exactly_as_gguf_dequantises_them(kquant_model) -> None:  # type: ignore[no-untyped-def]
    _, path, expected, reference = kquant_model
    ckpt = read_checkpoint(str(path))
    assert (ckpt.args.dim, ckpt.args.hidden_dim) == (64, INTERMEDIATE)
    for i, want in expected.items():
        # sane test data: finite, not all zero, in the range of the other weights
        assert np.isfinite(want).all() and want.std() > 0.01 and np.abs(want).max() < 1.0
        ours = ckpt.state_dict[f"layers.{i}.feed_forward.w2.weight"]
        # nn.Linear(hidden_dim, dim).weight: [dim, hidden_dim], GGUF rows in order
        assert ours.dtype == torch.float32 and ours.shape == (64, INTERMEDIATE)
        np.testing.assert_array_equal(ours.numpy(), want)
    # the F32 tensors around them are untouched, and nothing is kept packed (Q4 only)
    torch.testing.assert_close(
        ckpt.state_dict["layers.0.feed_forward.w1.weight"],
        reference.model.layers[0].mlp.gate_proj.weight,
        rtol=0,
        atol=0,
    )
    assert not ckpt.q4


def test_kquant_model_logits_match_transformers(kquant_model) -> None:  # type: ignore[no-untyped-def]
    """The dequantised matrices sit in the right place and orientation in the model:
    one prefill gives transformers' logits for the same weights."""
    _, path, _, reference = kquant_model
    runner = ModelRunner(load_model(str(path)).model, num_kv_blocks=8, block_size=4)
    ids = [5, 70, 100, 200, 33, 260]
    seq = Sequence("s", ids, SamplingParams())
    seq.block_table = [0, 1]
    logits = runner.execute([ScheduledSeq(seq, len(ids))])
    assert logits.shape == (1, runner.args.vocab_size)
    assert torch.isfinite(logits).all()
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(logits[0], want, rtol=1e-4, atol=1e-4)


async def test_engine_generates_greedily_on_a_kquant_model(kquant_model) -> None:  # type: ignore[no-untyped-def]
    _, path, _, reference = kquant_model
    config = EngineConfig(model=str(path), num_kv_blocks=16, block_size=4, max_model_len=64)
    engine, tok, name = build_engine(config)
    prompt = [5, 70, 100, 200, 33]
    async with open_engine_backend(engine, tok, model_name=name) as backend:
        req = GenerateRequest(
            prompt_token_ids=prompt, max_tokens=4, temperature=0.0, ignore_eos=True
        )
        ids = [t for e in [e async for e in backend.stream(req)] for t in e.token_ids]
    want = list(prompt)
    with torch.no_grad():
        for _ in range(4):
            want.append(int(reference(torch.tensor([want])).logits[0, -1].argmax()))
    assert ids == want[len(prompt) :]


def test_type_gguf_cannot_dequantise_is_a_clear_error(tmp_path: Path, wide_hf_model) -> None:  # type: ignore[no-untyped-def]
    qtype = Q.Q8_K  # llama.cpp's intermediate type for dot products, never in a model file
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = np.zeros((64, INTERMEDIATE // block * size), dtype=np.uint8)
    try:
        gguf.quants.dequantize(data, qtype)
    except NotImplementedError:
        pass
    else:
        pytest.skip(f"this gguf dequantises {qtype.name}")
    path = tiny.write_gguf(
        wide_hf_model, tmp_path / "q8k.gguf", raw={"blk.0.ffn_down.weight": (data, qtype)}
    )
    with pytest.raises(
        ModelLoadError, match=r"cannot dequantise Q8_K \(blk\.0\.ffn_down\.weight\)"
    ):
        read_checkpoint(str(path))

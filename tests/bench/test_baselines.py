"""The yardsticks: roofline arithmetic and the transformers generate() timer."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.errors import BadRequest
from bench.roofline import BYTES_PER_WEIGHT, decode_floor, measure_bandwidth, weight_bytes
from bench.schedule import _WORDS, make_prompt


def test_the_decode_floor_is_weight_bytes_over_bandwidth() -> None:
    floor, ceiling = decode_floor(269_000_000, 10e9)  # SmolLM2 bf16 at 10 GB/s
    assert floor == pytest.approx(0.0269)
    assert ceiling == pytest.approx(37.17, rel=1e-3)


def test_a_small_copy_measures_a_plausible_bandwidth() -> None:
    copy, read = measure_bandwidth("cpu", size_bytes=8 << 20, repeats=2)
    assert 1e8 < copy < 1e13 and 1e8 < read < 1e13


def _tiny_gguf(path: Path, tied: bool) -> Path:
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((100, 8), dtype=np.float32))
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((8, 8), dtype=np.float32))
    if not tied:
        writer.add_tensor("output.weight", np.zeros((100, 8), dtype=np.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file,
                 writer.write_tensors_to_file):
        step()
    writer.close()
    return path


def test_weights_read_per_step_count_a_tied_embedding_but_not_an_untied_one(
        tmp_path: Path) -> None:
    tied = _tiny_gguf(tmp_path / "tied.gguf", tied=True)
    untied = _tiny_gguf(tmp_path / "untied.gguf", tied=False)
    assert weight_bytes(tied, "bf16") == (864, 1728)  # embedding doubles as the LM head
    assert weight_bytes(untied, "fp32") == (864, 3456)  # one embedding row only: left out
    assert weight_bytes(tied, "gguf") == (864, 864 * 4)  # the file's own f32 bytes
    assert BYTES_PER_WEIGHT["q4_1"] == 0.625
    with pytest.raises(BadRequest, match="dtype"):
        weight_bytes(tied, "fp8")


def test_transformers_generate_makes_exactly_max_new_tokens_with_eos_banned() -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from bench.transformers_baseline import measure

    vocab = {w: i for i, w in enumerate(("<pad>", *_WORDS))}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", padding_side="left")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)).eval()
    inputs = tok([make_prompt(0, 0, 3)], return_tensors="pt")  # measure's first prompt
    with torch.inference_mode():
        first = int(model(**inputs).logits[0, -1].argmax())
    model.generation_config.eos_token_id = first  # greedy would stop after one token
    assert measure(model, tok, batch=1, new_tokens=5, prompt_tokens=3)["new_tokens"] == 5
    r = measure(model, tok, batch=2, new_tokens=5, prompt_tokens=3)
    assert (r["batch"], r["new_tokens"], r["prompt_len"]) == (2, 5, 3)
    assert r["tok_s"] == pytest.approx(10 / r["seconds"])
    assert r["decode_tok_s"] > 0 and r["per_stream_decode_tok_s"] == pytest.approx(
        r["decode_tok_s"] / 2)


def test_packed_bytes_count_q4_matrices_at_four_bits_and_the_rest_in_bfloat16(
        tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "q4.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((100, 32), dtype=np.float32))
    up = gguf.quants.quantize(np.ones((16, 32), dtype=np.float32), gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.ffn_up.weight", up, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(32, dtype=np.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file,
                 writer.write_tensors_to_file):
        step()
    writer.close()
    n, size = weight_bytes(path, "bf16-packed")
    assert n == 3200 + 512 + 32
    # tied embedding (the LM head) and the norm in bfloat16, the Q4_1 matrix packed
    assert size == 2 * 3200 + 2 * 32 + round(512 * (0.5 + 4 / 32))

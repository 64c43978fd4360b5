"""Tiny random Llama models, written as GGUF and as a Hugging Face folder.

The weights come from a randomly initialised ``transformers.LlamaForCausalLM`` (so the
reference implementation is at hand) with every parameter, norms included, drawn at
random: a mis-mapped tensor cannot hide behind an all-ones init. The GGUF file is
written the way llama.cpp's ``convert_hf_to_gguf.py`` writes it (q/k rows permuted to
the adjacent-pair RoPE layout, byte-level BPE vocabulary in ``tokenizer.ggml.*``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from backends.engine.model import permute_qk_from_hf
from backends.engine.tokenizer import Tokenizer

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "a n", "e r", "Ġ i", "o n", "Ġ w"]
EOS_ID = 2  # <|im_end|>, as in SmolLM2-Instruct


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, llama.cpp token types, merges): specials, 256 bytes, merged tokens."""
    tokens = SPECIALS + list(bytes_to_unicode().values())
    tokens += ["".join(m.split(" ")) for m in MERGES]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, MERGES


def hf_model(
    *, tie: bool = False, seed: int = 0, layers: int = 2, intermediate: int = 128,
    hidden: int = 64, heads: int = 4, kv_heads: int = 2,
) -> LlamaForCausalLM:
    tokens, _, _ = vocab()
    config = LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=EOS_ID,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(1.0)
    return model


_HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_tensors(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    c = model.config
    out = {}
    for name, t in model.state_dict().items():
        w = t.detach().float()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w
        elif name == "lm_head.weight":
            if not c.tie_word_embeddings:
                out["output.weight"] = w
        else:
            _, _, i, rest = name.split(".", 3)
            if rest == "self_attn.q_proj.weight":
                w = permute_qk_from_hf(w, c.num_attention_heads)
            elif rest == "self_attn.k_proj.weight":
                w = permute_qk_from_hf(w, c.num_key_value_heads)
            out[f"blk.{i}.{_HF_TO_GGUF[rest]}"] = w
    return {k: v.numpy() for k, v in out.items()}


def write_gguf(
    model: LlamaForCausalLM,
    path: Path,
    *,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    chat_template: str | None = CHAT_TEMPLATE,
    raw: Mapping[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
    metadata: Mapping[str, float | int | str] | None = None,
) -> Path:
    """Write ``model`` as llama.cpp would; 2-D weights in ``qtype``, norms in F32.
    ``raw`` maps GGUF tensor names to ready-made bytes (uint8, ``[rows, bytes per row]``)
    and their type, written instead of the model's weights (types gguf cannot quantise).
    ``metadata``: extra keys (float32, int32 or string), e.g. ``general.sampling.temp``."""
    c = model.config
    tokens, types, merges = vocab()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(EOS_ID)
    w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, int):
            w.add_int32(key, value)
        else:
            w.add_float32(key, value)
    for name, array in _gguf_tensors(model).items():
        if raw is not None and name in raw:
            data, raw_type = raw[name]
            w.add_tensor(name, data, raw_dtype=raw_type)
        elif array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_hf(model: LlamaForCausalLM, folder: Path) -> Path:
    """save_pretrained (safetensors) plus tokenizer.json and tokenizer_config.json."""
    model.save_pretrained(folder)
    tokens, types, merges = vocab()
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
    }
    Tokenizer.from_gguf_metadata(meta).backend.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": SPECIALS[1],
        "eos_token": SPECIALS[EOS_ID],
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder

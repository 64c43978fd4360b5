"""Model families beyond Llama: what each adds, and where the loader reads it.

Every family is the Llama decoder of model.py with some of these switches on
(:class:`~backends.engine.model.ModelArgs` fields; all off is Llama):

- **Qwen2 / Qwen2.5**: biases on Q, K and V (``attention_bias``).
- **Qwen3**: an RMSNorm over each head's query and key before RoPE (``qk_norm``).
- **Mistral**: a sliding window (``sliding_windows``): a query at position ``p`` sees
  the keys at ``p - window + 1 .. p`` only, in decode, after a cached prefix and in
  prefill alike (transformers' ``kv_idx > q_idx - sliding_window``).
- **Gemma 2**: local (windowed) and global layers alternating, tanh soft-capping of the
  attention scores and of the final logits, embeddings scaled by ``sqrt(dim)`` and tied
  to the head, a norm after attention and after the MLP as well as before
  (``sandwich_norms``), GeGLU (gelu-tanh) MLP, an attention scale of
  ``query_pre_attn_scalar ** -0.5``, and Gemma's ``(1 + weight)`` RMSNorm, which the
  loader turns into a plain one by adding 1 to every norm weight of a Hugging Face
  checkpoint (llama.cpp's converter has done so in a GGUF file already).
- **Gemma 3**: Gemma 2 without soft-capping (by default), with Qwen3's QK-norm, one
  global layer in six, and another RoPE base (and scaling) for the local layers.

RoPE: our model rotates adjacent pairs. llama.cpp permutes Llama's q/k rows to that
layout when it writes a GGUF file, but not those of the NEOX-RoPE families (Qwen2,
Qwen3, Gemma): those rows, their biases and their QK-norm weights are permuted at
load time from either format, as Hugging Face Llama's are.

The native decode kernels and the straight-line decode path serve plain Llama only;
a model with any of these switches on runs the torch modules (both the batch-invariant
and the fast kernels). Tensor parallelism needs nothing new: Q/K/V biases shard with
their rows (tp.py ``_keep``), QK-norms act on one head's dimensions and are replicated,
like the other norms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from backends.engine.attention import AttentionMetadata, PrefillSpan
from backends.engine.invariant import KEY_BLOCK, KeyBlocks, rowwise

__all__ = [
    "GGUF_FAMILIES",
    "HF_FAMILIES",
    "NEOX_GGUF",
    "extended_attention",
    "gemma_attn_scale",
    "layer_windows",
    "softcap",
    "windowed_blocks",
]

# Hugging Face ``architectures`` -> family.
HF_FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its language model (text only)
}
# GGUF ``general.architecture`` values (llama.cpp writes Mistral as "llama").
GGUF_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                 "gemma3": "gemma3"}
# Families whose GGUF q/k rows are in Hugging Face's rotate-half layout.
NEOX_GGUF = {"qwen2", "qwen3", "gemma2", "gemma3"}
GEMMA = {"gemma2", "gemma3"}


def layer_windows(layer_types: list[str] | None, window: int | None, n_layers: int,
                  *, every: bool = False) -> tuple[int, ...]:
    """Per-layer windows (0: global). ``layer_types``: transformers' list of
    ``"sliding_attention"`` / ``"full_attention"``; without it ``every`` layer is
    windowed (Mistral) or none is."""
    if not window:
        return ()
    if layer_types is None:
        return (int(window),) * n_layers if every else ()
    if len(layer_types) != n_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {n_layers} layers")
    windows = tuple(int(window) if t == "sliding_attention" else 0 for t in layer_types)
    return windows if any(windows) else ()


def gemma_attn_scale(family: str, n_layers: int, dim: int, n_heads: int, head_dim: int) -> float:
    """llama.cpp's attention scale for a Gemma GGUF (which does not store
    ``query_pre_attn_scalar``): ``(dim / n_heads) ** -0.5`` for the 27B models (46 layers
    in Gemma 2, 62 in Gemma 3), else ``head_dim ** -0.5``."""
    big = (family, n_layers) in {("gemma2", 46), ("gemma3", 62)}
    return float((dim // n_heads if big else head_dim) ** -0.5)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``tanh(x / cap) * cap`` (Gemma 2's soft-capping); x unchanged for cap 0. By
    whole rows of the last dim (invariant.rowwise): tanh's vector loop and its scalar
    tail round differently, so an element's bits must not depend on where the call's
    tail or thread split falls."""
    if not cap or not x.numel():
        return x
    rows = x.reshape(-1, x.shape[-1])
    return rowwise(lambda t: torch.tanh(t / cap) * cap, rows).view(x.shape)


# ---- attention ------------------------------------------------------------------------


def extended_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    window: int,
    cap: float,
) -> torch.Tensor:
    """attention.paged_attention with an attention scale, a sliding ``window`` (0: none)
    and soft-capping of the scores (``cap``, 0: none). q: [T, H, D]; k, v: [T, Hkv, D]
    (this step's, already in the cache) -> [T, H, D]."""
    out = torch.empty_like(q)
    n = meta.num_decodes
    if n:
        out[meta.decode_rows] = _decode(q[meta.decode_rows], k_cache, v_cache, meta,
                                        scale, window, cap)
    for span in meta.prefills:
        out[span.start : span.end] = _prefill(q, k, v, k_cache, v_cache, span, scale,
                                              window, cap)
    return out


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Boolean mask: key positions a query sees (causal, within the window)."""
    ok = k_pos <= q_pos
    if window:
        ok = ok & (k_pos > q_pos - window)
    return ok


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
            scale: float, cap: float) -> torch.Tensor:
    """q: [..., Hkv, M, D]; keys, values: [..., Hkv, S, D]; allowed broadcasts to
    [..., Hkv, M, S] -> [..., Hkv, M, D] in q's dtype."""
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    if not cap:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=scale)
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale
    scores = softcap(scores, cap).masked_fill(~allowed, -torch.inf)
    return torch.matmul(torch.softmax(scores, dim=-1), values.float()).to(q.dtype)


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """cache: [NB, BS, Hkv, D]; block_table: [..., MB] -> [..., MB * BS, Hkv, D]."""
    blocks = cache.index_select(0, block_table.reshape(-1))
    return blocks.view(*block_table.shape[:-1], -1, *cache.shape[2:])


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            meta: AttentionMetadata, scale: float, window: int, cap: float) -> torch.Tensor:
    """One query per row, each at position ``context_len - 1``. q: [B, H, D]."""
    batch, n_heads, head_dim = q.shape
    n_kv = k_cache.shape[2]
    keys = _gather(k_cache, meta.decode_block_tables).transpose(1, 2)  # [B, Hkv, S, D]
    values = _gather(v_cache, meta.decode_block_tables).transpose(1, 2)
    k_pos = torch.arange(keys.shape[2], device=q.device)[None, :]  # [1, S]
    q_pos = (meta.decode_context_lens - 1)[:, None]  # [B, 1]
    allowed = _allowed(q_pos, k_pos, window)[:, None, None, :]  # [B, 1, 1, S]
    qg = q.view(batch, n_kv, n_heads // n_kv, head_dim)  # [B, Hkv, G, D]
    return _attend(qg, keys, values, allowed, scale, cap).reshape(batch, n_heads, head_dim)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, span: PrefillSpan, scale: float, window: int,
             cap: float) -> torch.Tensor:
    """One sequence's new tokens over its cached context and themselves -> [Tq, H, D]."""
    n_new = span.end - span.start
    n_heads, head_dim = q.shape[1:]
    n_kv = k_cache.shape[2]
    group = n_heads // n_kv
    if span.context_len == n_new:  # nothing cached before: this step's K/V
        ks, vs = k[span.start : span.end], v[span.start : span.end]  # [S, Hkv, D]
    else:
        ks = _gather(k_cache, span.block_table)[: span.context_len]
        vs = _gather(v_cache, span.block_table)[: span.context_len]
    first = span.context_len - n_new
    q_pos = torch.arange(n_new, device=q.device)[:, None] + first  # [Tq, 1]
    k_pos = torch.arange(span.context_len, device=q.device)[None, :]  # [1, S]
    allowed = _allowed(q_pos, k_pos, window)  # [Tq, S]
    allowed = allowed[None].expand(group, -1, -1).reshape(group * n_new, -1)  # [G Tq, S]
    # [Tq, H, D] -> [Hkv, G Tq, D]: query head h = kv * G + g
    qs = q[span.start : span.end].view(n_new, n_kv, group, head_dim).permute(1, 2, 0, 3)
    out = _attend(qs.reshape(n_kv, group * n_new, head_dim), ks.transpose(0, 1),
                  vs.transpose(0, 1), allowed, scale, cap)  # [Hkv, G Tq, D]
    return out.view(n_kv, group, n_new, head_dim).permute(2, 0, 1, 3).reshape(n_new, n_heads,
                                                                             head_dim)


def windowed_blocks(kb: KeyBlocks, window: int) -> KeyBlocks:
    """The batch-invariant kernels' key blocks (invariant.py) with each row's keys
    before its window masked too. A row's context is its unmasked prefix."""
    width = kb.num_blocks * KEY_BLOCK
    context = (~kb.masked).sum(-1, keepdim=True)  # [R, 1]
    keys = torch.arange(width, device=kb.masked.device)[None, :]
    return dataclasses.replace(kb, masked=kb.masked | (keys <= context - 1 - window))


# ---- checkpoints ----------------------------------------------------------------------

# Gemma3TextConfig's defaults: the published configs leave these out (gemma-3-4b's
# text_config has no head counts).
_GEMMA3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
}


def text_config(config: Mapping[str, Any], family: str) -> dict[str, Any]:
    """The language model's config: a multimodal Gemma 3's ``text_config``, with
    Gemma3TextConfig's defaults under what it gives."""
    if family != "gemma3":
        return dict(config)
    inner = config.get("text_config") or config
    tie = config.get("tie_word_embeddings", inner.get("tie_word_embeddings", True))
    return {**_GEMMA3_DEFAULTS, **inner, "tie_word_embeddings": tie,
            "architectures": config.get("architectures")}


def hf_text_name(name: str) -> str:
    """A multimodal checkpoint's language-model tensor name as a text model's
    (``language_model.model.X`` / ``model.language_model.X`` -> ``model.X``); vision
    tower and projector names come back unchanged (and unused)."""
    for prefix in ("language_model.model.", "model.language_model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model."):]
    return name



def hf_family_args(config: Mapping[str, Any], family: str, n_layers: int) -> dict[str, Any]:
    """The family-specific ModelArgs fields of a Hugging Face config."""
    out: dict[str, Any] = {"family": family}
    window = config.get("sliding_window")
    if family == "mistral":
        out["sliding_windows"] = layer_windows(None, window, n_layers, every=True)
    elif family in {"qwen2", "qwen3"}:
        if config.get("use_sliding_window"):  # the layers from max_window_layers on
            start = int(config.get("max_window_layers", 28))
            types = config.get("layer_types") or [
                "sliding_attention" if i >= start else "full_attention" for i in range(n_layers)]
            out["sliding_windows"] = layer_windows(types, window, n_layers)
        out["attention_bias"] = family == "qwen2" or bool(config.get("attention_bias"))
        out["qk_norm"] = family == "qwen3"
    elif family in GEMMA:
        pattern = 2 if family == "gemma2" else int(config.get("sliding_window_pattern", 6))
        types = config.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(n_layers)
        ]
        out["sliding_windows"] = layer_windows(types, window, n_layers)
        out["attn_softcap"] = float(config.get("attn_logit_softcapping") or 0.0)
        out["final_softcap"] = float(config.get("final_logit_softcapping") or 0.0)
        out["attn_scale"] = float(config.get("query_pre_attn_scalar", 256)) ** -0.5
        out["embed_scale"] = float(config["hidden_size"]) ** 0.5
        out["sandwich_norms"] = True
        out["activation"] = _activation(config.get("hidden_activation")
                                        or config.get("hidden_act") or "gelu_pytorch_tanh")
        out["qk_norm"] = family == "gemma3"
        if family == "gemma3":
            out["layer_ropes"] = _gemma3_ropes(config, types)
    return out


def _activation(name: str) -> str:
    if name in {"gelu_pytorch_tanh", "gelu_tanh"}:
        return "gelu_tanh"
    if name == "silu":
        return "silu"
    raise ValueError(f"unsupported activation {name!r}")


def _gemma3_ropes(config: Mapping[str, Any], types: list[str]) -> tuple[tuple[float, float], ...]:
    """(base, linear factor) per layer: the local layers' and the global layers'."""
    params = config.get("rope_parameters") or {}
    ropes = {}
    for kind, default in (("sliding_attention", config.get("rope_local_base_freq", 10000.0)),
                          ("full_attention", config.get("rope_theta", 1_000_000.0))):
        p = dict(params.get(kind) or {})
        if kind == "full_attention" and config.get("rope_scaling"):
            p.update(config["rope_scaling"])
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type not in {"default", "linear"}:
            raise ValueError(f"unsupported rope_scaling {p!r}")
        factor = float(p.get("factor", 1.0)) if rope_type == "linear" else 1.0
        ropes[kind] = (float(p.get("rope_theta", default)), factor)
    return tuple(ropes[t] for t in types)


def gguf_family_args(meta: Mapping[str, Any], arch: str, family: str, *, n_layers: int,
                     dim: int, n_heads: int, head_dim: int, theta: float) -> dict[str, Any]:
    """The family-specific ModelArgs fields of a GGUF file's metadata."""
    out: dict[str, Any] = {"family": family}
    window = meta.get(f"{arch}.attention.sliding_window")
    if family == "llama":  # Mistral: every layer windowed where the file says so
        out["sliding_windows"] = layer_windows(None, window, n_layers, every=True)
    elif family in {"qwen2", "qwen3"}:
        out["qk_norm"] = family == "qwen3"
    elif family in GEMMA:
        # llama.cpp's patterns: 1 global layer in 2 (Gemma 2), in 6 (Gemma 3), unless the
        # file lists them (true: windowed)
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern") or (
            2 if family == "gemma2" else 6)
        if isinstance(pattern, list):
            types = ["sliding_attention" if p else "full_attention" for p in pattern]
        else:
            types = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention"
                     for i in range(n_layers)]
        out["sliding_windows"] = layer_windows(types, window, n_layers)
        out["attn_softcap"] = float(meta.get(f"{arch}.attn_logit_softcapping") or 0.0)
        out["final_softcap"] = float(meta.get(f"{arch}.final_logit_softcapping") or 0.0)
        scale = meta.get(f"{arch}.attention.scale")  # where a file gives it
        out["attn_scale"] = float(scale) if scale else gemma_attn_scale(
            family, n_layers, dim, n_heads, head_dim)
        out["embed_scale"] = float(dim) ** 0.5
        out["sandwich_norms"] = True
        out["activation"] = "gelu_tanh"
        out["qk_norm"] = family == "gemma3"
        if family == "gemma3":
            factor = 1.0
            if meta.get(f"{arch}.rope.scaling.type") == "linear":
                factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
            out["layer_ropes"] = tuple((10000.0, 1.0) if t == "sliding_attention"
                                       else (theta, factor) for t in types)
    return out


# Hugging Face layer tensor names whose meaning differs in the Gemma families.
GEMMA_HF_LAYER_NAMES = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffn_norm.weight",
}
EXTRA_HF_LAYER_NAMES = {
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
}
EXTRA_GGUF_LAYER_NAMES = {
    "attn_q_norm.weight": "attention.q_norm.weight",
    "attn_k_norm.weight": "attention.k_norm.weight",
    "post_attention_norm.weight": "post_attention_norm.weight",
    "post_ffw_norm.weight": "post_ffn_norm.weight",
}

"""A Llama-family decoder in plain torch, gpt-fast style.

One flat batch of tokens goes through the model: ``input_ids [T]`` from any number of
sequences, ``positions [T]``, and an :class:`AttentionMetadata` that says which cache
slots they write and which blocks they read. The model knows nothing about sequences,
scheduling or parallelism: tensor parallelism is a transform applied to the built
module later (gpt-fast ``apply_tp``), which is why Q/K/V and gate/up stay separate
linears (sharded per component, never as a slice of a fused matrix).

RoPE rotates *adjacent pairs* (Meta / llama.cpp layout). GGUF q/k weights are already
in that layout; Hugging Face checkpoints are permuted once at load time
(:func:`permute_qk_from_hf`), see engines.md §8.4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from backends.engine.attention import AttentionMetadata, paged_attention, write_kv

__all__ = ["ModelArgs", "Transformer", "permute_qk_from_hf"]


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int  # SwiGLU inner size
    head_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    attention_bias: bool = False


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as transformers' LlamaRMSNorm, so float32 logits agree to ~1e-6.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cache(args: ModelArgs, device: torch.device | str | None = None) -> torch.Tensor:
    """cos/sin per position and frequency: [max_seq_len, head_dim // 2, 2] float32."""
    half = args.head_dim // 2
    inv_freq = 1.0 / (
        args.rope_theta
        ** (torch.arange(0, half, device=device, dtype=torch.int64).float() * 2 / args.head_dim)
    )
    t = torch.arange(args.max_seq_len, device=device, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)  # [S, D/2]
    return torch.stack([freqs.cos(), freqs.sin()], dim=-1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; rope: [T, D/2, 2] (already indexed by position) -> [T, H, D]."""
    xp = x.float().reshape(*x.shape[:-1], -1, 2)  # [T, H, D/2, 2]
    cos = rope[:, None, :, 0]  # [T, 1, D/2]
    sin = rope[:, None, :, 1]
    x0, x1 = xp[..., 0], xp[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1)
    return out.flatten(-2).to(x.dtype)


def permute_qk_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF "rotate_half" rows -> adjacent-pair rows (llama.cpp's convert permutation).
    w: [n_heads * head_dim, ...]."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        bias = args.attention_bias
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x: [T, dim] -> [T, dim]."""
        t = x.shape[0]
        q = apply_rope(self.wq(x).view(t, self.n_heads, self.head_dim), rope)  # q: [T, H, D]
        k = apply_rope(self.wk(x).view(t, self.n_kv_heads, self.head_dim), rope)  # k: [T, Hkv, D]
        v = self.wv(x).view(t, self.n_kv_heads, self.head_dim)  # v: [T, Hkv, D]
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out = paged_attention(q, k, v, k_cache, v_cache, meta)  # [T, H, D]
        y: torch.Tensor = self.wo(out.reshape(t, self.n_heads * self.head_dim))
        return y


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))
        return y


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, kv_cache, meta)
        y: torch.Tensor = h + self.feed_forward(self.ffn_norm(h))
        return y


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not a buffer: it must stay float32 when the weights move to bfloat16.
        self.rope = rope_cache(args, device=self.tok_embeddings.weight.device)

    def reset_rope(self) -> None:
        """Recompute the RoPE table on the weights' device (after building on ``meta``,
        or after ``.to(device)``)."""
        self.rope = rope_cache(self.args, device=self.tok_embeddings.weight.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, dim] (normed)."""
        x = self.tok_embeddings(input_ids)  # [T, dim]
        rope = self.rope[positions]  # [T, D/2, 2]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rope, kv_cache, meta)
        y: torch.Tensor = self.norm(x)
        return y

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, dim] -> float32 logits [N, V]."""
        logits: torch.Tensor = self.output(hidden)
        return logits.float()

"""A Llama-family decoder in plain torch, gpt-fast style; the other families (Qwen2,
Qwen3, Mistral, Gemma 2/3) are this decoder with the switches of families.py on.

One flat batch of tokens goes through the model: ``input_ids [T]`` from any number of
sequences, ``positions [T]``, and an :class:`AttentionMetadata` that says which cache
slots they write and which blocks they read. The model knows nothing about sequences,
scheduling or parallelism: tensor parallelism is a transform applied to the built
module later (gpt-fast ``apply_tp``), which is why Q/K/V and gate/up stay separate
linears (sharded per component, never as a slice of a fused matrix). Speed comes from
:class:`LinearGroup`, derived from those linears at run time: Q/K/V as one matmul over
a shared buffer, and on CPU in bfloat16 every linear prepacked for oneDNN. Every fast
path here gives the plain formulation's result bit for bit.

RoPE rotates *adjacent pairs* (Meta / llama.cpp layout). GGUF q/k weights are already
in that layout; Hugging Face checkpoints are permuted once at load time
(:func:`permute_qk_from_hf`), see engines.md §8.4.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from backends.engine import invariant
from backends.engine.attention import (
    AttentionMetadata,
    decode_attention,
    paged_attention,
    row_key_blocks,
    split_decodes,
    write_kv,
)
from backends.engine.dense import ensure_dense
from backends.engine.families import extended_attention, softcap, windowed_blocks
from backends.engine.native import AMX_FEW_SEQS, NativeDecode, NotApplicable
from backends.engine.quant import (
    INT4_MAX_SEQS,
    Int4Linear,
    ParamWatch,
    Q4Weight,
    attach_epoch,
    int4_supported,
    packed_row_count,
    packed_rows,
    q4_of,
)

__all__ = [
    "LinearGroup",
    "ModelArgs",
    "Transformer",
    "apply_rope",
    "permute_qk_from_hf",
    "refine_top_logits",
    "rope_cache",
    "rope_tables",
]


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
    # The switches of the other families (families.py); all off: Llama.
    family: str = "llama"
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head's q and k
    sliding_windows: tuple[int, ...] = ()  # per layer, 0: global; (): none windowed
    layer_ropes: tuple[tuple[float, float], ...] = ()  # per layer (base, linear factor)
    attn_softcap: float = 0.0  # Gemma 2: tanh soft-capping of the attention scores
    final_softcap: float = 0.0  # ... and of the logits
    attn_scale: float = 0.0  # 0: head_dim ** -0.5
    embed_scale: float = 0.0  # Gemma: embeddings times sqrt(dim); 0: none
    sandwich_norms: bool = False  # Gemma: norms after attention and after the MLP too
    activation: str = "silu"  # or "gelu_tanh" (GeGLU)

    @property
    def plain(self) -> bool:
        """Llama's layers exactly (what the native and straight-line decode paths
        serve)."""
        return not (self.attention_bias or self.qk_norm or any(self.sliding_windows)
                    or self.layer_ropes or self.attn_softcap or self.final_softcap
                    or self.attn_scale or self.embed_scale or self.sandwich_norms
                    or self.activation != "silu")

    def window(self, layer: int) -> int:
        return self.sliding_windows[layer] if self.sliding_windows else 0

    def rope_of(self, layer: int) -> tuple[float, float]:
        return self.layer_ropes[layer] if self.layer_ropes else (self.rope_theta, 1.0)


class RMSNorm(nn.Module):
    batch_invariant = False  # Transformer.set_batch_invariant: fixed row tiles

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant and x.dim() == 2:
            return invariant.rms_norm(x, self.weight, self.eps)
        # torch's fused kernel: in float32 the same result as transformers' LlamaRMSNorm
        # (x * rsqrt(mean(x^2) + eps) * weight); in bfloat16 it rounds once instead of
        # twice. A third of the time of the spelled-out seven ops on CPU.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_cache(
    args: ModelArgs, device: torch.device | str | None = None,
    rope: tuple[float, float] | None = None,
) -> torch.Tensor:
    """cos/sin per position and frequency: [max_seq_len, head_dim // 2, 2] float32.
    ``rope``: (base, linear scaling factor), by default ``(args.rope_theta, 1)``."""
    half = args.head_dim // 2
    theta, factor = rope or (args.rope_theta, 1.0)
    inv_freq = 1.0 / (
        theta
        ** (torch.arange(0, half, device=device, dtype=torch.int64).float() * 2 / args.head_dim)
    )
    if factor != 1.0:
        inv_freq = inv_freq / factor
    t = torch.arange(args.max_seq_len, device=device, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)  # [S, D/2]
    return torch.stack([freqs.cos(), freqs.sin()], dim=-1)


def rope_tables(rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rope: [T, D/2, 2] (already indexed by position) -> ``(cos, sin)``, each
    [T, 1, D/2, 2] float32: cos as pairs ``(c, c)``, sin as pairs ``(-s, s)``. Built once
    per forward pass and shared by every layer's :func:`apply_rope`."""
    cos, sin = rope[..., 0:1], rope[..., 1:2]  # [T, D/2, 1]
    return (
        torch.cat([cos, cos], dim=-1).unsqueeze(1),
        torch.cat([-sin, sin], dim=-1).unsqueeze(1),
    )


def apply_rope(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x: [T, H, D]; tables from :func:`rope_tables` -> [T, H, D].

    Each pair ``(x0, x1)`` becomes ``(x0 c - x1 s, x1 c + x0 s)``, computed as
    ``x * (c, c) + (x1, x0) * (-s, s)``: the same float32 products and sums, bit for bit
    (``a + b * -s == a - b * s``), in four ops instead of ten."""
    cos, sin = tables
    xp = x.float().reshape(*x.shape[:-1], -1, 2)  # [T, H, D/2, 2]
    out = xp * cos + xp.flip(-1) * sin
    y: torch.Tensor = out.flatten(-2).to(x.dtype)
    return y


# Up to this many rows, oneDNN's prepacked bfloat16 GEMM gives exactly F.linear's result
# (measured: torch 2.13 on AVX-512 CPUs with and without AMX, every M from 1 to 32 and
# the model's shapes); above it F.linear is kept, since there the two differ in the
# last bits.
_PACKED_MAX_ROWS = 32


def _can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # F.linear takes oneDNN too
    )


class LinearGroup:
    """Several Linears over the same input: ``group(x) == tuple(l(x) for l in linears)``,
    bit for bit (except with 4-bit codes attached, below).

    On CPU in bfloat16 the group runs as ONE oneDNN matmul over a fused weight prepacked
    once (F.linear reorders the weight on every call): at decode batch sizes that halves
    the cost of the linears. Elsewhere, with ``share_storage``, the linears' weights are
    moved into one buffer (each weight becomes a view of its rows, so no memory is added)
    and the group runs as one F.linear over it; without it each linear runs as usual
    (fusing gate/up measured no faster in float32 on CPU; fusing Q/K/V did). The
    linears stay the model's parameters, so checkpoint names, tensor-parallel sharding
    and in-place edits all see them; the fused weight is rebuilt whenever one of them
    is replaced, moved, converted or updated in place. Not a Module: it adds nothing to
    the state dict.

    With 4-bit codes attached to every linear (:func:`backends.engine.quant.attach_q4`,
    GGUF Q4_0/Q4_1 in bfloat16 on CPU), the rows that :func:`~backends.engine.quant.
    packed_row_count` names run through the packed 4-bit kernel instead: 2-3x less
    memory traffic per decode step, results within bfloat16 rounding of the dense ones,
    each row independent of the others."""

    def __init__(self, *linears: nn.Linear, share_storage: bool = False) -> None:
        self.linears = linears
        self._share = share_storage and len(linears) > 1
        self._seen: list[tuple[torch.Tensor, int, int]] = []  # (weight, data_ptr, version)
        self._packed: torch.Tensor | None = None
        self._q4: list[Q4Weight] | None = None  # 4-bit codes attached by quant.attach_q4
        self._int4: Int4Linear | None = None  # their kernel, packed at first use
        self._epoch = -1
        self._dense: torch.Tensor | None = None  # the shared buffer, rows of every weight
        self._sizes: list[int] = []

    def _stale(self, weights: list[torch.Tensor]) -> bool:
        if len(weights) != len(self._seen) or self._epoch != attach_epoch():
            return True
        for w, (seen, ptr, version) in zip(weights, self._seen, strict=True):
            if w is not seen or w.data_ptr() != ptr or _version(w) != version:
                return True
        return False

    def _refresh(self) -> None:
        weights = [lin.weight for lin in self.linears]
        if not self._stale(weights):
            return
        self._packed = self._dense = self._int4 = self._q4 = None
        plain = all(lin.bias is None for lin in self.linears)
        q4s = [q for q in (q4_of(lin) for lin in self.linears) if q is not None]
        if (
            plain
            and len(q4s) == len(weights)
            and int4_supported(weights[0])
            and Int4Linear.fits(q4s)
        ):
            # packed when a step first asks for it: where the native kernels serve the
            # decode rows, never (saves a copy of the 4-bit weights)
            self._q4 = q4s
        if plain and _can_pack(weights[0]):
            fused = torch.cat([w.detach() for w in weights])
            self._packed = torch.ops.mkldnn._reorder_linear_weight(fused, 1)
        elif plain and self._share and len({(w.dtype, w.device) for w in weights}) == 1:
            self._dense = self._share_storage(weights)
            weights = [lin.weight for lin in self.linears]
        self._sizes = [w.shape[0] for w in weights]
        self._seen = [(w, w.data_ptr(), _version(w)) for w in weights]
        self._epoch = attach_epoch()

    def _share_storage(self, weights: list[torch.Tensor]) -> torch.Tensor:
        """One buffer holding every weight's rows; each weight becomes a view into it."""
        with torch.inference_mode(False), torch.no_grad():  # a normal tensor, editable later
            fused = torch.cat([w.detach() for w in weights])
            start = 0
            for lin, w in zip(self.linears, weights, strict=True):
                lin.weight.data = fused[start : start + w.shape[0]]
                start += w.shape[0]
        return fused

    def int4(self) -> Int4Linear | None:
        """The packed 4-bit kernel of the group (after :meth:`_refresh`), where every
        linear has codes that fit it."""
        if self._int4 is None and self._q4 is not None:
            self._int4 = Int4Linear(self._q4, self.linears[0].weight.dtype)
        return self._int4

    def fused(self, x: torch.Tensor) -> torch.Tensor | None:
        """``cat(group(x), -1)`` when it is computed as one matmul, else None."""
        self._refresh()
        if self._q4 is not None and x.dim() == 2:
            n = packed_row_count(x.shape[0])
            int4 = self.int4() if n else None
            if int4 is not None and n == x.shape[0]:
                return int4(x)
            if int4 is not None:  # packed decode rows, then dense prefill rows
                rest = self._dense_fused(x[n:])
                if rest is None:
                    rest = torch.cat([F.linear(x[n:], lin.weight) for lin in self.linears], -1)
                return torch.cat([int4(x[:n]), rest])
        return self._dense_fused(x)

    def _dense_fused(self, x: torch.Tensor) -> torch.Tensor | None:
        if self._dense is not None:
            return F.linear(x, self._dense)
        if self._packed is None or x.dim() != 2 or x.shape[0] > _PACKED_MAX_ROWS:
            return None
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self._packed, None, "none", [], "")
        return y

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.fused(x)
        if y is None:
            return tuple(F.linear(x, lin.weight, lin.bias) for lin in self.linears)
        if len(self._sizes) == 1:
            return (y,)
        return tuple(torch.split_with_sizes(y, self._sizes, dim=-1))

    def tiled(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``group(x)`` with every row computed by one dense kernel on fixed tiles of
        rows (:func:`backends.engine.invariant.by_tiles`), never the 4-bit one: a row's
        result does not depend on how many rows come with it. x: [M, K]."""
        y = self.tiled_fused(x)
        if y is None:
            rows = invariant.tile_rows(x)
            return tuple(
                invariant.by_tiles(functools.partial(F.linear, weight=lin.weight, bias=lin.bias),
                                   x, rows)
                for lin in self.linears
            )
        if len(self._sizes) == 1:
            return (y,)
        return tuple(torch.split_with_sizes(y, self._sizes, dim=-1))

    def tiled_fused(self, x: torch.Tensor) -> torch.Tensor | None:
        """``cat(group.tiled(x), -1)`` where the group runs as one matmul, else None."""
        self._refresh()
        weight, kernel = (self._packed, _onednn) if self._packed is not None else (
            self._dense, F.linear)
        if weight is None:
            return None
        return invariant.by_tiles(functools.partial(kernel, weight=weight), x,
                                  invariant.tile_rows(x))


def _onednn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's matmul with a weight prepacked by ``_reorder_linear_weight``."""
    y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return y


def _version(t: torch.Tensor) -> int:
    return 0 if t.is_inference() else t._version


def permute_qk_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF "rotate_half" rows -> adjacent-pair rows (llama.cpp's convert permutation).
    w: [n_heads * head_dim, ...]."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


class Attention(nn.Module):
    batch_invariant = False  # Transformer.set_batch_invariant: invariant.py's kernels

    def __init__(self, args: ModelArgs, layer: int = 0) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        bias = args.attention_bias
        # families.py: sliding window, soft-capping, scale, QK-norm
        self.window, self.softcap = args.window(layer), args.attn_softcap
        self.scale = args.attn_scale or args.head_dim**-0.5
        self.extended = bool(self.window or self.softcap or args.attn_scale)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self._qkv = LinearGroup(self.wq, self.wk, self.wv, share_storage=True)
        self._out = LinearGroup(self.wo)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x: [T, dim] -> [T, dim]; rope: the tables of :func:`rope_tables`."""
        if self.batch_invariant:
            return self._invariant(x, rope, kv_cache, meta)
        t, h, hkv, d = x.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self._qkv.fused(x)  # [T, (H + 2 Hkv) D] or None
        if qkv is not None and not hasattr(self, "q_norm"):  # rotate q and k in one go
            qk = apply_rope(qkv[:, : (h + hkv) * d].view(t, h + hkv, d), rope)
            q, k = qk[:, :h], qk[:, h:]  # [T, H, D], [T, Hkv, D]
            v = qkv[:, (h + hkv) * d :].view(t, hkv, d)  # [T, Hkv, D]
        else:
            if qkv is not None:
                q2, k2, v2 = torch.split_with_sizes(qkv, [h * d, hkv * d, hkv * d], dim=-1)
            else:
                q2, k2, v2 = self._qkv(x)  # [T, H D], [T, Hkv D], [T, Hkv D]
            q2, k2 = self._qk_norm(q2, k2, t)
            q = apply_rope(q2.reshape(t, h, d), rope)  # [T, H, D]
            k = apply_rope(k2.reshape(t, hkv, d), rope)  # [T, Hkv, D]
            v = v2.reshape(t, hkv, d)  # [T, Hkv, D]
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        if self.extended:
            out = extended_attention(q, k, v, k_cache, v_cache, meta, scale=self.scale,
                                     window=self.window, cap=self.softcap)
        else:
            out = paged_attention(q, k, v, k_cache, v_cache, meta)  # [T, H, D]
        return self._out(out.reshape(t, h * d))[0]

    def _qk_norm(self, q: torch.Tensor, k: torch.Tensor, t: int) -> tuple[torch.Tensor, ...]:
        """Qwen3's per-head RMSNorm of q and k (before RoPE), where the model has it.
        q: [T, H D], k: [T, Hkv D]; each head's D values are one row of the norm."""
        if not hasattr(self, "q_norm"):
            return q, k
        d = self.head_dim
        return (self.q_norm(q.reshape(-1, d)).view(t, -1), self.k_norm(k.reshape(-1, d)).view(t, -1))

    def _invariant(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The same layer by batch-invariant kernels (invariant.py): tiled linears, each
        row attending on its own over fixed blocks of its keys. x: [P, dim], the step's
        T rows first (P > T: zero rows padding the residual stream to whole tiles)."""
        t, h, hkv, d = int(meta.slot_mapping.shape[0]), self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self._qkv.tiled_fused(x)  # [P, (H + 2 Hkv) D] or None
        if qkv is not None and not hasattr(self, "q_norm"):  # rotate q and k in one go
            qk = apply_rope(qkv[:t, : (h + hkv) * d].view(t, h + hkv, d), rope)
            q, k = qk[:, :h], qk[:, h:]  # [T, H, D], [T, Hkv, D]
            v = qkv[:t, (h + hkv) * d :].view(t, hkv, d)  # [T, Hkv, D]
        else:
            if qkv is not None:
                q2, k2, v2 = torch.split_with_sizes(qkv, [h * d, hkv * d, hkv * d], dim=-1)
            else:
                q2, k2, v2 = self._qkv.tiled(x)  # [P, H D], [P, Hkv D], [P, Hkv D]
            q2, k2 = self._qk_norm(q2[:t], k2[:t], t)
            q = apply_rope(q2.reshape(t, h, d), rope)
            k = apply_rope(k2.reshape(t, hkv, d), rope)
            v = v2[:t].reshape(t, hkv, d)
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        blocks = meta.key_blocks or row_key_blocks(meta, *k_cache.shape[1:3])
        if self.window:
            blocks = windowed_blocks(blocks, self.window)
        out = invariant.attention(q, k_cache, v_cache, blocks, scale=self.scale,
                                  softcap=self.softcap).reshape(t, h * d)  # [T, H D]
        if x.shape[0] > t:
            out = torch.cat([out, out.new_zeros(x.shape[0] - t, h * d)])
        return self._out.tiled(out)[0]


class FeedForward(nn.Module):
    batch_invariant = False  # Transformer.set_batch_invariant: invariant.py's kernels

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)  # down
        self._gate_up = LinearGroup(self.w1, self.w3)
        self._down = LinearGroup(self.w2)
        self._act = _geglu if args.activation == "gelu_tanh" else _swiglu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            gate, up = self._gate_up.tiled(x)
            return self._down.tiled(invariant.rowwise(self._act, gate, up))[0]
        gate, up = self._gate_up(x)
        return self._down(self._act(gate, up))[0]


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, layer)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)
        if args.sandwich_norms:  # Gemma: the sublayers' outputs are normed too
            self.post_attention_norm = RMSNorm(args.dim, args.norm_eps)
            self.post_ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if hasattr(self, "post_attention_norm"):
            h = x + self.post_attention_norm(
                self.attention(self.attention_norm(x), rope, kv_cache, meta))
            return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))  # type: ignore[no-any-return]
        h = x + self.attention(self.attention_norm(x), rope, kv_cache, meta)
        y: torch.Tensor = h + self.feed_forward(self.ffn_norm(h))
        return y


Kernel = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class _FastLayer:
    block: TransformerBlock
    qkv: Kernel  # x -> cat(q, k, v), one kernel call
    out: Kernel
    gate_up: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]  # x -> (gate, up)
    down: Kernel


class FastDecode:
    """A decode step's layers as straight-line kernel calls.

    A decode step of a small model on CPU spends about as long in Python (module
    calls, :class:`LinearGroup`'s per-call staleness checks, tensor views) as in the
    weights; this runs the very same kernels in the same order, so the result is
    bit for bit the module path's, with the per-linear bookkeeping done once per step
    (:meth:`valid`) instead of once per call. Built for one choice of rows (``int4``:
    every row runs through the 4-bit codes where a linear has them; else none does)
    and only where the layers are the plain modules, Q/K/V run as one matmul and
    nothing hooks them (tensor parallelism hooks its all-reduces onto attention and
    feed-forward)."""

    def __init__(self, model: Transformer, int4: bool) -> None:
        self.layers: list[_FastLayer] = []
        self.linears: list[nn.Linear] = []
        self.hooked: list[nn.Module] = []
        if not model.args.plain:  # families.py's switches: the modules serve
            raise _NoFastPath
        for block in model.layers:
            if type(block) is not TransformerBlock:
                raise _NoFastPath
            attn, ffn = block.attention, block.feed_forward
            if type(attn) is not Attention or type(ffn) is not FeedForward:
                raise _NoFastPath
            hooked = [block, block.attention_norm, attn, block.ffn_norm, ffn]
            if any(_has_hooks(m) for m in hooked):
                raise _NoFastPath
            groups = (attn._qkv, attn._out, ffn._gate_up, ffn._down)
            for g in groups:
                g._refresh()
            qkv = _fused_kernel(attn._qkv, int4)
            if qkv is None:  # the module path would rotate q and k apart
                raise _NoFastPath
            self.layers.append(_FastLayer(
                block, qkv, _single(attn._out, int4), _split(ffn._gate_up, int4),
                _single(ffn._down, int4),
            ))
            self.linears += [lin for g in groups for lin in g.linears]
            self.hooked += hooked
        self.watch = ParamWatch(self.linears, self.hooked)

    def valid(self) -> bool:
        """Every weight still the one the kernels were built from, nothing hooked."""
        return self.watch.unchanged()

    def __call__(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """What ``for layer in layers: x = layer(x, rope, kv, meta)`` computes for a
        decode-only step."""
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            block = layer.block
            attn = block.attention
            t, h, hkv, d = x.shape[0], attn.n_heads, attn.n_kv_heads, attn.head_dim
            norm = block.attention_norm
            qkv = layer.qkv(F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps))
            qk = apply_rope(qkv[:, : (h + hkv) * d].view(t, h + hkv, d), rope)
            q, k = qk[:, :h], qk[:, h:]
            v = qkv[:, (h + hkv) * d :].view(t, hkv, d)
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            out = decode_attention(q, k_cache, v_cache, meta)
            x = x + layer.out(out.reshape(t, h * d))
            norm = block.ffn_norm
            gate, up = layer.gate_up(F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps))
            x = x + layer.down(F.silu(gate) * up)
        return x


_Layers = Callable[
    [torch.Tensor, tuple[torch.Tensor, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]],
     AttentionMetadata],
    torch.Tensor,
]


class _NoFastPath(Exception):
    pass


def _fused_kernel(group: LinearGroup, int4: bool) -> Kernel | None:
    """The one call that computes ``cat(group(x), -1)`` as :meth:`LinearGroup.fused`
    does for a step whose rows are all packed (``int4``) or none are (at most 32 rows),
    or None where the group runs its linears one by one (LinearGroup only fuses
    bias-free linears)."""
    kernel = group.int4() if int4 else None
    if kernel is not None:
        return kernel
    dense, packed = group._dense, group._packed
    if dense is not None:
        return functools.partial(F.linear, weight=dense)
    if packed is None:
        return None

    def onednn(x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return y

    return onednn


def _single(group: LinearGroup, int4: bool) -> Kernel:
    """A one-linear group, as its ``group(x)[0]``."""
    fused = _fused_kernel(group, int4)
    if fused is not None:
        return fused
    (linear,) = group.linears
    if linear.bias is not None:
        raise _NoFastPath
    return functools.partial(F.linear, weight=linear.weight)


def _split(group: LinearGroup, int4: bool) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    """``group(x)``: one fused call then a split, or each linear on its own."""
    fused = _fused_kernel(group, int4)
    if fused is not None:
        sizes = list(group._sizes)
        return lambda x: torch.split_with_sizes(fused(x), sizes, dim=-1)
    if any(linear.bias is not None for linear in group.linears):
        raise _NoFastPath
    weights = [linear.weight for linear in group.linears]
    return lambda x: tuple(F.linear(x, w) for w in weights)


def _has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _embedding(vocab_size: int, dim: int) -> nn.Embedding:
    """``nn.Embedding(vocab_size, dim)``, the same draw from the same generator, except
    that on ``meta`` (the loader's build, weights assigned next) nothing is drawn: torch's
    ``normal_`` on a meta tensor runs a Python decomposition that imports torch._dynamo
    (1.4 s of CPU; see also reset_rope)."""
    weight = torch.empty(vocab_size, dim)  # [V, D], on the default (or context) device
    if not weight.is_meta:
        nn.init.normal_(weight)  # nn.Embedding.reset_parameters (no padding_idx)
    embedding: nn.Embedding = nn.Embedding.from_pretrained(  # type: ignore[no-untyped-call]
        weight, freeze=False
    )
    return embedding


class Transformer(nn.Module):
    # Every token by batch-invariant kernels (invariant.py); set with set_batch_invariant.
    batch_invariant = False

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = _embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not a buffer: it must stay float32 when the weights move to bfloat16.
        self.reset_rope()

    def set_batch_invariant(self, on: bool) -> None:
        """Compute every token with batch-invariant kernels (or not), in every module
        that has a choice: a token's result is then the same whatever the step holds,
        provided each step's metadata gives each token its own query row (the runner's
        ``batch_invariant``; a prefill span here is split into such rows)."""
        for module in self.modules():
            if isinstance(module, (Transformer, RMSNorm, Attention, FeedForward)):
                module.batch_invariant = on

    def reset_rope(self) -> None:
        """Recompute the RoPE table on the weights' device (after building on ``meta``,
        or after ``.to(device)``)."""
        device = self.tok_embeddings.weight.device
        # On meta the tables are computed on the CPU and moved there (shapes only): torch's
        # meta kernels of some of these ops are Python decompositions that import
        # torch._dynamo (1.4 s of CPU, which no load needs; see _embedding).
        at = torch.device("cpu") if device.type == "meta" else device
        self.rope = rope_cache(self.args, device=at).to(device)
        # Gemma 3: other RoPE bases per layer (the table of each distinct one)
        self.layer_ropes = {
            r: rope_cache(self.args, at, r).to(device) for r in set(self.args.layer_ropes)
        }

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x: torch.Tensor = self.tok_embeddings(input_ids)  # [T, dim]
        if self.args.embed_scale:  # Gemma: rounded to the weights' dtype, as transformers
            x = x * torch.tensor(self.args.embed_scale, dtype=x.dtype, device=x.device)
        return x

    def _layer_ropes(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's RoPE tables for ``positions`` (one per distinct base)."""
        tables = {r: rope_tables(t[positions]) for r, t in self.layer_ropes.items()}
        return [tables[self.args.rope_of(i)] for i in range(len(self.layers))]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, dim] (normed)."""
        if self.batch_invariant:
            return self._invariant_forward(input_ids, positions, kv_caches, meta)
        n = meta.num_decodes
        if meta.prefills and n and self.native_plan() is not None:
            # The decode rows go through the native kernels, the prefill rows through
            # torch, as two passes: a decode token is then computed the same way
            # whether or not the step also prefills.
            packed = n if packed_row_count(int(input_ids.shape[0])) == n else 0
            decode, prefill = split_decodes(meta)
            with packed_rows(packed):
                head = self(input_ids[:n], positions[:n], kv_caches, decode)
            with packed_rows(0):
                tail = self(input_ids[n:], positions[n:], kv_caches, prefill)
            return torch.cat([head, tail])
        x = self._embed(input_ids)  # [T, dim]
        rope = rope_tables(self.rope[positions])  # 2 x [T, 1, D/2, 2]
        fast = self._fast_decode(x.shape[0], meta)
        if fast is not None:
            x = fast(x, rope, kv_caches, meta)
        else:
            ensure_dense(self)  # the modules read the dense weights (dense.py)
            ropes = self._layer_ropes(positions) if self.layer_ropes else [rope] * len(kv_caches)
            for layer, kv_cache, r in zip(self.layers, kv_caches, ropes, strict=True):
                x = layer(x, r, kv_cache, meta)
        y: torch.Tensor = self.norm(x)
        return y

    def _invariant_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The batch-invariant forward pass: a step of decode rows only goes through the
        native kernels' batched matmul where they apply (each row on its own there),
        anything else through the modules' invariant kernels."""
        x = self._embed(input_ids)  # [T, dim]
        rope = rope_tables(self.rope[positions])  # 2 x [T, 1, D/2, 2]
        rows = int(input_ids.shape[0])
        native = self.native_plan() if not meta.prefills and meta.num_decodes == rows else None
        if native is not None:
            x = native(x, rope, kv_caches, meta, batched=True)
        else:
            ensure_dense(self)  # the modules read the dense weights (dense.py)
            if meta.key_blocks is None:  # once for every layer
                blocks = row_key_blocks(meta, *kv_caches[0][0].shape[1:3])
                meta = dataclasses.replace(meta, key_blocks=blocks)
            pad = -rows % invariant.tile_rows(x)  # whole tiles, padded once
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x
            ropes = self._layer_ropes(positions) if self.layer_ropes else [rope] * len(kv_caches)
            for layer, kv_cache, r in zip(self.layers, kv_caches, ropes, strict=True):
                x = layer(x, r, kv_cache, meta)
            return self.norm(x)[:rows]  # type: ignore[no-any-return]
        y: torch.Tensor = self.norm(x)
        return y

    # Decode steps take :class:`FastDecode` where it applies (off: the module path).
    fast_decode = True
    # Packed decode steps take :class:`backends.engine.native.NativeDecode` where it
    # applies (off: FastDecode's torch kernels).
    native_decode = True

    def native_plan(self) -> NativeDecode | None:
        """The native decode layers, where this model and machine can take them."""
        if not (self.fast_decode and self.native_decode and self.args.plain):
            return None
        cache: dict[object, object] = self.__dict__.setdefault("_fast", {})
        plan = cache.get("native")
        if isinstance(plan, NativeDecode) and plan.valid():
            return plan
        if plan is False and cache.get("native_epoch") == attach_epoch():
            return None  # known not to apply, and no codes attached since
        try:
            plan = cache["native"] = NativeDecode(self)
        except NotApplicable:
            cache["native"], cache["native_epoch"] = False, attach_epoch()
            return None
        return plan

    def packed_seq_limit(self, plan: NativeDecode | bool | None = True) -> int:
        """Steps with at most this many decoding sequences run their decode rows
        "packed" (the runner's choice, quant.packed_rows): through the few-row kernels,
        native or torch's int4 one. With AMX the native batched kernel is faster from 3
        sequences on; else the few-row kernels are, up to INT4_MAX_SEQS. ``plan``: the
        step's :meth:`native_plan` where the caller has it (``True``: look it up)."""
        native = self.native_plan() if plan is True else plan
        return AMX_FEW_SEQS if isinstance(native, NativeDecode) and native.amx else INT4_MAX_SEQS

    def _fast_decode(self, rows: int, meta: AttentionMetadata) -> _Layers | None:
        """The straight-line layers for this step, when it is decode-only and every
        row takes one kernel kind that every linear has."""
        if not self.fast_decode or meta.prefills or meta.num_decodes != rows:
            return None
        packed = packed_row_count(rows)
        native = self.native_plan()
        if native is not None:  # the runner's packed rows are "a few sequences"
            if packed not in (rows, 0):
                return None
            return functools.partial(native, batched=packed == 0)
        if packed == rows:
            int4 = True
        elif packed == 0 and rows <= _PACKED_MAX_ROWS:
            int4 = False
        else:
            return None
        ensure_dense(self)  # FastDecode reads the dense weights (dense.py)
        cache: dict[object, FastDecode] = self.__dict__.setdefault("_fast", {})
        plan = cache.get(int4)
        if plan is None or not plan.valid():
            try:  # cheap when it does not apply: the first layer tells
                plan = cache[int4] = FastDecode(self, int4)
            except _NoFastPath:
                cache.pop(int4, None)
                return None
        return plan

    def compute_logits(
        self, hidden: torch.Tensor, native: tuple[NativeDecode, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """hidden: [N, dim] -> float32 logits [N, V]. ``native``: the plan of a
        few-sequence native step and a boolean [N] of its rows, whose logits the native
        head computes (float32 sums, no bfloat16 rounding), the same way whatever else
        the step holds. Gemma 2's logits are soft-capped (families.py)."""
        return softcap(self._head_logits(hidden, native), self.args.final_softcap)

    def _head_logits(
        self, hidden: torch.Tensor, native: tuple[NativeDecode, torch.Tensor] | None = None
    ) -> torch.Tensor:
        head = self.output
        if type(head) is not nn.Linear:  # tensor parallel: a vocab-parallel head
            if self.batch_invariant:  # every rank sees the same rows: the same tiles
                return invariant.by_tiles(lambda t: head(t).float(), hidden,
                                          invariant.tile_rows(hidden))
            return head(hidden).float()  # type: ignore[no-any-return]
        if native is not None and bool(native[1].any()):
            plan, native_rows = native
            if bool(native_rows.all()):
                out = plan.head(hidden, head.weight)
                if out is not None:
                    return out
            else:
                fast = plan.head(hidden[native_rows], head.weight)
                if fast is not None:
                    logits = torch.empty(hidden.shape[0], fast.shape[1], dtype=torch.float32)
                    logits[native_rows] = fast
                    logits[~native_rows] = self._head_logits(hidden[~native_rows])
                    return logits
        group: LinearGroup | None = self.__dict__.get("_head")
        if group is None or group.linears[0] is not head:
            group = self.__dict__["_head"] = LinearGroup(head)
        logits = (group.tiled(hidden) if self.batch_invariant else group(hidden))[0].float()
        if hidden.dtype != torch.float32 and logits.shape[0]:
            refine_top_logits(logits, hidden, head.weight)
        return logits


def refine_top_logits(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> None:
    """Recompute, in float32, every logit within one bfloat16 step of its row's maximum.

    A bfloat16 head rounds its outputs to 8 bits of mantissa: around a logit of 25 the
    step is 0.125, so tokens a few hundredths apart come out tied and greedy decoding
    picks by token id. SmolLM2 in bfloat16 then answers "What is the capital of France?"
    with "L'Étoile..." instead of "The capital of France is Paris": "The" and "L" are
    25.31 and 25.30 accumulated in float32, both 25.25 rounded. Rounding moves a logit by
    at most half a step, so the true maximum is always among the tokens within one step
    of the rounded maximum; re-scoring those (usually a handful) from the same bfloat16
    weights and hidden state, accumulated and kept in float32, ranks the top as a
    float32-output head would, for a few dozen microseconds per row. Row by row, so a
    row's result does not depend on the others. In place on ``logits`` [N, V] float32;
    ``hidden`` [N, dim] and ``weight`` [V, dim] in the serving dtype."""
    top = logits.amax(-1, keepdim=True)  # [N, 1]
    # One step of bfloat16 at the maximum: 2 ** (e - 7) for |max| in [2 ** e, 2 ** (e + 1)),
    # by frexp, exactly (log2 rounds: a maximum just under a power of two could get the
    # step above it).
    exponent = torch.frexp(top.abs().clamp_min(1e-30)).exponent  # |max| in [2 ** (x-1), 2 ** x)
    step = torch.ldexp(torch.ones_like(top), exponent - 8)
    rows, cols = torch.nonzero(logits >= top - step, as_tuple=True)
    exact = (weight[cols].float() * hidden[rows].float()).sum(-1)
    logits[rows, cols] = exact

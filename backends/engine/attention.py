"""Paged attention in plain torch: no custom kernels, so it runs on CPU and CUDA alike.

The KV cache of one layer is two tensors ``[num_blocks, block_size, n_kv_heads, head_dim]``.
A token at absolute position ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``; the runner computes
those slots (``slot_mapping``) and the model writes new K/V through them.

Reading is a gather of each sequence's blocks. Decode rows (one query each, over the
cache up to its own position) are attended in ONE batched, masked matmul: that is where
batching pays on CPU. The runner makes every decode token a decode row, and so every
token of a short span after a cached context (speculative drafts), since all of the
step's K/V is written before attention reads it. Longer spans (prefill chunks) are
attended one by one with ``scaled_dot_product_attention``; a prefill that starts at
position 0 attends to its own fresh K/V without touching the cache at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backends.engine.invariant import KeyBlocks, key_blocks

__all__ = [
    "AttentionMetadata",
    "PrefillSpan",
    "decode_attention",
    "paged_attention",
    "row_key_blocks",
    "split_decodes",
    "write_kv",
]


@dataclass(frozen=True)
class PrefillSpan:
    """A sequence adding ``end - start`` tokens this step, at positions
    ``context_len - (end - start) .. context_len - 1``."""

    start: int  # first row in the flat token batch
    end: int
    context_len: int  # tokens in the cache after this step (computed + new)
    block_table: torch.Tensor  # [num_blocks_of_seq] int64


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each new token goes and what each sequence attends to. Built by the runner,
    shared by every layer of one forward pass."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    decode_rows: torch.Tensor  # [B] int64: rows of the flat batch that are decode rows
    decode_block_tables: torch.Tensor  # [B, max_blocks] int64 (padded with 0)
    decode_context_lens: torch.Tensor  # [B] int64: tokens in cache incl. the new one
    # [B, 1, 1, max_blocks * block_size] in the model's dtype: 0 within the context,
    # -inf past it (a boolean True-within mask works too)
    decode_mask: torch.Tensor
    prefills: tuple[PrefillSpan, ...]
    num_decode_seqs: int = 0  # sequences the decode rows belong to
    # Decode rows [start, end) that are one sequence's consecutive tokens (the runner's
    # batch-invariant layout makes every token a decode row): their keys are read once.
    spans: tuple[tuple[int, int], ...] = ()
    # The batch-invariant kernels' key blocks of every row (invariant.py): derived once
    # per forward pass by the model (row_key_blocks) and shared by every layer.
    key_blocks: KeyBlocks | None = None

    @property
    def num_decodes(self) -> int:
        return int(self.decode_rows.shape[0])


def split_decodes(meta: AttentionMetadata) -> tuple[AttentionMetadata, AttentionMetadata]:
    """A mixed step's metadata as (its decode rows alone, its prefill rows alone), rows
    renumbered from 0 in each (the decode rows are the leading ones)."""
    n = meta.num_decodes
    decode = AttentionMetadata(
        slot_mapping=meta.slot_mapping[:n],
        decode_rows=meta.decode_rows,
        decode_block_tables=meta.decode_block_tables,
        decode_context_lens=meta.decode_context_lens,
        decode_mask=meta.decode_mask,
        prefills=(),
        num_decode_seqs=meta.num_decode_seqs,
    )
    empty = meta.decode_rows[:0]
    prefill = AttentionMetadata(
        slot_mapping=meta.slot_mapping[n:],
        decode_rows=empty,
        decode_block_tables=meta.decode_block_tables[:0],
        decode_context_lens=empty,
        decode_mask=meta.decode_mask[:0],
        prefills=tuple(
            PrefillSpan(s.start - n, s.end - n, s.context_len, s.block_table)
            for s in meta.prefills
        ),
        num_decode_seqs=0,
    )
    return decode, prefill


def row_key_blocks(meta: AttentionMetadata, block_size: int, n_kv: int) -> KeyBlocks:
    """Every row's key blocks: a decode row's over its own table and context, the rows
    of a prefill span over the span's table, each up to its own position."""
    rows = int(meta.slot_mapping.shape[0])
    dev = meta.slot_mapping.device
    in_order = torch.equal(meta.decode_rows, torch.arange(rows, device=dev))
    if not meta.prefills and in_order:  # the runner's layout: decode rows only, in order
        return key_blocks(
            meta.decode_block_tables, meta.decode_context_lens, block_size, n_kv, meta.spans
        )
    width = max(
        [int(meta.decode_block_tables.shape[1])] + [int(s.block_table.shape[0]) for s in meta.prefills]
    )
    tables = torch.zeros(rows, width, dtype=torch.int64, device=dev)
    lens = torch.ones(rows, dtype=torch.int64, device=dev)
    n = meta.num_decodes
    if n:
        tables[meta.decode_rows, : meta.decode_block_tables.shape[1]] = meta.decode_block_tables
        lens[meta.decode_rows] = meta.decode_context_lens
    for span in meta.prefills:
        n_new = span.end - span.start
        tables[span.start : span.end, : span.block_table.shape[0]] = span.block_table
        first = span.context_len - n_new + 1
        lens[span.start : span.end] = torch.arange(first, span.context_len + 1, device=dev)
    spans = meta.spans + tuple((s.start, s.end) for s in meta.prefills if s.end - s.start > 1)
    return key_blocks(tables, lens, block_size, n_kv, spans)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Store new keys/values: k, v: [T, Hkv, D]; caches: [NB, BS, Hkv, D]; slots: [T]."""
    n_kv, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, n_kv, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, n_kv, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Attention of the new tokens over their sequences' cached context.

    q: [T, H, D]; k, v: [T, Hkv, D] (this step's, already written to the cache);
    returns [T, H, D]."""
    if not meta.prefills and meta.num_decodes == q.shape[0]:
        # Decode only: the runner lays decode rows out in order, so they are all the rows.
        return decode_attention(q, k_cache, v_cache, meta)
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[meta.decode_rows] = decode_attention(q[meta.decode_rows], k_cache, v_cache, meta)
    for span in meta.prefills:
        out[span.start : span.end] = _prefill_attention(q, k, v, k_cache, v_cache, span)
    return out


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """cache: [NB, BS, Hkv, D]; block_table: [..., MB] -> [..., MB * BS, Hkv, D]."""
    blocks = cache.index_select(0, block_table.reshape(-1))  # [(...) * MB, BS, Hkv, D]
    return blocks.view(*block_table.shape[:-1], -1, *cache.shape[2:])


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """One query per row, all rows at once. q: [B, H, D] -> [B, H, D].

    The query heads of a KV group share that group's keys (GQA without repeating K/V).
    One fused SDPA call (float32 softmax inside): 2-3x faster on CPU than the same math
    spelled out in bfloat16. A row's result does not depend on the padding that the
    other rows of the batch add (masked keys add exact zeros)."""
    batch, n_heads, head_dim = q.shape
    n_kv = k_cache.shape[2]
    keys = _gather(k_cache, meta.decode_block_tables).transpose(1, 2)  # [B, Hkv, S, D]
    values = _gather(v_cache, meta.decode_block_tables).transpose(1, 2)  # [B, Hkv, S, D]
    qg = q.view(batch, n_kv, n_heads // n_kv, head_dim)  # [B, Hkv, G, D]
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=meta.decode_mask)
    return out.reshape(batch, n_heads, head_dim)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    span: PrefillSpan,
) -> torch.Tensor:
    """Causal attention for one sequence's new tokens -> [Tq, H, D]."""
    n_new = span.end - span.start
    qs = q[span.start : span.end].transpose(0, 1)  # [H, Tq, D]
    if span.context_len == n_new:
        # Nothing cached before this chunk: attend to the fresh K/V, plain causal.
        ks = k[span.start : span.end].transpose(0, 1)  # [Hkv, Tq, D]
        vs = v[span.start : span.end].transpose(0, 1)
        out = F.scaled_dot_product_attention(
            qs, ks.to(qs.dtype), vs.to(qs.dtype), is_causal=True, enable_gqa=True
        )
        return out.transpose(0, 1)
    ks = _gather(k_cache, span.block_table)[: span.context_len].transpose(0, 1)  # [Hkv, S, D]
    vs = _gather(v_cache, span.block_table)[: span.context_len].transpose(0, 1)
    first = span.context_len - n_new  # absolute position of the first new token
    rows = torch.arange(n_new, device=q.device)[:, None] + first  # [Tq, 1]
    cols = torch.arange(span.context_len, device=q.device)[None, :]  # [1, S]
    mask = cols <= rows  # [Tq, S]
    out = F.scaled_dot_product_attention(
        qs, ks.to(qs.dtype), vs.to(qs.dtype), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(0, 1)

"""Batch-invariant kernels: a token's numbers depend on the token, never on the step.

Stream migration resumes a request on another replica, with another batch and another
prefix-cache state, and expects the same tokens; so must a request whose prompt is the
original prompt plus the first ``k`` tokens it produced. That holds only if every token
is computed by the same arithmetic, in the same order, whether it is decoded alone,
decoded among 31 others, prefilled in one 512-token chunk, prefilled after a cached
prefix, or prefilled a few tokens at a time. Stock kernels do not promise that: they pick
their blocking, the split of a reduction and even their algorithm by shape. Measured
here (torch 2.13, MKL 2024.2, oneDNN 3.12, a Xeon with AMX): MKL's float32 GEMM gives a
row other last bits at M = 1, 2-3, 4-15 and 16+ (a 960 x 576 weight); oneDNN's float32
matmul gives every M from 2 to 600 other bits than M = 1; SDPA's flash kernel picks its
query blocks by the query count; the int4 kernel serves some steps' rows and not others.

So every reduction here runs in a call whose shape is a constant of the model, and the
engine's runner (runner.py, ``batch_invariant``) makes every token a query row of its own:

- **Linears** (:func:`by_tiles`): the rows are cut into tiles of :func:`tile_rows` rows,
  zero rows padding the last; each tile is one GEMM call of one shape, with one kernel
  (the dense weights, never the 4-bit codes, whose kernel is chosen by row count). A GEMM
  computes an output row from that input row alone, so a row's result depends on its
  data and on the (fixed) shape; tests/engine_invariance checks that its place in the
  tile does not matter either, for the kernels and shapes the engine uses.
- **RMSNorm**: torch's fused kernel on the same tiles (a row is reduced on its own).
- **SiLU** (:func:`rowwise`): its vectorised loop and its scalar tail give different
  last bits (float32: one element in 25, measured), and a multi-threaded call puts
  tails where the thread split falls. ``rowwise`` calls it on pieces of whole rows that stay
  under torch's one-thread size and end on a vector boundary: every element takes the
  vector code. Additions, products, divisions and dtype casts round exactly (IEEE) in
  any code path, so RoPE and the residual stream need nothing.
- **Attention** (:func:`attention`): each query row reads its own sequence's keys in
  blocks of :data:`KEY_BLOCK`. Scores are batched matmuls of one shape, ``[KEY_BLOCK, D]
  x [D, G]`` per (row, KV head, block); the softmax runs over the row's blocks with the
  keys past its position at ``-inf`` (torch's last-dim softmax reduces each row on its
  own, and ``-inf`` keys add exact zeros to its vector lanes, so the padding a batch adds
  changes nothing); values are ``[G, KEY_BLOCK] x [KEY_BLOCK, D]`` per block, and the
  blocks are summed by a pairwise tree over a power-of-two count, zero-padded, which
  gives the same sum however far it is padded. All of it in float32, rounded to the
  model's dtype once at the end.

The native decode kernels (native_decode.c) compute each row on its own by
construction, but the few-row kernel (integer dot products) and the batched one (AMX or
bfloat16 dot products) round differently, and prefill rows used to go through torch: in
invariant mode every row of every step, prefill rows included, goes through the batched
one, and the logits through the native float32 head.

The faster kernels chosen by batch size stay behind ``EngineConfig.batch_invariant =
False``; what invariance costs against them is measured in the commit that brought it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "KEY_BLOCK",
    "KeyBlocks",
    "attention",
    "by_tiles",
    "key_blocks",
    "rms_norm",
    "rowwise",
    "tile_rows",
]

# Keys per attention block: the matmuls' fixed width.
KEY_BLOCK = 64
# torch runs an elementwise op on one thread below this many elements (GRAIN_SIZE).
_SERIAL = 32768
# Elements per step of torch's vectorised loops (2 vectors of 32 bfloat16 on AVX-512).
_VECTOR = 64
# 64-byte alignment: GEMM libraries may take another code path for unaligned rows.
_ALIGN = 64

Tensor = torch.Tensor


def tile_rows(x: Tensor) -> int:
    """Rows per GEMM tile for inputs like ``x``: any fixed count is invariant, this one
    is chosen for speed. On a CPU 16: a decode step of SmolLM2 in bfloat16 spends 50 ms
    in its tiled linears at 16 rows and 92 ms at 64 (one core of a Xeon with AMX;
    oneDNN's one-row call costs about what its 16-row one does), and MKL's float32 GEMM
    costs 2.5x its one-row price at 8 rows and about the same at 16. Elsewhere (CUDA)
    64."""
    return 16 if x.device.type == "cpu" else 64


def by_tiles(fn: Callable[[Tensor], Tensor], x: Tensor, rows: int) -> Tensor:
    """``fn(x)`` for a row-wise ``fn`` (a linear), computed one fixed ``[rows, ...]``
    tile at a time, the last one padded with zero rows. x: [M, K] -> [M, N]."""
    m = x.shape[0]
    pad = -m % rows
    x = x.contiguous()
    if pad or x.data_ptr() % _ALIGN:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])  # a fresh, aligned tensor
    if x.shape[0] <= rows:  # one tile (or none)
        return fn(x)[:m]
    return torch.cat([fn(tile) for tile in torch.split(x, rows)])[:m]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``F.rms_norm`` over the last dim, on fixed tiles of rows. x: [M, dim]."""
    return by_tiles(lambda t: F.rms_norm(t, (t.shape[-1],), weight, eps), x, tile_rows(x))


def rowwise(fn: Callable[..., Tensor], *xs: Tensor) -> Tensor:
    """``fn(*xs)`` for an elementwise ``fn`` of [M, W] tensors, called on pieces of whole
    rows that torch runs on one thread and that end on a vector boundary (one row at a
    time where W is not a multiple of the vector step), so every element takes the same
    vectorised code whatever M is and wherever its row sits."""
    rows, width = xs[0].shape
    per = 1 if width % _VECTOR else max(1, (_SERIAL - 1) // width)
    if rows <= per:
        return fn(*xs)
    return torch.cat([fn(*parts) for parts in zip(*(torch.split(x, per) for x in xs), strict=True)])


@dataclass(frozen=True)
class Span:
    """Rows ``start .. end - 1``: one sequence's tokens at consecutive positions from
    ``first``, reading the same keys, which are gathered once for all of them."""

    start: int
    end: int
    first: int
    num_blocks: int
    index: Tensor  # [Hkv * blocks * KEY_BLOCK] int64: rows of the cache as [slots * Hkv, D]


@dataclass(frozen=True)
class KeyBlocks:
    """The blocks of keys each query row reads: built once per forward pass and shared
    by every layer. Rows in a :class:`Span` read their sequence's blocks in place; the
    others (decode rows) as (row, block) entries with their keys gathered."""

    num_rows: int
    num_blocks: int  # the most blocks a row reads in this step
    tree: int  # a power of two >= num_blocks: the width of the summing tree
    entry_row: Tensor  # [E] int64
    entry_block: Tensor  # [E] int64: block index within its row
    index: Tensor  # [E * Hkv * KEY_BLOCK] int64: rows of the cache as [slots * Hkv, D]
    spans: tuple[Span, ...]
    masked: Tensor  # [R, num_blocks * KEY_BLOCK] bool: key at or past the row's context


def key_blocks(
    tables: Tensor,
    context_lens: Tensor,
    block_size: int,
    n_kv: int,
    spans: tuple[tuple[int, int], ...] = (),
) -> KeyBlocks:
    """tables: [R, W] int64 KV block ids of each row's sequence (padded); context_lens:
    [R] int64, the keys each row attends to (its own token included); ``n_kv`` KV heads;
    spans: row ranges ``(start, end)`` that are one sequence's consecutive tokens."""
    dev = tables.device
    rows = int(tables.shape[0])
    blocks = -(-context_lens // KEY_BLOCK)  # [R]
    most = int(blocks.max()) if rows else 0
    alone = torch.ones(rows, dtype=torch.bool, device=dev)
    for start, end in spans:
        alone[start:end] = False
    grid = torch.arange(most, device=dev)[None, :] < blocks[:, None]  # [R, most]
    row, block = (grid & alone[:, None]).nonzero(as_tuple=True)
    width = max(int(tables.shape[1]), 1)

    def slots_of(table: Tensor, pos: Tensor, length: Tensor) -> Tensor:
        """Cache slots of positions ``pos`` by ``table`` ([..., W], broadcast), 0 from
        ``length`` on."""
        ids = table.gather(-1, (pos // block_size).clamp(max=width - 1))
        return torch.where(pos < length, ids * block_size + pos % block_size, 0)

    heads = torch.arange(n_kv, device=dev)

    def rows_of(slots: Tensor, heads_first: bool) -> Tensor:
        """slots [N, B] -> the rows of the cache viewed as [slots * Hkv, D] that hold
        each KV head's key there, ordered (Hkv, N, B) or (N, Hkv, B)."""
        if heads_first:
            return (slots[None] * n_kv + heads[:, None, None]).reshape(-1)
        return (slots[:, None] * n_kv + heads[None, :, None]).reshape(-1)

    pos = block[:, None] * KEY_BLOCK + torch.arange(KEY_BLOCK, device=dev)  # [E, B]
    index = rows_of(slots_of(tables[row], pos, context_lens[row][:, None]), False)
    groups = []
    for start, end in spans:
        last = int(context_lens[end - 1])
        n = -(-last // KEY_BLOCK)
        grid = torch.arange(n * KEY_BLOCK, device=dev).view(n, KEY_BLOCK)
        table = tables[end - 1].expand(n, width)
        slots = slots_of(table, grid, torch.tensor(last, device=dev))  # [blocks, B]
        first = int(context_lens[start]) - 1
        groups.append(Span(start, end, first, n, rows_of(slots, True)))
    keys = torch.arange(most * KEY_BLOCK, device=dev)
    return KeyBlocks(
        num_rows=rows,
        num_blocks=most,
        tree=1 << max(most - 1, 0).bit_length(),
        entry_row=row,
        entry_block=block,
        index=index,
        spans=tuple(groups),
        masked=keys[None, :] >= context_lens[:, None],
    )


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, kb: KeyBlocks, *,
              scale: float | None = None, softcap: float = 0.0) -> Tensor:
    """Each query row over its own keys. q: [R, H, D]; caches: [NB, BS, Hkv, D] (this
    step's K/V already written); returns [R, H, D] in q's dtype.

    Every product goes through one batched matmul of one shape and layout per (row, KV
    head, key block), all float32: ``[B, D] x [D, G]`` for the scores (keys times the
    group's queries) and ``[G, B] x [B, D]`` for the values; the keys are gathered per
    entry for lone rows, and read in place, one block broadcast over the rows that
    reach it, for a span. ``scale``: of the scores (default ``D ** -0.5``); ``softcap``:
    Gemma 2's ``tanh(s / cap) * cap`` of the scaled scores (0: none)."""
    rows, n_heads, head_dim = q.shape
    n_kv = k_cache.shape[2]
    group, width, blocks = n_heads // n_kv, KEY_BLOCK, kb.num_blocks
    scale = head_dim**-0.5 if scale is None else scale
    # [slots * Hkv, D]: row slot * Hkv + h is head h's key (value) at that slot
    keys_of, values_of = k_cache.view(-1, head_dim), v_cache.view(-1, head_dim)
    qt = _float32(q.view(rows, n_kv, group, head_dim).transpose(-1, -2))  # [R, Hkv, D, G]
    full = qt.new_full((rows, n_kv, group, blocks, width), -torch.inf)  # the scores
    er, ej, n = kb.entry_row, kb.entry_block, int(kb.entry_row.shape[0])
    if n:
        keys = _rows(keys_of, kb.index).view(n * n_kv, width, head_dim)
        scores = torch.bmm(keys, qt[er].view(n * n_kv, head_dim, group))  # [E Hkv, B, G]
        full[er, :, :, ej] = scores.view(n, n_kv, width, group).transpose(-1, -2) * scale
    for span in kb.spans:
        keys = _rows(keys_of, span.index).view(n_kv, -1, width, head_dim)  # [Hkv, blocks, B, D]
        for j, h, r in _span_blocks(span, n_kv):
            b = qt[r, h].contiguous()  # [n, D, G]
            scores = torch.bmm(keys[h, j].expand(b.shape[0], -1, -1), b)  # [n, B, G]
            full[r, h, :, j] = scores.transpose(-1, -2) * scale
    flat = full.view(rows, n_kv, group, blocks * width)
    if softcap:  # by whole rows (rowwise): tanh's vector loop and tail round apart
        flat = rowwise(lambda t: torch.tanh(t / softcap) * softcap,
                       flat.reshape(-1, blocks * width)).view(flat.shape)
    flat.masked_fill_(kb.masked[:, None, None, :], -torch.inf)
    probs = torch.softmax(flat, dim=-1).view(rows, n_kv, group, blocks, width)
    acc = qt.new_zeros(rows, kb.tree, n_kv, group, head_dim)
    if n:
        values = _rows(values_of, kb.index).view(n * n_kv, width, head_dim)
        pe = probs[er, :, :, ej].contiguous().view(n * n_kv, group, width)
        acc[er, ej] = torch.bmm(pe, values).view(n, n_kv, group, head_dim)
    for span in kb.spans:
        values = _rows(values_of, span.index).view(n_kv, -1, width, head_dim)
        for j, h, r in _span_blocks(span, n_kv):
            p = probs[r, h, :, j].contiguous()  # [n, G, B]
            acc[r, j, h] = torch.bmm(p, values[h, j].expand(p.shape[0], -1, -1))
    while acc.shape[1] > 1:  # pairwise, in a fixed shape: zero padding adds exact zeros
        acc = acc[:, 0::2] + acc[:, 1::2]
    return acc[:, 0].reshape(rows, n_heads, head_dim).to(q.dtype)


def _rows(table: Tensor, index: Tensor) -> Tensor:
    """``table[index]`` as a contiguous float32 tensor (one row copy per index)."""
    return _float32(table.index_select(0, index))


def _span_blocks(span: Span, n_kv: int) -> list[tuple[int, int, slice]]:
    """(block, KV head, rows) for every key block of a span and KV head: the rows whose
    position reaches the block."""
    return [
        (j, h, slice(span.start + max(0, j * KEY_BLOCK - span.first), span.end))
        for j in range(span.num_blocks)
        for h in range(n_kv)
    ]


def _float32(x: Tensor) -> Tensor:
    """A contiguous float32 copy (one layout: the matmul's code path depends on it)."""
    return torch.empty(x.shape, dtype=torch.float32, device=x.device).copy_(x)

"""The properties of torch's kernels that the batch-invariant kernels (invariant.py) rest
on, checked on this machine's build, for the shapes the tiny models and SmolLM2 have:
if a torch, MKL or oneDNN upgrade breaks one, these fail before the engine tests do."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backends.engine import invariant
from backends.engine.model import _can_pack, _onednn, refine_top_logits
from backends.engine.sampling import gumbel_noise

# (N, K) of the linears: the tiny test models, then SmolLM2-135M's
SHAPES = [(128, 64), (64, 64), (256, 64), (64, 128), (960, 576), (3072, 576), (576, 1536)]


def _kernels(dtype: torch.dtype, weight: torch.Tensor) -> dict[str, object]:
    out: dict[str, object] = {"F.linear": lambda x: F.linear(x, weight)}
    if dtype == torch.bfloat16 and _can_pack(weight):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        out["onednn-packed"] = lambda x: _onednn(x, packed)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_a_tile_computes_a_row_the_same_way_wherever_it_sits(
    dtype: torch.dtype, n: int, k: int
) -> None:
    """At the tile's fixed row count a row's output depends on the row alone: not on
    its place in the tile nor on the other rows; by_tiles then gives it the same bits
    for any number of rows (MKL's float32 GEMM alone does not: M = 1, 2-3, 4-15, 16+
    each give other last bits here)."""
    gen = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    rows = invariant.tile_rows(weight)
    row = torch.randn(1, k, generator=gen).to(dtype)
    for name, kernel in _kernels(dtype, weight).items():
        tile = torch.randn(rows, k, generator=gen).to(dtype)
        tile[0] = row
        expected = kernel(tile)[0]  # type: ignore[operator]
        for place in range(rows):
            other = torch.randn(rows, k, generator=gen).to(dtype)
            other[place] = row
            assert torch.equal(kernel(other)[place], expected), (name, place)  # type: ignore[operator]
        for m in (1, 2, 3, rows - 1, rows + 1, 3 * rows + 5, 40):
            x = torch.randn(m, k, generator=gen).to(dtype)
            x[m // 2] = row
            y = invariant.by_tiles(kernel, x, rows)  # type: ignore[arg-type]
            assert y.shape == (m, n) and torch.equal(y[m // 2], expected), (name, m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_query_attends_the_same_way_in_any_step(dtype: torch.dtype) -> None:
    """A query at position p over its sequence's cache: alone, as one row of a 300-token
    prefill (a span: the sequence's keys read in place, or rows gathered one by one),
    or next to rows of other sequences with longer contexts (more key blocks, so more
    padding), the same bits; and close to SDPA's result."""
    gen = torch.Generator().manual_seed(1)
    blocks, bs, n_kv, d, heads = 96, 4, 2, 32, 6
    k_cache = torch.randn(blocks, bs, n_kv, d, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, bs, n_kv, d, generator=gen).to(dtype)
    table = torch.randperm(blocks, generator=gen)[:80]  # the sequence: 320 positions
    other = torch.randperm(blocks, generator=gen)[:90]
    queries = torch.randn(360, heads, d, generator=gen).to(dtype)

    def attend(rows: list[tuple[torch.Tensor, int]], spans=()) -> torch.Tensor:  # type: ignore[no-untyped-def]
        width = max(len(t) for t, _ in rows)
        tables = torch.stack([F.pad(t, (0, width - len(t))) for t, _ in rows])
        lens = torch.tensor([p + 1 for _, p in rows])
        q = torch.stack([queries[p] for _, p in rows])
        kb = invariant.key_blocks(tables, lens, bs, n_kv, spans)
        return invariant.attention(q, k_cache, v_cache, kb)

    span = attend([(table, p) for p in range(300)], spans=((0, 300),))
    gathered = attend([(table, p) for p in range(300)])
    chunks = attend([(other, 355)] + [(table, p) for p in range(170, 240)], spans=((1, 71),))
    for p in (0, 3, 63, 64, 65, 200, 299):
        alone = attend([(table, p)])[0]
        mixed = attend([(other, 355), (table, p), (other[:3], 11)])[1]
        assert torch.equal(alone, span[p]) and torch.equal(alone, gathered[p]), p
        assert torch.equal(alone, mixed), p
        if 170 <= p < 240:
            assert torch.equal(alone, chunks[1 + p - 170]), p
        keys = k_cache[table].reshape(-1, n_kv, d)[: p + 1].float().transpose(0, 1)
        values = v_cache[table].reshape(-1, n_kv, d)[: p + 1].float().transpose(0, 1)
        q = queries[p].float().view(n_kv, heads // n_kv, d)
        sdpa = F.scaled_dot_product_attention(q, keys, values).reshape(heads, d)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(alone.float(), sdpa, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("width", [128, 1536, 100])
def test_swiglu_and_rms_norm_give_a_row_the_same_bits_in_any_batch(
    dtype: torch.dtype, width: int
) -> None:
    """SiLU's vector body and scalar tail differ in the last bit (float32: about one
    element in 25), so a plain call gives a row other bits alone than inside a batch
    whose tails fall elsewhere (width 100 here); rowwise keeps every element in the
    vector code."""
    gen = torch.Generator().manual_seed(width)
    gate, up = (torch.randn(601, width, generator=gen).to(dtype) for _ in range(2))
    weight = torch.randn(width, generator=gen).to(dtype)

    def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return F.silu(g) * u

    full = invariant.rowwise(swiglu, gate, up)
    norm = invariant.rms_norm(gate, weight, 1e-5)
    for row in range(0, 601, 7):
        rows = slice(row, row + 1 + row % 5)
        assert torch.equal(invariant.rowwise(swiglu, gate[rows], up[rows]), full[rows]), row
        assert torch.equal(invariant.rms_norm(gate[rows], weight, 1e-5), norm[rows]), row


def test_the_refined_head_and_the_sampling_noise_depend_on_the_row_only() -> None:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(4099, 64, generator=gen).to(torch.bfloat16)
    hidden = torch.randn(40, 64, generator=gen).to(torch.bfloat16)
    logits = F.linear(hidden, weight).float()
    logits[:, 7] = logits.amax(-1) - 1e-3  # near-ties to refine
    full = logits.clone()
    refine_top_logits(full, hidden, weight)
    for m in (1, 5, 33):
        part = logits[-m:].clone()
        refine_top_logits(part, hidden[-m:], weight)
        assert torch.equal(part, full[-m:]), m
    keys = [(11, p) for p in range(40)]
    noise = gumbel_noise(keys, 49152)
    for m in (1, 3, 17):
        assert torch.equal(gumbel_noise(keys[-m:], 49152), noise[-m:]), m

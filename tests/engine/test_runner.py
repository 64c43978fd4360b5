"""The runner's paged KV: chunked prefill, batched decode and shared prefix blocks give
the same logits as one full forward pass of transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends.engine.loader import load_model
from backends.engine.model import _can_pack
from backends.engine.runner import ModelRunner, kv_bytes_per_block
from backends.engine.scheduler import ScheduledSeq
from backends.engine.sequence import SamplingParams, Sequence


@pytest.fixture(scope="module")
def runner(tiny_gguf: Path) -> ModelRunner:
    return ModelRunner(load_model(str(tiny_gguf)).model, num_kv_blocks=64, block_size=4)


def _full_logits(tiny_hf_model, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        out: torch.Tensor = tiny_hf_model(torch.tensor([ids])).logits[0]
    return out


def _seq(name: str, ids: list[int], blocks: list[int]) -> Sequence:
    seq = Sequence(name, ids, SamplingParams())
    seq.block_table = blocks
    return seq


def _advance(item: ScheduledSeq) -> None:
    item.seq.num_computed_tokens += item.num_new_tokens


def test_chunked_prefill_then_batched_decode_matches_full_forward(
    runner: ModelRunner, tiny_hf_model
) -> None:  # type: ignore[no-untyped-def]
    prompts = [list(range(10, 23)), list(range(50, 55)), [7, 8, 9, 260, 261, 262, 263, 30, 31]]
    tails = [[100, 101, 102], [200, 201, 202], [5, 6, 7]]
    # Scattered, interleaved blocks: seq i gets blocks i, i+3, i+6, ...
    seqs = [_seq(f"s{i}", p, list(range(i, 60, 3))) for i, p in enumerate(prompts)]
    # Step 1: a chunk of seq 0 (no sampling) and seq 1 whole; step 2: rest of 0, all of 2.
    step1 = [ScheduledSeq(seqs[0], 6), ScheduledSeq(seqs[1], 5)]
    out1 = runner.execute(step1)
    assert out1.shape == (1, runner.args.vocab_size)
    torch.testing.assert_close(
        out1[0], _full_logits(tiny_hf_model, prompts[1])[-1], rtol=1e-4, atol=1e-4
    )
    for item in step1:
        _advance(item)
    step2 = [ScheduledSeq(seqs[0], 7), ScheduledSeq(seqs[2], 9)]
    out2 = runner.execute(step2)
    for item in step2:
        _advance(item)
    torch.testing.assert_close(
        out2[0], _full_logits(tiny_hf_model, prompts[0])[-1], rtol=1e-4, atol=1e-4
    )
    # Decode steps: all three sequences in one batch, one token each.
    for t in range(3):
        for seq, tail in zip(seqs, tails, strict=True):
            seq.token_ids.append(tail[t])
        step = [ScheduledSeq(s, 1) for s in seqs]
        logits = runner.execute(step)
        for item in step:
            _advance(item)
        for row, seq in enumerate(seqs):
            expected = _full_logits(tiny_hf_model, seq.token_ids)[-1]
            torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)


def test_prefix_blocks_written_by_one_sequence_serve_another(
    runner: ModelRunner, tiny_hf_model
) -> None:  # type: ignore[no-untyped-def]
    prefix = list(range(60, 68))  # two full blocks of 4
    a = _seq("a", [*prefix, 1, 2], [40, 41, 42])
    runner.execute([ScheduledSeq(a, 10)])
    b = _seq("b", [*prefix, 3, 4, 5], [40, 41, 43])  # shares blocks 40, 41
    b.num_computed_tokens = 8
    logits = runner.execute([ScheduledSeq(b, 3)], [3])
    torch.testing.assert_close(
        logits, _full_logits(tiny_hf_model, b.token_ids)[-3:], rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_short_span_is_computed_exactly_like_decoding_it_token_by_token(
    tiny_gguf: Path, dtype: torch.dtype
) -> None:
    """Speculative verification feeds k tokens at once; each must come out as if it had
    been decoded alone (bit for bit where the linears are row-invariant), or speculation
    would change the output. The span crosses a block boundary, so its rows are padded
    to a wider context than the same tokens decoded alone."""
    model = load_model(str(tiny_gguf), dtype=dtype).model
    prompt, tail = list(range(20, 50)), [60, 61, 62, 63, 64]  # positions 30..34; blocks of 16
    logits = []
    for span in (1, len(tail)):
        r = ModelRunner(model, num_kv_blocks=16, block_size=16)
        seq = _seq("s", list(prompt), [3, 9, 1])
        r.execute([ScheduledSeq(seq, len(prompt))])
        _advance(ScheduledSeq(seq, len(prompt)))
        rows = []
        for i in range(0, len(tail), span):
            seq.token_ids += tail[i : i + span]
            item = ScheduledSeq(seq, span)
            rows.append(r.execute([item], [span]))
            _advance(item)
        logits.append(torch.cat(rows))
    if dtype == torch.bfloat16 and _can_pack(model.output.weight):
        # Row-invariant linears (oneDNN prepacked, up to 32 rows): bit for bit.
        assert torch.equal(logits[0], logits[1])
    else:  # MKL's float32 GEMV and GEMM round differently: last bits only
        torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def test_logits_rows_follow_schedule_order_and_skip_mid_prompt_chunks(runner: ModelRunner) -> None:
    a = _seq("a", [1, 2, 3, 4, 5, 6], [50, 51])
    b = _seq("b", [9, 10], [52])
    out = runner.execute([ScheduledSeq(a, 2), ScheduledSeq(b, 2)])
    assert out.shape[0] == 1  # only b reached the end of its tokens
    assert runner.execute([]).shape == (0, runner.args.vocab_size)


def test_too_few_blocks_is_an_error(runner: ModelRunner) -> None:
    seq = _seq("x", list(range(1, 10)), [1])
    with pytest.raises(ValueError, match="cannot compute"):
        runner.execute([ScheduledSeq(seq, 9)])


def test_bfloat16_runner_stays_close_to_float32(tiny_gguf: Path, runner: ModelRunner) -> None:
    bf = ModelRunner(
        load_model(str(tiny_gguf), dtype=torch.bfloat16).model, num_kv_blocks=8, block_size=4
    )
    assert bf.kv.dtype == torch.bfloat16
    ids = list(range(20, 31))
    lo = bf.execute([ScheduledSeq(_seq("a", ids, [0, 1, 2]), len(ids))])
    hi = runner.execute([ScheduledSeq(_seq("b", ids, [60, 61, 62]), len(ids))])
    assert lo.dtype == torch.float32
    assert float((lo - hi).abs().max() / hi.abs().max()) < 0.05


def test_kv_bytes_per_block(runner: ModelRunner) -> None:
    a = runner.args
    assert (
        kv_bytes_per_block(a, 16, torch.float32)
        == 2 * a.n_layers * 16 * a.n_kv_heads * a.head_dim * 4
    )
    assert runner.kv.numel() * 4 == kv_bytes_per_block(a, 4, torch.float32) * 64

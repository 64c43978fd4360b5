"""The runner level: the logits at every position of a sequence are the same bits
however the positions are split into steps and whatever else the steps hold."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends.engine import native
from backends.engine.loader import load_model
from backends.engine.quant import attach_q4
from backends.engine.runner import ModelRunner
from backends.engine.scheduler import ScheduledSeq
from backends.engine.sequence import SamplingParams, Sequence

TOKENS = [(7 * i + 3) % 250 + 3 for i in range(90)]
OTHER = [(5 * i + 1) % 250 + 3 for i in range(70)]
PATHS = ["torch-float32", "torch-bfloat16", "native-bfloat16"]


def _runner(models: dict[str, Path], path: str, *, batch_invariant: bool = True) -> ModelRunner:
    dtype = torch.float32 if path.endswith("float32") else torch.bfloat16
    loaded = load_model(str(models["q4" if path.startswith("native") else "f32"]), dtype=dtype)
    runner = ModelRunner(loaded.model, num_kv_blocks=128, block_size=4, dtype=dtype,
                         batch_invariant=batch_invariant)
    if path.startswith("native"):
        if native.library() is None:
            pytest.skip("no C compiler here: no native kernels")
        attach_q4(runner.model, loaded.q4)
        assert runner.model.native_plan() is not None
    return runner


def _seq(name: str, tokens: list[int], first_block: int) -> Sequence:
    seq = Sequence(name, list(tokens), SamplingParams())
    seq.block_table = list(range(first_block, first_block + 30))
    return seq


def _logits(runner: ModelRunner, splits: list[int], *, with_other: bool) -> torch.Tensor:
    """Every position's logits, TOKENS computed in steps of ``splits`` tokens (OTHER
    decoding beside it, a token per step, when ``with_other``)."""
    seq, other = _seq("s", TOKENS, 0), _seq("o", OTHER, 40)
    rows = []
    for n in splits:
        items, counts = [ScheduledSeq(seq, n)], [n]
        k = 1 if other.num_computed_tokens else 40  # its prompt, then a token per step
        if with_other:
            items.append(ScheduledSeq(other, k))
            counts.append(1)
        rows.append(runner.execute(items, counts)[:n])
        seq.num_computed_tokens += n
        other.num_computed_tokens += k if with_other else 0
    return torch.cat(rows)


@pytest.mark.parametrize("path", PATHS)
def test_every_position_gets_the_same_logits_however_the_sequence_is_split(
    tiny_models: dict[str, Path], path: str
) -> None:
    runner = _runner(tiny_models, path)
    whole = _logits(runner, [len(TOKENS)], with_other=False)
    assert whole.shape[0] == len(TOKENS)
    for splits, with_other in [
        ([1] * len(TOKENS), False),  # decoded token by token
        ([64, 1, 25], True),  # a chunk, a decode, a chunk, next to another sequence
        ([3, 8, 17, 62], True),
        ([40, 50], False),  # a cached prefix, then the rest
    ]:
        assert torch.equal(_logits(runner, splits, with_other=with_other), whole), splits


@pytest.mark.parametrize("path", PATHS[:2])
def test_the_model_computes_a_prefill_span_as_the_runners_per_token_rows(
    tiny_models: dict[str, Path], path: str
) -> None:
    """With the model in invariant mode, a step laid out the other way (prefill spans,
    as the runner lays them out without batch_invariant) gives the same bits."""
    runner = _runner(tiny_models, path)
    spans = _runner(tiny_models, path, batch_invariant=False)
    spans.model.set_batch_invariant(True)
    for splits in ([len(TOKENS)], [30, 60]):
        assert torch.equal(
            _logits(spans, splits, with_other=True), _logits(runner, splits, with_other=True)
        )

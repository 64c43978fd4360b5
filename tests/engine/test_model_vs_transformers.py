"""Correctness: our logits equal transformers' on the same GGUF file (float32).

transformers un-permutes GGUF q/k and uses rotate_half RoPE; we keep llama.cpp's
layout and rotate adjacent pairs. Agreement to 1e-4 checks the loader, RoPE, GQA,
RMSNorm, SwiGLU and (un)tied heads at once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from backends.engine.loader import LoadedModel, default_model_path, load_model
from backends.engine.runner import ModelRunner
from backends.engine.scheduler import ScheduledSeq
from backends.engine.sequence import SamplingParams, Sequence

PROMPTS = [[5, 70, 100, 200, 33, 44, 9, 10], [1, 260, 261, 262, 40, 41], list(range(3, 40))]


def _ours_all_positions(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Logits at every position of ``ids`` through the paged runner (one prefill)."""
    seq = Sequence("s", ids, SamplingParams())
    blocks = -(-len(ids) // runner.block_size)
    seq.block_table = list(range(runner.num_kv_blocks - 1, runner.num_kv_blocks - 1 - blocks, -1))
    return runner.execute([ScheduledSeq(seq, len(ids))], [len(ids)])


def _reference(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", ["tiny-f32.gguf", "tiny-q8.gguf"])
def test_tiny_gguf_logits_match_transformers(tiny_dir: Path, name: str) -> None:
    path = tiny_dir / name
    ref = _reference(path)
    runner = ModelRunner(load_model(str(path)).model, num_kv_blocks=8, block_size=16)
    for ids in PROMPTS:
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0]
        assert _rel_err(_ours_all_positions(runner, ids), expected) < 1e-4


def test_tied_tiny_gguf_logits_match_transformers(tmp_path: Path) -> None:
    from tests.engine import tiny

    path = tiny.write_gguf(tiny.hf_model(tie=True, seed=3), tmp_path / "tied.gguf")
    ref = _reference(path)
    runner = ModelRunner(load_model(str(path)).model, num_kv_blocks=8, block_size=16)
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPTS[0]])).logits[0]
    assert _rel_err(_ours_all_positions(runner, PROMPTS[0]), expected) < 1e-4


@pytest.mark.slow
def test_default_smollm2_logits_match_transformers(smol: LoadedModel) -> None:
    """The real Q4_1 SmolLM2-135M on short prompts (dequantised identically on both sides)."""
    path = Path(default_model_path())
    loaded = smol
    ref = _reference(path)
    runner = ModelRunner(loaded.model, num_kv_blocks=8, block_size=16)
    for text in ["The capital of France is", "def fibonacci(n):"]:
        ids = loaded.tokenizer.encode(text)
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0]
        assert _rel_err(_ours_all_positions(runner, ids), expected) < 1e-4

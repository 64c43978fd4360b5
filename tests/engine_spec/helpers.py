"""A tiny random Llama (built in plain torch, no files) and a driver that runs an
engine to completion, shared by the speculative-decoding tests."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch

from backends.engine.config import EngineConfig
from backends.engine.engine import LLMEngine
from backends.engine.model import ModelArgs, Transformer
from backends.engine.runner import ModelRunner
from backends.engine.sequence import SamplingParams

ARGS = ModelArgs(
    vocab_size=48,
    dim=32,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    hidden_dim=64,
    head_dim=8,
    max_seq_len=256,
)
EOS = 47


def tiny_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ARGS)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3)
            if "norm" in name:
                p.add_(1.0)
    model.reset_rope()
    return model.eval().requires_grad_(False)


def config(**kw: Any) -> EngineConfig:
    base: dict[str, Any] = {
        "device": "cpu",
        "block_size": 4,
        "num_kv_blocks": 96,
        "max_num_seqs": 8,
    }
    base.update(kw)
    return EngineConfig(**base)


def runner_for(model: Transformer, cfg: EngineConfig) -> ModelRunner:
    assert cfg.num_kv_blocks is not None
    return ModelRunner(model, cfg.num_kv_blocks, cfg.block_size, "cpu")


def run(
    engine: LLMEngine, requests: Seq[tuple[str, list[int], SamplingParams]]
) -> dict[str, list[int]]:
    """Add every request, step to completion; the tokens each request produced."""
    out: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    for _ in range(2000):
        if not engine.has_unfinished():
            return out
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    raise AssertionError("engine did not finish")


def mixed_requests(n: int, max_tokens: int = 24) -> list[tuple[str, list[int], SamplingParams]]:
    reqs: list[tuple[str, list[int], SamplingParams]] = []
    for i in range(n):
        prompt = [(7 * i + j) % 40 for j in range(3 + 2 * i)]
        if i % 3 == 0:
            p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=i)
        elif i % 3 == 1:
            p = SamplingParams(
                temperature=0.9, top_k=20, max_tokens=max_tokens, ignore_eos=True, seed=1000 + i
            )
        else:
            p = SamplingParams(
                temperature=0.7,
                top_p=0.9,
                repetition_penalty=1.3,
                frequency_penalty=0.5,
                max_tokens=max_tokens,
                min_tokens=5,
                seed=2000 + i,
                logprobs=2,
            )
        reqs.append((f"r{i}", prompt, p))
    return reqs

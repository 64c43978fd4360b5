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
    vocab_size=48, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=64, head_dim=8, max_seq_len=256
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
    base: dict[str, Any] = {"device": "cpu", "block_size": 4, "num_kv_blocks": 96, "max_num_seqs": 8}
    base.update(kw)
    return EngineConfig(**base)


def runner_for(model: Transformer, cfg: EngineConfig) -> ModelRunner:
    assert cfg.num_kv_blocks is not None
    return ModelRunner(model, cfg.num_kv_blocks, cfg.block_size, "cpu")


def run(engine: LLMEngine, requests: Seq[tuple[str, list[int], SamplingParams]]) -> dict[str, list[int]]:
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

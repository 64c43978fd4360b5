"""Tiny random models for the tensor-parallel tests, built the same way in every rank.

``RandomModel`` is a picklable builder: each spawned rank calls it and gets bit-identical
weights (a seeded generator, parameters in a fixed order), then keeps its shard. Sizes are
chosen so that nothing divides evenly: 3 KV groups, intermediate size 77, vocab 101.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.engine.model import ModelArgs, Transformer


def tiny_args(
    *, tie: bool = True, bias: bool = False, n_heads: int = 6, n_kv_heads: int = 3
) -> ModelArgs:
    return ModelArgs(
        vocab_size=101,
        dim=48,
        n_layers=2,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        hidden_dim=77,
        head_dim=8,
        max_seq_len=128,
        tie_embeddings=tie,
        attention_bias=bias,
    )


@dataclass(frozen=True)
class RandomModel:
    args: ModelArgs
    seed: int = 0

    def __call__(self) -> Transformer:
        gen = torch.Generator().manual_seed(self.seed)
        model = Transformer(self.args)
        with torch.no_grad():
            for name, p in model.named_parameters():  # a tied weight is listed once
                p.copy_(
                    torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if "norm" in name else 0.0)
                )
        return model.eval().requires_grad_(False)


@dataclass(frozen=True)
class FailingBuild:
    """A builder that fails in the worker, as a missing model file would."""

    def __call__(self) -> Transformer:
        raise FileNotFoundError("no such model: /nowhere/model.gguf")

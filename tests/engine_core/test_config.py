"""EngineConfig: validated knobs and the KV budget rules."""

from __future__ import annotations

import msgspec
import pytest

from backends.engine.config import EngineConfig
from backends.errors import BadRequest

MiB = 1 << 20


def test_defaults_follow_the_issue() -> None:
    c = EngineConfig()
    assert (c.block_size, c.max_num_seqs, c.max_num_batched_tokens) == (16, 32, 512)
    assert c.enable_prefix_caching and c.model is None and c.dtype == "float32"


def test_num_kv_blocks_wins_then_kv_cache_gb() -> None:
    assert EngineConfig(num_kv_blocks=7).resolve_num_kv_blocks(MiB, 2048, "cpu") == 7
    assert EngineConfig(kv_cache_gb=0.5).resolve_num_kv_blocks(MiB, 2048, "cpu") == 512


def test_default_budget_covers_all_sequences_capped_at_1_gib_on_cpu() -> None:
    small = EngineConfig(max_num_seqs=4)
    assert small.resolve_num_kv_blocks(MiB, 1024, "cpu") == 4 * 64
    big = EngineConfig(max_num_seqs=64)
    assert big.resolve_num_kv_blocks(MiB, 8192, "cpu") == 1024  # 1 GiB / 1 MiB
    assert big.resolve_num_kv_blocks(MiB, 8192, "cuda") == 8192  # 8 GiB cap off the CPU
    # never less than one full-length sequence
    assert EngineConfig().resolve_num_kv_blocks(64 * MiB, 8192, "cpu") == 512


def test_max_model_len_is_capped_by_the_model() -> None:
    assert EngineConfig().resolve_max_model_len(8192) == 8192
    assert EngineConfig(max_model_len=1000).resolve_max_model_len(8192) == 1000
    assert EngineConfig(max_model_len=10_000).resolve_max_model_len(8192) == 8192


def test_bad_values_are_rejected_on_construction_and_decode() -> None:
    with pytest.raises(BadRequest):
        EngineConfig(block_size=0)
    with pytest.raises(BadRequest):
        EngineConfig(num_kv_blocks=10, kv_cache_gb=1.0)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"max_num_seqs": -1}, EngineConfig)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"bogus": 1}, EngineConfig)
    assert msgspec.convert({"block_size": 32}, EngineConfig).block_size == 32

"""Tiny random models for the invariance tests, written once per session: the same
weights as float32 GGUF (dense) and as Q4_1 GGUF (4-bit codes: the native kernels, and
torch's int4 kernel on the torch path)."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from tests.engine import tiny


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("invariance")
    # head_dim 32: the native kernels' bfloat16 dot-product attention takes it
    model = tiny.hf_model(hidden=64, heads=2, kv_heads=1, layers=3)
    return {
        "f32": tiny.write_gguf(model, root / "tiny-f32.gguf"),
        "q4": tiny.write_gguf(model, root / "tiny-q4_1.gguf", qtype=gguf.GGMLQuantizationType.Q4_1),
    }

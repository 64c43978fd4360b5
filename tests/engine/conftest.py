"""Tiny random models shared by the engine tests (built once per session, on disk)."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from backends.engine.loader import LoadedModel, load_model
from tests.engine import tiny


@pytest.fixture(scope="session")
def tiny_hf_model():  # type: ignore[no-untyped-def]
    return tiny.hf_model()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, tiny_hf_model) -> Path:  # type: ignore[no-untyped-def]
    """A folder with the tiny model as F32 GGUF, Q8_0 GGUF, and a HF sub-folder."""
    root = tmp_path_factory.mktemp("tiny")
    tiny.write_gguf(tiny_hf_model, root / "tiny-f32.gguf")
    tiny.write_gguf(tiny_hf_model, root / "tiny-q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    tiny.write_hf(tiny_hf_model, root / "hf")
    return root


@pytest.fixture(scope="session")
def tiny_gguf(tiny_dir: Path) -> Path:
    return tiny_dir / "tiny-f32.gguf"


@pytest.fixture(scope="session")
def smol() -> LoadedModel:
    """The default SmolLM2-135M-Instruct (Q4_1 GGUF), float32, loaded once."""
    return load_model()

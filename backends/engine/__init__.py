"""The built-in torch engine (nano-vllm layout, gpt-fast style model code).

Names are resolved lazily (PEP 562): ``import backends.engine.scheduler`` must not
pay for importing torch, and ``headrace mock`` must not either.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "EngineBackend",
    "EngineConfig",
    "LLMEngine",
    "ModelArgs",
    "ModelRunner",
    "Tokenizer",
    "Transformer",
    "build_engine",
    "load_model",
    "open_engine_backend",
]

_WHERE = {
    "EngineBackend": "backends.engine.backend",
    "build_engine": "backends.engine.backend",
    "open_engine_backend": "backends.engine.backend",
    "EngineConfig": "backends.engine.config",
    "LLMEngine": "backends.engine.engine",
    "ModelArgs": "backends.engine.model",
    "Transformer": "backends.engine.model",
    "ModelRunner": "backends.engine.runner",
    "Tokenizer": "backends.engine.tokenizer",
    "load_model": "backends.engine.loader",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'backends.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

